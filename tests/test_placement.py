"""The GPU plan (placement.py, `mappa plan`): parameter counts from config.json against transformers' own
models, the memory estimate against a hand computation, the paper's MathChat recipe on today's placement,
and a team that cannot fit refused with the reason and the smallest change that would fit. Pure Python:
no GPU and no Ray (the launch check on a real Ray cluster is in test_cpu_patches.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from openrlhf_mappa import placement
from openrlhf_mappa.cli.train_mappa_ray import parse_args
from openrlhf_mappa.topology import load_topology

ROOT = Path(__file__).resolve().parents[1]
QWEN3_4B = ROOT / "tests" / "fixtures" / "qwen3-4b"  # config.json from Qwen3-4B's published architecture
QWEN3_32B = ROOT / "tests" / "fixtures" / "qwen3-32b"
GIB = 2**30

# examples/scripts/train_mappa_mathchat.sh's training flags (the paper's recipe: 3 agents, REINFORCE++, ZeRO-3,
# bf16, 4K generation, prompts up to 24K, 2 samples per prompt, per agent 2 actor + 2 reference GPUs, 2 engines).
RECIPE = ["--mappa.topology", str(ROOT / "examples" / "configs" / "mathchat.yaml"), "--data.prompt_dataset", "x.json",
          "--actor.num_gpus_per_node", "2", "--ref.num_gpus_per_node", "2", "--vllm.num_engines", "2",
          "--vllm.tensor_parallel_size", "1", "--vllm.gpu_memory_utilization", "0.6", "--ds.zero_stage", "3",
          "--ds.param_dtype", "bf16", "--algo.kl.init_coef", "0.01", "--rollout.batch_size", "32",
          "--rollout.n_samples_per_prompt", "2", "--rollout.micro_batch_size", "4", "--rollout.max_new_tokens", "4096",
          "--data.max_len", "28672", "--train.batch_size", "16", "--train.micro_batch_size", "1",
          "--actor.gradient_checkpointing_enable"]  # fmt: skip


def recipe(model=QWEN3_4B, *extra):
    args = parse_args(RECIPE + ["--mappa.model", str(model), *extra])
    return args, load_topology(args.mappa.topology, model_override=args.mappa.model)


def refusal(args, topology, gpus, gib=80.0) -> str:
    with pytest.raises(ValueError) as e:
        placement.check(args, topology, gpus, gib)
    return str(e.value)


@pytest.mark.parametrize("config", [
    json.loads((QWEN3_4B / "config.json").read_text()),
    json.loads((QWEN3_32B / "config.json").read_text()),
    {"model_type": "qwen2", "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 2, "vocab_size": 320,
     "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True},  # the tiny test model's shape
    {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 3, "vocab_size": 1000,
     "num_attention_heads": 8, "num_key_value_heads": 8, "tie_word_embeddings": False, "attention_bias": True},
])  # fmt: skip
def test_parameter_count_matches_the_transformers_model(config):
    # The model built by transformers from the same config, on the meta device (shapes, no memory).
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    size = placement.model_size(config)
    assert size.params == sum(p.numel() for p in model.parameters())
    assert size.layer_params == sum(p.numel() for p in model.model.layers[0].parameters())


def test_published_sizes_and_unknown_architectures():
    assert round(placement.model_size(json.loads((QWEN3_4B / "config.json").read_text())).params / 1e9, 2) == 4.02
    assert round(placement.model_size(json.loads((QWEN3_32B / "config.json").read_text())).params / 1e9, 1) == 32.8
    with pytest.raises(ValueError, match="model_type 'qwen3_moe': the memory model knows the dense"):
        placement.model_size({"model_type": "qwen3_moe"})


def test_estimates_agree_with_a_hand_computation():
    args, topology = recipe(QWEN3_4B, "--rollout.micro_batch_size", "1")
    plan = placement.check(args, topology, gpus=18, gpu_gib=80.0)

    # Qwen3-4B: hidden h, layers L, vocabulary V, intermediate I, 32 query heads and 8 key/value heads of 128.
    h, L, V, I, q, k = 2560, 36, 151936, 9728, 32 * 128, 8 * 128
    layer = h * q + 2 * h * k + q * h + 2 * 128 + 3 * h * I + 2 * h  # q k v o, q/k norms, gate up down, 2 norms
    P = L * layer + V * h + h  # embedding tied to the output head, final norm
    assert (layer, P) == (100_930_816, 4_022_468_096)
    s, D = 28672, 2  # --data.max_len; actor ranks under ZeRO-3
    token_layer = 2 * (6 * h + 2 * k + 4 * I)  # bytes of one layer's activations per token
    held = (2 * P + 2 * P + 12 * P) / D / GIB + 1  # weights, gradients, Adam; 1 GiB CUDA context
    gathered = 2 * layer * 2 / GIB  # ZeRO-3: this layer and the prefetched one, bf16
    actor_train = held + (s * h * 2 * L + s * token_layer) / GIB + s * V * 10 / GIB + gathered
    actor_experience = held + s * token_layer / GIB + s * V * 6 / GIB + gathered
    reference_experience = 2 * P / D / GIB + 1 + s * token_layer / GIB + s * V * 6 / GIB + gathered
    engine = 0.6 * 80  # --vllm.gpu_memory_utilization x the GPU
    kv_gib = engine - 2 * P / GIB - (8192 * token_layer + 256 * V * 4) / GIB
    kv_tokens = int(kv_gib * GIB / (2 * L * k * 2))
    assert round(actor_train, 2) == 79.85 and round(kv_gib, 2) == 39.5  # 80 GiB GPUs: it fits, narrowly

    slot = {g.label(0): [(g, 0)] for g in plan.groups() if g.agent == "verifier"}
    assert plan.peak(slot["verifier actor rank 0/2"], "train") == pytest.approx(actor_train, rel=1e-9)
    assert plan.peak(slot["verifier actor rank 0/2"], "experience") == pytest.approx(actor_experience, rel=1e-9)
    assert plan.peak(slot["verifier reference rank 0/2"], "experience") == pytest.approx(reference_experience, rel=1e-9)
    assert plan.peak(slot["verifier vLLM engine 0"], "rollout") == pytest.approx(engine, rel=1e-9)
    assert f"KV cache {kv_gib:.1f} GiB = {kv_tokens} tokens = {kv_tokens // s} sequences of {s}" in placement.format_plan(plan)


def test_the_paper_recipe_on_todays_placement():
    # As the script has it: 18 GPUs, and even there a forward micro-batch of 4 x 28672 tokens does not fit
    # the actor (its logits alone: 4 x 28672 x 151936 x 6 bytes = 97 GiB).
    args, topology = recipe()
    message = refusal(args, topology, gpus=18)
    assert "GPU 0 (problem_solver actor rank 0/2) needs 140.7 GiB in the experience phase, more than its 80 GiB" in message
    assert "Smallest change that fits: --rollout.micro_batch_size 1" in message
    args, topology = recipe(QWEN3_4B, "--rollout.micro_batch_size", "1")
    plan = placement.check(args, topology, gpus=18, gpu_gib=80.0)
    assert plan.need == 18 and max(plan.peak(s, p) for s in plan.slots for p in placement.PHASES) < 80

    # One node of 8 x 80 GiB: today's placement needs a GPU per actor, reference and engine of each agent,
    # 9 at the least, so it is refused, with that count and the flags that reach it.
    args, topology = recipe()
    message = refusal(args, topology, gpus=8)
    assert "need 18 GPUs but the cluster has 8" in message
    assert ("needs at least 9 GPUs of 80 GiB for this team: --rollout.micro_batch_size 1 --ds.adam_offload "
            "--vllm.num_engines 1 --actor.num_gpus_per_node 1 --ref.num_gpus_per_node 1; as configured, 18") in message


def test_three_32b_agents_without_lora_on_one_node_are_refused():
    args, topology = recipe(QWEN3_32B, "--rollout.micro_batch_size", "1", "--data.max_len", "8192",
                            "--rollout.max_new_tokens", "2048", "--vllm.gpu_memory_utilization", "0.9")
    message = refusal(args, topology, gpus=8)
    # Per actor GPU, ZeRO-3 over 2 ranks: 16 bytes x 32.8B / 2 = 244 GiB of weights, gradients and Adam states.
    held = 16 * placement.model_size(json.loads((QWEN3_32B / "config.json").read_text())).params / 2 / GIB
    assert round(held) == 244
    assert "not enough GPUs: the requested actor groups and vLLM engines need 18 GPUs but the cluster has 8" in message
    assert "GPU 0 (problem_solver actor rank 0/2) needs" in message and "more than its 80 GiB" in message
    fewest = int(message.split("needs at least ")[1].split()[0])
    assert fewest > 8 and "--ds.adam_offload" in message


def test_a_change_that_fits_is_named_when_one_exists():
    # 3 agents x (2 actor + 2 reference + 2 engines) on 15 GPUs: one engine fewer per agent fits.
    args, topology = recipe(QWEN3_4B, "--rollout.micro_batch_size", "1")
    assert "Smallest change that fits: --vllm.num_engines 1" in refusal(args, topology, gpus=15)
    # Without Adam offload nor checkpointing the actor does not fit its 2 GPUs; checkpointing alone does.
    args, topology = recipe(QWEN3_4B, "--rollout.micro_batch_size", "1")
    args.actor.gradient_checkpointing_enable = False
    assert "Smallest change that fits: --actor.gradient_checkpointing_enable" in refusal(args, topology, gpus=18)


def test_mappa_plan_command():
    mappa = [sys.executable, "-m", "openrlhf_mappa.cli.mappa", "plan"]
    fits = subprocess.run(mappa + RECIPE + ["--mappa.model", str(QWEN3_4B), "--rollout.micro_batch_size", "1",
                                            "--mappa.gpus", "18", "--mappa.gpu_memory_gib", "80"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert fits.returncode == 0, fits.stderr[-2000:]
    assert "  17  verifier vLLM engine 1" in fits.stdout and "fits: 18 of 18 GPUs" in fits.stdout
    refused = subprocess.run(mappa + RECIPE + ["--mappa.model", str(QWEN3_4B), "--mappa.gpus", "8",
                                               "--mappa.gpu_memory_gib", "80"],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert refused.returncode == 1 and "REFUSED: the plan does not fit 8 x 80 GiB GPUs" in refused.stdout
    assert "<- beyond the cluster's GPUs" in refused.stdout
    # No GPU here to measure: the cluster must be given.
    bare = subprocess.run(mappa + RECIPE + ["--mappa.model", str(QWEN3_4B)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert bare.returncode == 1 and "give the cluster as --mappa.gpus N --mappa.gpu_memory_gib G" in bare.stderr
