#!/usr/bin/env bash
# MathChat with MAPPA at the paper's recipe: three agents (Problem Solver -> Code Executor -> Verifier),
# each its own Qwen3-4B, REINFORCE++ with per-action coach scores, KL 0.01 in the reward, lr 1e-6,
# 2 samples per prompt, ZeRO-3, bf16. Per agent: 2 actor GPUs, 2 reference GPUs, 2 vLLM engines
# (18 GPUs for three agents; lower the counts or override them per agent in the topology YAML).
#
# The coach is any OpenAI-compatible endpoint:
#   export MAPPA_COACH_BASE_URL=https://api.openai.com/v1 MAPPA_COACH_MODEL=gpt-4o-mini OPENAI_API_KEY=...
# or an open-weight model served locally:  vllm serve Qwen/Qwen3-32B --port 8001
#   export MAPPA_COACH_BASE_URL=http://localhost:8001/v1 MAPPA_COACH_MODEL=Qwen/Qwen3-32B
# Training data: a JSON list / JSONL of {"prompt", "answer"} rows, e.g. AIME problems.
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
   --mappa.run_dir ./runs/mathchat \
   --data.prompt_dataset "${MAPPA_TRAIN_DATA:-data/AIME_1983_2024.json}" \
   --data.max_samples 512 \
   --actor.num_gpus_per_node 2 \
   --ref.num_gpus_per_node 2 \
   --vllm.num_engines 2 \
   --vllm.tensor_parallel_size 1 \
   --vllm.gpu_memory_utilization 0.6 \
   --ds.zero_stage 3 \
   --ds.param_dtype bf16 \
   --algo.advantage.estimator reinforce \
   --algo.kl.init_coef 0.01 \
   --algo.kl.estimator k1 \
   --actor.adam.lr 1e-6 \
   --rollout.batch_size 32 \
   --rollout.n_samples_per_prompt 2 \
   --rollout.micro_batch_size 4 \
   --rollout.max_new_tokens 4096 \
   --data.max_len 28672 \
   --train.batch_size 16 \
   --train.micro_batch_size 1 \
   --train.num_episodes 8 \
   --actor.gradient_checkpointing_enable \
   --ckpt.save_steps 10 \
   --ckpt.load_enable \
   --ckpt.save_hf \
   --ckpt.path ./ckpt/mappa_mathchat \
   --ckpt.output_dir ./ckpt/mappa_mathchat_hf \
   --logger.tensorboard_dir ./runs/mathchat/tensorboard
