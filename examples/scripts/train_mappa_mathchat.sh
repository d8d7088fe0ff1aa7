#!/usr/bin/env bash
# MathChat with MAPPA at the paper's recipe: three agents (Problem Solver -> Code Executor -> Verifier),
# each its own Qwen3-4B, REINFORCE++ with per-action coach scores, KL 0.01 in the reward, lr 1e-6,
# 2 samples per prompt, ZeRO-3, bf16, 4K generation. Placed as the authors ran it: each agent's actor,
# reference and 2 vLLM engines share that agent's 2 GPUs (--mappa.colocate agent); the engines sleep while
# the actor trains and the actor's training states go to CPU while the engines generate (--vllm.enable_sleep
# --ds.enable_sleep), Adam states on CPU (--ds.adam_offload). 6 GPUs for three agents: one 8 x 80 GB node, two
# GPUs left for a coach you serve yourself (they must stay out of Ray; see README, GPU usage).
# Every sequence weighs the same in the policy loss (--actor.loss_agg_mode seq-mean-token-mean), as in the
# authors' runs (a token mean per micro-batch of 1 sequence, averaged over micro-batches); OpenRLHF's default
# token-mean over the step would let one 4K-token action outweigh a short reply many times over.
# GPUS_PER_AGENT changes the count; COLOCATE=team puts all agents on one set of GPUS_PER_AGENT GPUs (8 fit
# one node), COLOCATE=none gives each actor, reference and engine GPUs of their own (ACTOR_GPUS, REF_GPUS,
# ENGINES: 18 GPUs as the defaults).
# `mappa plan` with these flags (plus --mappa.gpus N --mappa.gpu_memory_gib G) prints where everything goes
# and its memory per phase, and the launch checks the same.
#
# The coach is the authors': Gemini 2.5 Flash (thinking) at temperature 0, through Google's OpenAI-compatible
# endpoint: export GEMINI_API_KEY=... It answers in free text (--mappa.coach.structured off: no JSON schema is
# sent), the verdict after its reasoning: only the line `PROCESS_SCORE: <n>` is a score. Up to 300 s a request
# (a thinking coach's long replies; the authors set no limit). Any other OpenAI-compatible endpoint:
#   export MAPPA_COACH_BASE_URL=https://api.openai.com/v1 MAPPA_COACH_MODEL=gpt-4o-mini
#   export MAPPA_COACH_API_KEY_ENV=OPENAI_API_KEY OPENAI_API_KEY=...
# or the open-weight alternative, served locally:  vllm serve Qwen/Qwen3-32B --port 8001
#   export MAPPA_COACH_BASE_URL=http://localhost:8001/v1 MAPPA_COACH_MODEL=Qwen/Qwen3-32B
# Training data: a JSON list / JSONL of {"prompt", "answer"} rows: the paper's 512 of AIME 1983-2024 (seed 42).
# Evaluated as the authors: before the first step and every 4 steps, on AIME 2025 (30 problems) and amc_eval_32,
# 4 samples each at T 0.6 (their 2 per engine x 2 engines), graded by math-verify and by the coach's ANSWER_CORRECT
# (`mappa paper-table $OUT/run` writes the paper's table).
set -euo pipefail

# Absolute paths: `ray job submit` runs the job in a temporary copy of working_dir, where relative outputs
# would be lost with the copy (and --ckpt.load_enable would find nothing to resume from).
OUT=${MAPPA_OUT:-$PWD/runs/mathchat}
COLOCATE=${COLOCATE:-agent} GPUS=${GPUS_PER_AGENT:-2} AGENTS=3
ACTOR_GPUS=${ACTOR_GPUS:-$GPUS} REF_GPUS=${REF_GPUS:-$GPUS} ENGINES=${ENGINES:-$GPUS}
# Colocated, a GPU holds one actor rank, one reference rank and one engine of an agent (of each, for a team).
# A team's engines are all awake in the rollout: each takes a third of the GPU share one engine has alone.
case $COLOCATE in
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
# The paper's data (README, Data): the authors' files in MAPPA_DATA (default $PWD/data), refused when missing or
# not theirs (SHA-256). MAPPA_TRAIN_DATA, MAPPA_EVAL_DATA (absolute paths; eval files comma-separated): your own.
DATA=${MAPPA_DATA:-$PWD/data}
source examples/scripts/paper_data.sh  # run from the checkout, as --mappa.topology below
[ -n "${MAPPA_TRAIN_DATA:-}" ] || paper_data "$DATA" AIME_1983_2024.json
[ -n "${MAPPA_EVAL_DATA:-}" ] || paper_data "$DATA" aime_2025.json amc_eval_32.json
FLAGS=(
   --mappa.topology examples/configs/mathchat.yaml \
   "${MODEL[@]}" \
   --mappa.reward process \
   --mappa.coach.kind openai \
   --mappa.coach.base_url "${MAPPA_COACH_BASE_URL:-https://generativelanguage.googleapis.com/v1beta/openai/}" \
   --mappa.coach.model "${MAPPA_COACH_MODEL:-gemini-2.5-flash}" \
   --mappa.coach.api_key_env "${MAPPA_COACH_API_KEY_ENV:-GEMINI_API_KEY}" \
   --mappa.coach.structured off \
   --mappa.coach.timeout 300 \
   --mappa.run_dir "$OUT/run" \
   --data.prompt_dataset "${MAPPA_TRAIN_DATA:-$DATA/AIME_1983_2024.json}" \
   --data.max_samples 512 \
   --eval.dataset "${MAPPA_EVAL_DATA:-$DATA/aime_2025.json,$DATA/amc_eval_32.json}" \
   --eval.steps 4 \
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
   --rollout.batch_size 32 \
   --rollout.n_samples_per_prompt 2 \
   --rollout.micro_batch_size 2 \
   --rollout.max_new_tokens 4096 \
   --data.max_len 28672 \
   --train.batch_size 16 \
   --train.micro_batch_size 1 \
   --train.num_episodes 8 \
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
# No Ray cluster up: one line saying so, not `ray job submit`'s 40-line connection traceback.
ray status >/dev/null 2>&1 || { echo "[mappa] no Ray cluster is running here (\`ray status\` found none): start one" \
  "first (\`ray start --head --num-gpus $NEED\`, or join this node to yours), then run this script again" >&2; exit 1; }
set -x

ray job submit --address="http://127.0.0.1:8265" \
   --runtime-env-json='{"working_dir": "."}' \
   -- python3 -m "${ENTRY[@]}" "${FLAGS[@]}"
