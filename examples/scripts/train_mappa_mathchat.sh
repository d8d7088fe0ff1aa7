#!/usr/bin/env bash
# MathChat with MAPPA at the paper's recipe: three agents (Problem Solver -> Code Executor -> Verifier),
# each its own Qwen3-4B, REINFORCE++ with per-action coach scores, KL 0.01 in the reward, lr 1e-6,
# 2 samples per prompt, ZeRO-3, bf16. Per agent: 2 actor GPUs, 2 reference GPUs, 2 vLLM engines: 18 GPUs for
# three agents (printed below; ACTOR_GPUS, REF_GPUS, ENGINES change it, as do per-agent overrides in the
# topology YAML). The coach's GPUs, if you serve it yourself, must stay out of Ray (see README, GPU usage).
# Memory: Adam states on CPU (--ds.adam_offload, as the authors ran it) and forward micro-batches of 2, so that
# an action of --data.max_len tokens fits an 80 GiB GPU; `mappa plan` with these flags (plus --mappa.gpus N
# --mappa.gpu_memory_gib G) prints where everything goes and its memory, and the launch checks the same.
#
# The coach is any OpenAI-compatible endpoint:
#   export MAPPA_COACH_BASE_URL=https://api.openai.com/v1 MAPPA_COACH_MODEL=gpt-4o-mini OPENAI_API_KEY=...
# or an open-weight model served locally:  vllm serve Qwen/Qwen3-32B --port 8001
#   export MAPPA_COACH_BASE_URL=http://localhost:8001/v1 MAPPA_COACH_MODEL=Qwen/Qwen3-32B
# Training data: a JSON list / JSONL of {"prompt", "answer"} rows, e.g. AIME problems.
set -euo pipefail

# Absolute paths: `ray job submit` runs the job in a temporary copy of working_dir, where relative outputs
# would be lost with the copy (and --ckpt.load_enable would find nothing to resume from).
OUT=${MAPPA_OUT:-$PWD/runs/mathchat}
ACTOR_GPUS=${ACTOR_GPUS:-2} REF_GPUS=${REF_GPUS:-2} ENGINES=${ENGINES:-2} AGENTS=3
echo "[mappa] this recipe needs $((AGENTS * (ACTOR_GPUS + REF_GPUS + ENGINES))) GPUs in the Ray cluster:" \
     "$AGENTS agents x ($ACTOR_GPUS actor + $REF_GPUS reference + $ENGINES vLLM engines); outputs in $OUT"
set -x

ray job submit --address="http://127.0.0.1:8265" \
   --runtime-env-json='{"working_dir": "."}' \
   -- python3 -m openrlhf_mappa.cli.train_mappa_ray \
   --mappa.topology examples/configs/mathchat.yaml \
   --mappa.reward process \
   --mappa.coach.kind openai \
   --mappa.coach.base_url "${MAPPA_COACH_BASE_URL:?set MAPPA_COACH_BASE_URL}" \
   --mappa.coach.model "${MAPPA_COACH_MODEL:?set MAPPA_COACH_MODEL}" \
   --mappa.coach.api_key_env OPENAI_API_KEY \
   --mappa.run_dir "$OUT/run" \
   --data.prompt_dataset "${MAPPA_TRAIN_DATA:-$PWD/data/AIME_1983_2024.json}" \
   --data.max_samples 512 \
   --actor.num_gpus_per_node "$ACTOR_GPUS" \
   --ref.num_gpus_per_node "$REF_GPUS" \
   --vllm.num_engines "$ENGINES" \
   --vllm.tensor_parallel_size 1 \
   --vllm.gpu_memory_utilization 0.6 \
   --ds.zero_stage 3 \
   --ds.param_dtype bf16 \
   --ds.adam_offload \
   --algo.advantage.estimator reinforce \
   --algo.kl.init_coef 0.01 \
   --algo.kl.estimator k1 \
   --actor.adam.lr 1e-6 \
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
   --logger.tensorboard_dir "$OUT/tensorboard"
