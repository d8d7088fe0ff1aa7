#!/usr/bin/env bash
# The debate pipeline on a laptop/CPU: two tiny debaters argue over two rounds (both of a round generating
# concurrently), then a tiny judge gives the \boxed{} answer (examples/configs/debate.yaml); each of the three
# agents has its own weights (built offline by `mappa tiny-model`), every action of every round is scored by
# the offline heuristic coach and trains its own agent. 2 steps of 4 problems x 2 samples. Real Ray actors,
# vLLM engines and DeepSpeed ZeRO-3, through the CPU patches. Run from anywhere after `make install`; outputs
# go to runs/debate-tiny-cpu/ (`mappa report runs/debate-tiny-cpu/run` makes the HTML report). Extra flags are
# passed on, e.g. `--eval.dataset examples/data/tiny_math_eval.jsonl` to evaluate before and after.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/debate-tiny-cpu}
MODEL=$OUT/tiny-model

[ -f "$MODEL/config.json" ] || "$(dirname "$PY")/mappa" tiny-model "$MODEL" --seed 0
rm -rf "$OUT/run" "$OUT/ckpt" "$OUT/final"

# Untrained tiny agents rarely end a reply within 32 tokens: --mappa.train_truncated trains on cut-off actions
# too (by default they are left out, as the authors do).
# 3 agents x (actor + reference + 1 vLLM engine) = 9 logical GPUs on a local CPU-only Ray cluster.
export MAPPA_CPU_NUM_GPUS=${MAPPA_CPU_NUM_GPUS:-9}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}

"$PY" -m openrlhf_mappa.cli.train_mappa_ray \
   --mappa.topology examples/configs/debate.yaml \
   --mappa.model "$MODEL" \
   --mappa.coach.kind heuristic \
   --mappa.run_dir "$OUT/run" \
   --data.prompt_dataset examples/data/tiny_math.jsonl \
   --data.max_samples 8 \
   --actor.num_gpus_per_node 1 \
   --ref.num_gpus_per_node 1 \
   --vllm.num_engines 1 \
   --vllm.sync_backend gloo \
   --vllm.enforce_eager \
   --vllm.gpu_memory_utilization 0.2 \
   --ds.zero_stage 3 \
   --ds.attn_implementation sdpa \
   --algo.kl.init_coef 0.01 \
   --actor.adam.lr 1e-4 \
   --actor.lr_warmup_ratio 0 \
   --rollout.batch_size 4 \
   --rollout.n_samples_per_prompt 2 \
   --rollout.micro_batch_size 2 \
   --rollout.max_new_tokens 32 \
   --mappa.train_truncated \
   --data.max_len 2048 \
   --train.batch_size 4 \
   --train.micro_batch_size 2 \
   --train.num_episodes 1 \
   --ckpt.path "$OUT/ckpt" \
   --ckpt.output_dir "$OUT/final" \
   "$@"
