#!/usr/bin/env bash
# DSBench with MAPPA at the paper's recipe: three agents (Data Engineer -> Modeler -> Analyst), each its own
# Qwen3-4B with up to 4 actions of code + execution in a shared per-episode workspace; REINFORCE++ with
# per-action coach scores, KL 0.01 in the reward, lr 1e-6, rollout batch 16, 16K generation, 30 episodes,
# ZeRO-3, bf16. Placed as train_mappa_mathchat.sh (which says how): each agent's actor, reference and 2 vLLM
# engines share that agent's 2 GPUs, sleeping in turn; Adam states on CPU and forward micro-batches of 2, so
# that an action of --data.max_len tokens fits an 80 GiB GPU: 6 GPUs of one 8-GPU node. GPUS_PER_AGENT,
# COLOCATE (agent, team, none) and ACTOR_GPUS, REF_GPUS, ENGINES (with COLOCATE=none) change it. `mappa plan`
# with these flags (plus --mappa.gpus N --mappa.gpu_memory_gib G) prints where everything goes and its memory
# per phase, and the launch checks the same. The policy loss weighs every sequence the same, as the authors'
# (--actor.loss_agg_mode seq-mean-token-mean; see train_mappa_mathchat.sh).
#
# Tasks: the paper trains on DSBench's 64 modeling tasks and evaluates on 8 (before the first step and every 2
# steps, 4 samples each at T 0.6, as the authors). Download DSBench's data yourself, then
#   mappa dsbench import --data-root DIR --metadata data/dsbench_modeling_train.json --out data/dsbench
#   mappa dsbench import --data-root DIR --metadata data/dsbench_modeling_eval.json --out data/dsbench-eval
# (DIR holds data_resplit/ and answers/; metadata rows as in mappa-bench's dsbench_modeling_*.json; the agents get
# the authors' cleaned task text from data/dsbench_modeling_cleaned_prompts.json beside it, or --task-text raw;
# tasks whose files are missing are skipped and named). Offline, without DSBench:
#   mappa dsbench make-pack data/dsbench-offline   and   MAPPA_TRAIN_DATA=$PWD/data/dsbench-offline/tasks.jsonl
# The coach is the authors': Gemini 2.5 Pro (thinking, temperature 0, free text) through Google's
# OpenAI-compatible endpoint (export GEMINI_API_KEY=...), up to 300 s a request: a thinking coach on 16K-token
# actions can take minutes, and a timed-out verdict leaves its action out. Another endpoint, or the open-weight
# Qwen3-32B under vllm serve: MAPPA_COACH_BASE_URL, MAPPA_COACH_MODEL, MAPPA_COACH_API_KEY_ENV (see
# train_mappa_mathchat.sh).
# As the authors' scripts/run_train_dsbench.sh: 2 samples per task, train batch 16. Chosen here: prompts up to
# 16K tokens (data.max_len = 16K prompt + 16K generation; theirs allows 24K prompts).
set -euo pipefail

# Absolute paths: `ray job submit` runs the job in a temporary copy of working_dir, where relative outputs
# would be lost with the copy (and --ckpt.load_enable would find nothing to resume from).
OUT=${MAPPA_OUT:-$PWD/runs/dsbench}
COLOCATE=${COLOCATE:-agent} GPUS=${GPUS_PER_AGENT:-2} AGENTS=3
ACTOR_GPUS=${ACTOR_GPUS:-$GPUS} REF_GPUS=${REF_GPUS:-$GPUS} ENGINES=${ENGINES:-$GPUS}
case $COLOCATE in  # as in train_mappa_mathchat.sh
  none) NEED=$((AGENTS * (ACTOR_GPUS + REF_GPUS + ENGINES))) SLEEP="" UTIL=0.6 ;;
  agent) NEED=$((AGENTS * GPUS)) SLEEP="--vllm.enable_sleep --ds.enable_sleep" UTIL=0.6 ;;
  team) NEED=$GPUS SLEEP="--vllm.enable_sleep --ds.enable_sleep" UTIL=0.2 ;;
  *) echo "COLOCATE must be none, agent or team" >&2; exit 2 ;;
esac
echo "[mappa] this recipe needs $NEED GPUs in the Ray cluster: $AGENTS agents, --mappa.colocate $COLOCATE" \
     "($ACTOR_GPUS actor + $REF_GPUS reference GPUs + $ENGINES vLLM engines per agent); outputs in $OUT"
# MAPPA_DOCTOR=<a small model, e.g. Qwen/Qwen3-0.6B>: check the cluster first (`mappa doctor`: these flags with that
# model for every agent; one step of each component, weight syncs, sleep, threads, host memory; a few minutes).
ENTRY=(openrlhf_mappa.cli.train_mappa_ray)
[ -z "${MAPPA_DOCTOR:-}" ] || ENTRY=(openrlhf_mappa.tools.mappa doctor --mappa.model "$MAPPA_DOCTOR")
# The agents are Qwen/Qwen3-4B (the topology's `model:`): the paper's "Qwen3-4B", the authors' DSBench
# script's. Their README and MathChat script run Qwen/Qwen3-4B-Thinking-2507:
# MAPPA_MODEL=Qwen/Qwen3-4B-Thinking-2507 puts every agent on it (--mappa.model; ignored with MAPPA_DOCTOR,
# whose small model the self-check needs).
MODEL=()
[ -n "${MAPPA_DOCTOR:-}" ] || [ -z "${MAPPA_MODEL:-}" ] || MODEL=(--mappa.model "$MAPPA_MODEL")
# The paper's tasks (README, Data): imported from the authors' metadata in MAPPA_DATA (default $PWD/data), which is
# refused when missing or not theirs (SHA-256). MAPPA_TRAIN_DATA, MAPPA_EVAL_DATA (absolute paths): your own.
DATA=${MAPPA_DATA:-$PWD/data}
source examples/scripts/paper_data.sh  # run from the checkout, as --mappa.topology below
[ -n "${MAPPA_TRAIN_DATA:-}" ] || imported "$PWD/data/dsbench/tasks.jsonl" "$DATA/dsbench_modeling_train.json"
[ -n "${MAPPA_EVAL_DATA:-}" ] || imported "$PWD/data/dsbench-eval/tasks.jsonl" "$DATA/dsbench_modeling_eval.json"
FLAGS=(
   --mappa.topology examples/configs/dsbench.yaml \
   "${MODEL[@]}" \
   --mappa.reward process \
   --mappa.coach.kind openai \
   --mappa.coach.base_url "${MAPPA_COACH_BASE_URL:-https://generativelanguage.googleapis.com/v1beta/openai/}" \
   --mappa.coach.model "${MAPPA_COACH_MODEL:-gemini-2.5-pro}" \
   --mappa.coach.api_key_env "${MAPPA_COACH_API_KEY_ENV:-GEMINI_API_KEY}" \
   --mappa.coach.structured off \
   --mappa.coach.timeout 300 \
   --mappa.run_dir "$OUT/run" \
   --data.prompt_dataset "${MAPPA_TRAIN_DATA:-$PWD/data/dsbench/tasks.jsonl}" \
   --eval.dataset "${MAPPA_EVAL_DATA:-$PWD/data/dsbench-eval/tasks.jsonl}" \
   --eval.steps 2 \
   --eval.n_samples_per_prompt 4 \
   --eval.temperature 0.6 \
   --mappa.colocate "$COLOCATE" $SLEEP \
   --actor.num_gpus_per_node "$ACTOR_GPUS" \
   --ref.num_gpus_per_node "$REF_GPUS" \
   --vllm.num_engines "$ENGINES" \
   --vllm.tensor_parallel_size 1 \
   --vllm.gpu_memory_utilization "$UTIL" \
   --ds.zero_stage 3 \
   --ds.param_dtype bf16 \
   --ds.adam_offload \
   --algo.advantage.estimator reinforce \
   --algo.kl.init_coef 0.01 \
   --algo.kl.estimator k1 \
   --actor.adam.lr 1e-6 \
   --actor.loss_agg_mode seq-mean-token-mean \
   --rollout.batch_size 16 \
   --rollout.n_samples_per_prompt 2 \
   --rollout.micro_batch_size 2 \
   --rollout.max_new_tokens 16384 \
   --data.max_len 32768 \
   --train.batch_size 16 \
   --train.micro_batch_size 1 \
   --train.num_episodes 30 \
   --actor.gradient_checkpointing_enable \
   --ckpt.save_steps 10 \
   --ckpt.load_enable \
   --ckpt.save_hf \
   --ckpt.path "$OUT/ckpt" \
   --ckpt.output_dir "$OUT/hf" \
   --logger.tensorboard_dir "$OUT/tensorboard" \
   "$@"
)
# The dry run first: every check the launch runs before Ray starts, and the coach scoring one test action
# (`mappa check`, seconds); MAPPA_SKIP_CHECK=1 skips it.
[ -n "${MAPPA_SKIP_CHECK:-}" ] || python3 -m openrlhf_mappa.tools.mappa check "${FLAGS[@]}" || exit 1
set -x

ray job submit --address="http://127.0.0.1:8265" \
   --runtime-env-json='{"working_dir": "."}' \
   -- python3 -m "${ENTRY[@]}" "${FLAGS[@]}"
