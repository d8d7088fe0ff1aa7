#!/usr/bin/env bash
# The demo (`make demo`): three tiny agents, each with its own weights, learn a relay task from scratch with the
# offline heuristic coach's per-action scores (examples/configs/relay.yaml, openrlhf_mappa/envs/relay.py).
# They start as random-init models (built offline by `mappa tiny-model`) that almost never succeed together;
# after 50 steps most episodes succeed. Real Ray actors, vLLM engines and DeepSpeed ZeRO-3, on the CPU.
# The launch ends with the HTML report (run/report.html). Outputs go to runs/demo/ (OUT=...); SEED=... picks
# another random start.
# Extra flags are passed on to train_mappa_ray (e.g. --mappa.verbose, --train.num_episodes 60).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/demo}
SEED=${SEED:-0}
MODEL=$OUT/tiny-model-seed$SEED

# vocab 259 = the byte tokenizer's size: every token the model can write is visible text or the end. A small
# initial std makes the untrained model's odds near uniform (any byte or the end), so every seed starts alike.
mkdir -p "$OUT"
[ -f "$MODEL/config.json" ] || "$(dirname "$PY")/mappa" tiny-model "$MODEL" --seed "$SEED" --vocab-size 259 \
   --init-std 0.002 >"$OUT/tiny-model.log" 2>&1 || { cat "$OUT/tiny-model.log"; exit 1; }
rm -rf "$OUT/run" "$OUT/ckpt" "$OUT/final" "$OUT/tensorboard"

# 3 agents x (1 ZeRO-3 actor + 1 vLLM engine) = 6 logical GPUs on a local CPU-only Ray cluster. No reference
# model (KL coefficient 0): the tiny agents start from noise, there is nothing to stay close to.
export MAPPA_CPU_NUM_GPUS=${MAPPA_CPU_NUM_GPUS:-6}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}

# 8 orders x 4 samples = 32 episodes per step, one optimizer step per agent per step, 50 steps; replies of at
# most 16 tokens. Cut-off replies train too (--mappa.train_truncated): the coach scores them low, which is how
# the agents learn to stop.
"$PY" -m openrlhf_mappa.cli.train_mappa_ray \
   --mappa.topology examples/configs/relay.yaml \
   --mappa.model "$MODEL" \
   --mappa.coach.kind heuristic \
   --mappa.train_truncated \
   --mappa.run_dir "$OUT/run" \
   --data.prompt_dataset examples/data/relay_train.jsonl \
   --eval.dataset examples/data/relay_eval.jsonl \
   --eval.n_samples_per_prompt 2 \
   --actor.num_gpus_per_node 1 \
   --vllm.num_engines 1 \
   --vllm.sync_backend gloo \
   --vllm.enforce_eager \
   --vllm.gpu_memory_utilization 0.2 \
   --ds.zero_stage 3 \
   --ds.attn_implementation sdpa \
   --algo.kl.init_coef 0 \
   --actor.adam.lr 5e-3 \
   --actor.lr_warmup_ratio 0 \
   --actor.lr_scheduler constant \
   --rollout.batch_size 8 \
   --rollout.n_samples_per_prompt 4 \
   --rollout.micro_batch_size 32 \
   --rollout.max_new_tokens 16 \
   --data.max_len 256 \
   --train.batch_size 32 \
   --train.micro_batch_size 32 \
   --train.num_episodes 50 \
   --train.seed "$SEED" \
   --ckpt.path "$OUT/ckpt" \
   --ckpt.output_dir "$OUT/final" \
   --logger.tensorboard_dir "$OUT/tensorboard" \
   "$@"
