"""The GPU plan (placement.py, `mappa plan`): parameter counts from config.json against transformers' own
models, the memory estimate per phase against hand computations (GPUs of their own, colocated per agent and
as a team, with sleep), the GPU scripts' own flags (the paper's MathChat recipe on one 8 x 80 GB node), what
colocation cannot place, and a team that cannot fit refused with the reason and the smallest change that would
fit. Pure Python: no GPU and no Ray (the launch check on a real Ray cluster is in test_cpu_patches.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import submit_script
from openrlhf_mappa import placement
from openrlhf_mappa.cli.train_mappa_ray import parse_args
from openrlhf_mappa.team import load_topology

ROOT = Path(__file__).resolve().parents[1]
QWEN3_4B = ROOT / "tests" / "fixtures" / "qwen3-4b"  # config.json from Qwen3-4B's published architecture
# Qwen/Qwen3-4B-Thinking-2507's config.json: Qwen3-4B's but for its 262,144 positions and RoPE base 5,000,000.
THINKING = ROOT / "tests" / "fixtures" / "qwen3-4b-thinking-2507"
QWEN3_32B = ROOT / "tests" / "fixtures" / "qwen3-32b"
GIB = 2**30

# The paper's MathChat recipe as flags (3 agents, REINFORCE++, ZeRO-3, bf16, 4K generation, prompts up to 24K,
# 2 samples per prompt), on GPUs of their own: per agent 2 actor + 2 reference GPUs, 2 engines. The GPU script's
# own flags (colocated, Adam on CPU) are read from the script itself below (script_flags).
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


def advice(message: str) -> list:
    """The numbered changes a refusal names (placement.advice), without their numbers."""
    lines = message.split("\nWhat to change, in this order:\n", 1)[1].splitlines()
    assert [line.split(". ", 1)[0] for line in lines] == [f"  {i}" for i in range(1, len(lines) + 1)]
    return [line.split(". ", 1)[1] for line in lines]


# The changes named where a team does not fit, as advice words them.
MORE_GPUS = ("more GPUs: more actor and reference ranks shard ZeRO's states (--actor.num_gpus_per_node, "
             "--ref.num_gpus_per_node), a ring of r ranks holds 1/r of each sequence's activations and logits "
             "(--ds.ring_attn_size r), tensor-parallel engines split their weights (--vllm.tensor_parallel_size); "
             "`mappa plan` checks each count")
CLUSTER = ("a cluster of {} GPUs, or fewer GPUs per agent (--actor.num_gpus_per_node, --ref.num_gpus_per_node, "
           "--vllm.num_engines)")
AGENT = "--mappa.colocate agent --vllm.enable_sleep --ds.enable_sleep"
TEAM = "--mappa.colocate team --vllm.enable_sleep --ds.enable_sleep --vllm.gpu_memory_utilization 0.2"


def script_flags(tmp_path, script, *extra, **env) -> tuple:
    """(flags, printed) of a GPU script run for real with `extra` flags, with `ray` on PATH recording its submission:
    the one stand-in, for the GPU cluster that cannot exist here (as in test_launch.py)."""
    stub = tmp_path / "bin" / "ray"
    stub.parent.mkdir(exist_ok=True)
    stub.write_text(f"#!/bin/sh\n{sys.executable} -c 'import json, sys; print(json.dumps(sys.argv[1:]))' \"$@\" "
                    f"> {tmp_path / 'submitted.json'}\n")
    stub.chmod(0o755)
    env = dict(os.environ, PATH=f"{stub.parent}{os.pathsep}{os.environ['PATH']}", MAPPA_COACH_BASE_URL="http://coach/v1",
               MAPPA_COACH_MODEL="coach", MAPPA_SKIP_DATA_CHECK="1", MAPPA_SKIP_CHECK="1", **env)  # no data, coach
    proc = subprocess.run(["bash", str(ROOT / "examples" / "scripts" / script), *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    submitted = json.loads((tmp_path / "submitted.json").read_text())
    return submitted[submitted.index("openrlhf_mappa.cli.train_mappa_ray") + 1:], proc.stdout


def planned(argv):
    """Parsed flags and topology of a script's flags, with Qwen3-4B's config.json for its agents' models."""
    args = parse_args(argv + ["--mappa.model", str(QWEN3_4B)])
    return args, load_topology(str(ROOT / args.mappa.topology), model_override=args.mappa.model)


# The tiny test model's shape (tiny_model.py), and a Llama with attention biases and an untied head.
TINY = {"model_type": "qwen2", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "vocab_size": 320,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": False}
LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 3,
         "vocab_size": 1000, "num_attention_heads": 8, "num_key_value_heads": 8, "tie_word_embeddings": False,
         "attention_bias": True}
# What the per-family formula (llama, mistral, qwen2, qwen3) gave before one meta-device build replaced it:
# parameters, one layer's, hidden, layers, vocabulary, heads, key/value dim, intermediate, query dim.
FORMULA = {"qwen3-4b": (4022468096, 100930816, 2560, 36, 151936, 32, 1024, 9728, 4096),
           "qwen3-8b": (8190735360, 192946432, 4096, 36, 151936, 32, 1024, 12288, 4096),
           "qwen3-14b": (14768307200, 330311936, 5120, 40, 151936, 40, 1024, 17408, 5120),
           "qwen3-32b": (32762123264, 487598336, 5120, 64, 151936, 64, 1024, 25600, 8192),
           "tiny": (377984, 147968, 128, 2, 320, 4, 64, 256, 128),
           "llama": (2888448, 792064, 256, 3, 1000, 8, 256, 688, 256)}


def model_dir(tmp_path, name: str) -> str:
    """A fixture's directory, or one written with the config of TINY or LLAMA (config.json only: no weights)."""
    if name.startswith("qwen3"):
        return str(ROOT / "tests" / "fixtures" / name)
    (tmp_path / name).mkdir(exist_ok=True)
    (tmp_path / name / "config.json").write_text(json.dumps({"tiny": TINY, "llama": LLAMA}[name]))
    return str(tmp_path / name)


@pytest.mark.parametrize("name", FORMULA)
def test_model_shapes_from_the_meta_build_equal_the_family_formulas(tmp_path, name):
    size = placement.model_size(model_dir(tmp_path, name))
    params, layer, h, layers, vocab, heads, k, i, q = FORMULA[name]
    assert (size.params, size.layer_params, size.hidden, size.layers, size.vocab, size.heads, size.kv_dim,
            size.intermediate) == (params, layer, h, layers, vocab, heads, k, i)
    assert size.linear_shapes == {"q_proj": (h, q), "k_proj": (h, k), "v_proj": (h, k), "o_proj": (q, h),
                                  "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    assert size.linear_names == ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj", "lm_head")


def test_published_sizes_and_other_architectures(tmp_path):
    assert round(placement.model_size(str(QWEN3_4B)).params / 1e9, 2) == 4.02
    assert round(placement.model_size(str(QWEN3_32B)).params / 1e9, 1) == 32.8
    # A family the formula did not know (a mixture of experts, whose experts are no nn.Linear): its shapes from the
    # same build, its parameters transformers' own.
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    moe = dict(TINY, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "config.json").write_text(json.dumps(moe))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**moe))
    size = placement.model_size(str(tmp_path / "moe"))
    assert size.kind == "qwen3_moe" and size.params == sum(p.numel() for p in model.parameters())
    assert size.layer_params == sum(p.numel() for p in model.model.layers[0].parameters())
    (tmp_path / "unknown").mkdir()
    (tmp_path / "unknown" / "config.json").write_text(json.dumps(dict(TINY, model_type="not_a_model")))
    with pytest.raises(ValueError, match="unknown: no shapes from a meta-device build"):
        placement.model_size(str(tmp_path / "unknown"))


# Qwen3-4B by hand: hidden H, layers L, vocabulary V, intermediate I, 32 query heads and 8 key/value heads of 128.
H, L, V, I, Q, K = 2560, 36, 151936, 9728, 32 * 128, 8 * 128
LAYER = H * Q + 2 * H * K + Q * H + 2 * 128 + 3 * H * I + 2 * H  # q k v o, q/k norms, gate up down, 2 norms
P = L * LAYER + V * H + H  # embedding tied to the output head, final norm
S = 28672  # --data.max_len
TOKEN_LAYER = 2 * (6 * H + 2 * K + 4 * I)  # bytes of one layer's activations per token
GATHERED = 2 * LAYER * 2 / GIB  # ZeRO-3: this layer and the prefetched one, bf16
FORWARD = S * TOKEN_LAYER / GIB + S * V * 6 / GIB + GATHERED  # a micro-batch of 1 without gradients
TRAIN = (S * H * 2 * L + S * TOKEN_LAYER) / GIB + S * V * 10 / GIB + GATHERED  # checkpointed activations, logits
EMBEDDING = V * H * 2 / GIB  # the largest tensor the sync gathers
BUCKET = H * H * 4 / GIB  # with --ds.adam_offload, the gradients on the GPU: a reduce bucket (their fp32 copy on CPU)
GRAPHS = 0.5  # an engine's CUDA graphs, outside its --vllm.gpu_memory_utilization share


def test_estimates_agree_with_a_hand_computation():
    args, topology = recipe(QWEN3_4B, "--rollout.micro_batch_size", "1")
    plan = placement.check(args, topology, gpus=18, gpu_gib=80.0)

    assert (LAYER, P) == (100_930_816, 4_022_468_096)
    D = 2  # actor ranks under ZeRO-3
    held = (2 * P + 2 * P + 12 * P) / D / GIB + 1  # weights, gradients, Adam; 1 GiB CUDA context
    actor_train = held + TRAIN
    actor_experience = held + FORWARD
    reference_experience = 2 * P / D / GIB + 1 + FORWARD
    engine = 0.6 * 80  # --vllm.gpu_memory_utilization x the GPU, measured by vLLM after its CUDA context
    kv_gib = engine - 2 * P / GIB - (8192 * TOKEN_LAYER + 256 * V * 4) / GIB
    kv_tokens = int(kv_gib * GIB / (2 * L * K * 2))
    assert round(actor_train, 2) == 79.85 and round(kv_gib, 2) == 39.5  # 80 GiB GPUs: it fits, narrowly

    slot = {g.label(0): [(g, 0)] for g in plan.groups if g.agent == "verifier"}
    assert plan.peak(slot["verifier actor rank 0/2"], "train") == pytest.approx(actor_train, rel=1e-9)
    assert plan.peak(slot["verifier actor rank 0/2"], "experience") == pytest.approx(actor_experience, rel=1e-9)
    assert plan.peak(slot["verifier actor rank 0/2"], "sync") == pytest.approx(held + EMBEDDING, rel=1e-9)
    assert plan.peak(slot["verifier reference rank 0/2"], "experience") == pytest.approx(reference_experience, rel=1e-9)
    for phase in placement.PHASES:  # no --vllm.enable_sleep (nothing is colocated): awake in every phase
        assert plan.peak(slot["verifier vLLM engine 0"], phase) == pytest.approx(engine + 1 + GRAPHS, rel=1e-9)
    assert f"KV cache {kv_gib:.1f} GiB = {kv_tokens} tokens = {kv_tokens // S} sequences of {S}" in placement.format_plan(plan)


def test_token_budgets_bound_a_micro_batch_in_the_plan():
    # With --train.dynamic_batch_enable upstream's split fills a micro-batch to the budget, whatever
    # --train/--rollout.micro_batch_size say: packed (as GPUs require), a rank's activations and logits are the
    # budget's tokens, 65536 in training and 49152 in the experience forwards; an action longer than the budget
    # goes alone (S tokens).
    budgets = ["--train.dynamic_batch_enable", "--ds.packing_samples", "--train.max_tokens_per_gpu", "65536",
               "--rollout.max_tokens_per_gpu", "49152"]
    args, topology = recipe(QWEN3_4B, *budgets)
    held = (2 * P + 2 * P + 12 * P) / 2 / GIB + 1
    train = lambda n: held + (n * H * 2 * L + n * TOKEN_LAYER) / GIB + n * V * 10 / GIB + GATHERED
    forward = lambda n: n * TOKEN_LAYER / GIB + n * V * 6 / GIB + GATHERED
    small = ["--train.max_tokens_per_gpu", "8192", "--rollout.max_tokens_per_gpu", "8192"]
    for extra, n_train, n_exp in (([], 65536, 49152), (["--ds.ring_attn_size", "2"], 65536, 49152), (small, S, S)):
        plan = placement.make_plan(recipe(QWEN3_4B, *budgets, *extra)[0], topology, 80.0)
        slot = {g.label(0): [(g, 0)] for g in plan.groups if g.agent == "verifier"}
        actor = slot["verifier actor rank 0/2"]
        assert plan.peak(actor, "train") == pytest.approx(train(n_train), rel=1e-9), extra
        assert plan.peak(actor, "experience") == pytest.approx(held + forward(n_exp), rel=1e-9), extra
        assert plan.peak(slot["verifier reference rank 0/2"], "experience") == pytest.approx(
            2 * P / 2 / GIB + 1 + forward(n_exp), rel=1e-9)
    assert round(train(65536), 1) == 142.2  # 92.7 GiB of them logits: refused on 80 GiB, naming the budget
    # In place of micro-batches of 1, the budget of one --data.max_len action.
    assert advice(refusal(args, topology, gpus=18)) == [
        "--train.max_tokens_per_gpu 28672: at most 79.8 GiB a GPU, fits"]


def test_colocated_per_agent_estimates_agree_with_a_hand_computation():
    # Each agent's actor rank i, reference rank i and engine i on its GPU i, with sleep; Adam on the GPU, so
    # that --ds.enable_sleep has states to move.
    args, topology = recipe(QWEN3_4B, "--rollout.micro_batch_size", "1", "--mappa.colocate", "agent",
                            "--vllm.enable_sleep", "--ds.enable_sleep")
    plan = placement.make_plan(args, topology, 80.0)
    assert plan.need == 6 and len(plan.slots) == 6
    slot = plan.slots[4]  # problem_solver has GPUs 0 and 1, code_executor 2 and 3
    assert placement.slot_label(slot) == "verifier: actor, reference, vLLM engine #0"

    D, weights = 2, 2 * P / 2 / GIB  # ZeRO-3 over the agent's 2 GPUs
    # Kept in every phase: the actor's bf16 weights (its gradients and Adam states on CPU while it sleeps), the
    # reference's weights, the sleeping engine's CUDA graphs; 1 GiB CUDA context each.
    held = (weights + 1) + (weights + 1) + 1 + GRAPHS
    assert plan.peak(slot, "rollout") == pytest.approx(held + 0.6 * 80, rel=1e-9)  # the engine awake
    assert plan.peak(slot, "experience") == pytest.approx(held + FORWARD, rel=1e-9)  # actor, then reference
    train = held + (2 * P + 12 * P) / D / GIB + TRAIN  # gradients and Adam states reloaded
    assert plan.peak(slot, "train") == pytest.approx(train, rel=1e-9)
    # The embedding gathered and passed by CUDA IPC (a copy), the engine's weights awake without KV cache.
    assert plan.peak(slot, "sync") == pytest.approx(held + 2 * EMBEDDING + 2 * P / GIB, rel=1e-9)
    assert round(train, 1) == 86.1

    message = refusal(args, topology, gpus=8)
    assert "GPU 0 (problem_solver: actor, reference, vLLM engine #0) needs 86.1 GiB in the train phase" in message
    assert advice(message) == ["--ref.offload: at most 82.3 GiB a GPU",
                               "then --ds.adam_offload: at most 56.1 GiB a GPU, fits"]


def test_team_colocation_estimates_agree_with_a_hand_computation():
    # One set of 8 GPUs for the team: GPU i holds every agent's actor rank i, reference rank i and engine i.
    # The engines share the GPU in the rollout (0.2 each); the agents train and sync in turn.
    args, topology = recipe(QWEN3_4B, "--rollout.micro_batch_size", "1", "--mappa.colocate", "team", "--vllm.enable_sleep",
                            "--ds.enable_sleep", "--ds.adam_offload", "--vllm.gpu_memory_utilization", "0.2",
                            "--actor.num_gpus_per_node", "8", "--ref.num_gpus_per_node", "8", "--vllm.num_engines", "8")
    plan = placement.check(args, topology, gpus=8, gpu_gib=80.0)
    assert plan.need == 8 and all(placement.slot_label(slot) == f"3 agents: actor, reference, vLLM engine #{i}"
                                  for i, slot in enumerate(plan.slots))
    D, weights = 8, 2 * P / 8 / GIB
    # Per agent: the actor's weights and gradient bucket (with Adam and fp32 gradients on CPU, --ds.enable_sleep
    # moves nothing: OpenRLHF skips it), the reference's weights, the sleeping engine's CUDA graphs; 1 GiB CUDA
    # context each.
    held = 3 * ((weights + BUCKET + 1) + (weights + 1) + 1 + GRAPHS)
    slot = plan.slots[0]
    assert plan.peak(slot, "rollout") == pytest.approx(held + 3 * 0.2 * 80, rel=1e-9)  # every engine awake at once
    assert plan.peak(slot, "experience") == pytest.approx(held + FORWARD, rel=1e-9)  # one forward at a time
    assert plan.peak(slot, "train") == pytest.approx(held + TRAIN, rel=1e-9)  # one agent at a time
    assert plan.peak(slot, "sync") == pytest.approx(held + 2 * EMBEDDING + 2 * P / GIB, rel=1e-9)
    assert "the largest agent's (they train and sync in turn) in train and sync" in placement.format_plan(plan)

    # The largest agent sets the train peak: a 32B verifier's training, on top of what all three keep.
    big = placement.model_size(str(QWEN3_32B))
    sizes = {"problem_solver": placement.model_size(str(QWEN3_4B))}
    sizes = {**sizes, "code_executor": sizes["problem_solver"], "verifier": big}
    mixed = placement.make_plan(args, topology, 80.0, sizes)
    groups = {(g.agent, g.kind): g for g in mixed.groups}
    kept = sum(sum(g.held.values()) for g in groups.values())
    verifier_train = sum(groups["verifier", "actor"].adds["train"].values())
    assert mixed.peak(mixed.slots[0], "train") == pytest.approx(kept + verifier_train, rel=1e-9)


def test_the_paper_recipe_fits_one_node_of_8_x_80_gib(tmp_path):
    # examples/scripts/train_mappa_mathchat.sh as the authors ran it: each agent's actor, reference and 2 engines
    # on its 2 GPUs, with sleep and Adam on CPU: 6 of the node's 8 GPUs.
    argv, printed = script_flags(tmp_path, "train_mappa_mathchat.sh")
    args, topology = planned(argv)
    assert (args.mappa.colocate, args.vllm.enable_sleep, args.ds.enable_sleep, args.ds.adam_offload) == ("agent", True, True, True)
    assert (args.actor.num_gpus_per_node, args.ref.num_gpus_per_node, args.vllm.num_engines) == (2, 2, 2)
    plan = placement.check(args, topology, gpus=8, gpu_gib=80.0)
    assert plan.need == 6 and "this recipe needs 6 GPUs in the Ray cluster" in printed
    assert [placement.slot_label(slot) for slot in plan.slots[:2]] == [
        "problem_solver: actor, reference, vLLM engine #0", "problem_solver: actor, reference, vLLM engine #1"]
    # The experience phase's peak (the gpu-path review's hand computation: about 66 GiB): with Adam on CPU, ZeRO keeps
    # the gradients there too, the GPU a reduce bucket.
    assert max(plan.peak(slot, p) for slot in plan.slots for p in placement.PHASES) == pytest.approx(66.1, abs=0.05)

    # COLOCATE=team GPUS_PER_AGENT=8: the team on all 8 GPUs, each engine a third of the share.
    argv, printed = script_flags(tmp_path, "train_mappa_mathchat.sh", COLOCATE="team", GPUS_PER_AGENT="8")
    args, topology = planned(argv)
    assert (args.mappa.colocate, args.vllm.gpu_memory_utilization) == ("team", 0.2)
    assert placement.check(args, topology, gpus=8, gpu_gib=80.0).need == 8 and "needs 8 GPUs" in printed

    # COLOCATE=none: 18 GPUs, refused on one node; colocation is the change named.
    argv, printed = script_flags(tmp_path, "train_mappa_mathchat.sh", COLOCATE="none")
    args, topology = planned(argv)
    assert "this recipe needs 18 GPUs" in printed
    assert advice(refusal(args, topology, gpus=8)) == [CLUSTER.format(18),
                                                       f"or {AGENT}: 6 GPUs, at most 66.1 GiB a GPU, fits",
                                                       f"or {TEAM}: 2 GPUs, at most 88.1 GiB a GPU"]

    # DSBench's script (16K generation, 32K tokens) is placed alike, and fits too.
    argv, printed = script_flags(tmp_path, "train_mappa_dsbench.sh")
    args, topology = planned(argv)
    assert placement.check(args, topology, gpus=8, gpu_gib=80.0).need == 6 and "needs 6 GPUs" in printed


def peaks(plan) -> list:
    return [plan.peak(slot, phase) for slot in plan.slots for phase in placement.PHASES]


@pytest.mark.parametrize("script", ["train_mappa_mathchat.sh", "train_mappa_dsbench.sh"])
def test_the_recipes_on_the_thinking_model_the_authors_readme_runs(tmp_path, script):
    """MAPPA_MODEL=Qwen/Qwen3-4B-Thinking-2507 (here its config.json) puts every agent of either script on it:
    the plan is Qwen3-4B's (same shapes: 6 GPUs, the same peaks), and the recipe's tokens fit its positions.
    With MAPPA_DOCTOR the self-check keeps its small model."""
    argv, _ = script_flags(tmp_path, script, MAPPA_MODEL=str(THINKING))
    args = parse_args(argv)
    topology = load_topology(str(ROOT / args.mappa.topology), model_override=args.mappa.model)
    assert argv.count("--mappa.model") == 1 and {a.model for a in topology.agents} == {str(THINKING)}
    assert placement.model_size(str(THINKING)) == placement.model_size(str(QWEN3_4B))
    plan = placement.check(args, topology, gpus=8, gpu_gib=80.0)
    base = placement.check(*planned(script_flags(tmp_path, script)[0]), gpus=8, gpu_gib=80.0)
    assert plan.need == base.need == 6 and peaks(plan) == peaks(base)
    assert args.data.max_len <= json.loads((THINKING / "config.json").read_text())["max_position_embeddings"]

    submitted, _ = submit_script(ROOT / "examples" / "scripts" / script, tmp_path, MAPPA_MODEL=str(THINKING),
                                 MAPPA_DOCTOR="Qwen/Qwen3-0.6B")
    models = [submitted[i + 1] for i, flag in enumerate(submitted) if flag == "--mappa.model"]
    assert models == ["Qwen/Qwen3-0.6B"]


def test_the_paper_recipe_on_gpus_of_their_own():
    # 18 GPUs, and even there a forward micro-batch of 4 x 28672 tokens does not fit the actor (its logits
    # alone: 4 x 28672 x 151936 x 6 bytes = 97 GiB).
    args, topology = recipe()
    message = refusal(args, topology, gpus=18)
    assert "GPU 0 (problem_solver actor rank 0/2) needs 140.7 GiB in the experience phase, more than its 80 GiB" in message
    assert advice(message) == ["--rollout.micro_batch_size 1: at most 79.8 GiB a GPU, fits"]
    args, topology = recipe(QWEN3_4B, "--rollout.micro_batch_size", "1")
    plan = placement.check(args, topology, gpus=18, gpu_gib=80.0)
    assert plan.need == 18 and max(plan.peak(s, p) for s in plan.slots for p in placement.PHASES) < 80

    # One node of 8 x 80 GiB: GPUs of their own need 18; colocation needs 6 per agent, 2 as a team, each with the
    # savings its own plan then names; on GPUs of their own, forward micro-batches of 1 fit the memory.
    args, topology = recipe()
    message = refusal(args, topology, gpus=8)
    assert "need 18 GPUs but the cluster has 8" in message
    assert advice(message) == [CLUSTER.format(18), f"or {AGENT}: 6 GPUs, at most 120.8 GiB a GPU",
                               f"or {TEAM}: 2 GPUs, at most 142.8 GiB a GPU",
                               "--rollout.micro_batch_size 1: at most 79.8 GiB a GPU, fits"]
    # The team on 2 GPUs, with forward micro-batches of 1, Adam, its gradients and the references' weights in host
    # memory: the team's plan names those savings, down to the one that fits.
    team = placement.with_changes(args, placement.colocation(args, topology, "team"))
    assert advice(refusal(team, topology, gpus=2)) == ["--rollout.micro_batch_size 1: at most 108.1 GiB a GPU",
                                                       "then --ref.offload: at most 96.8 GiB a GPU",
                                                       "then --ds.adam_offload: at most 70.7 GiB a GPU, fits"]
    team = placement.with_changes(team, [("rollout", "micro_batch_size", 1), ("ref", "offload", True),
                                         ("ds", "adam_offload", True)])
    assert placement.check(team, topology, gpus=2, gpu_gib=80.0).need == 2


def test_three_32b_agents_without_lora_on_one_node_are_refused():
    args, topology = recipe(QWEN3_32B, "--rollout.micro_batch_size", "1", "--data.max_len", "8192",
                            "--rollout.max_new_tokens", "2048", "--vllm.gpu_memory_utilization", "0.9")
    message = refusal(args, topology, gpus=8)
    # Per actor GPU, ZeRO-3 over 2 ranks: 16 bytes x 32.8B / 2 = 244 GiB of weights, gradients and Adam states.
    held = 16 * placement.model_size(str(QWEN3_32B)).params / 2 / GIB
    assert round(held) == 244
    assert "not enough GPUs: the requested actor groups and vLLM engines need 18 GPUs but the cluster has 8" in message
    assert "GPU 0 (problem_solver actor rank 0/2) needs" in message and "more than its 80 GiB" in message
    # On 18 GPUs of their own it fits with the references' weights and Adam in host memory; colocated, an engine
    # holds the whole 32B model (61 GiB) on one GPU, beside the actor's and reference's shards.
    assert advice(message) == [CLUSTER.format(18), f"or {AGENT}: 6 GPUs, at most 298.6 GiB a GPU",
                               f"or {TEAM.replace('0.2', '0.3')}: 2 GPUs, at most 427.6 GiB a GPU",
                               "--ref.offload: at most 265.6 GiB a GPU",
                               "then --ds.adam_offload: at most 73.5 GiB a GPU, fits"]
    args.ref.offload = args.ds.adam_offload = True
    assert placement.check(args, topology, gpus=18, gpu_gib=80.0).need == 18
    args, topology = recipe(QWEN3_32B, "--rollout.micro_batch_size", "1", "--data.max_len", "8192",
                            "--rollout.max_new_tokens", "2048", "--vllm.gpu_memory_utilization", "0.9",
                            "--mappa.colocate", "agent", "--vllm.enable_sleep", "--ds.enable_sleep", "--ds.adam_offload")
    message = refusal(args, topology, gpus=8)
    assert "GPU 0 (problem_solver: actor, reference, vLLM engine #0) needs" in message
    assert advice(message) == ["--ref.offload: at most 106.1 GiB a GPU",
                               "then --ds.ring_attn_size 2: at most 106.1 GiB a GPU",
                               f"or {MORE_GPUS}"]


def test_the_launch_counts_shared_gpus_once():
    # The launch's check where no GPU memory is known (on CPU): a colocated GPU counts once. 3 agents x (2 actor
    # + 2 reference GPUs + 2 engines) take 18 GPUs of their own, 6 colocated per agent, 2 as a team.
    for colocate, need in (("none", 18), ("agent", 6), ("team", 2)):
        args, topology = recipe(QWEN3_4B, "--mappa.colocate", colocate)
        plan = placement.check(args, topology, need)
        assert plan.need == need and not plan.slots
        assert ("placement: every agent's actor, reference and vLLM engines share the team's GPUs" in
                placement.format_plan(plan, need)) == (colocate == "team")
        with pytest.raises(ValueError, match=f"need {need} GPUs but the cluster has {need - 1}"):
            placement.check(args, topology, need - 1)


def test_what_colocation_cannot_place_is_refused_with_the_reason():
    # Colocated, a GPU holds one actor rank, one reference rank and one engine: 1 reference GPU and 1 engine
    # for 2 actor GPUs cannot be placed. Refused at launch (count check only, no memory known) and by the plan.
    args, topology = recipe(QWEN3_4B, "--rollout.micro_batch_size", "1", "--mappa.colocate", "agent",
                            "--ref.num_gpus_per_node", "1", "--vllm.num_engines", "1")
    problems = placement.colocation_problems(args, topology)
    assert problems[:2] == [
        "agent 'problem_solver': 1 reference GPUs, but its actor has 2; colocated they share GPUs one rank each "
        "(--ref.num_gpus_per_node)",
        "agent 'problem_solver': 1 vLLM engines on its actor's 2 GPUs; colocated, one engine per GPU (--vllm.num_engines 2)"]
    assert len(problems) == 6  # the same for each of the 3 agents
    with pytest.raises(ValueError) as e:
        placement.check(args, topology, 8)
    assert all(f"  - {p}" in str(e.value) for p in problems)
    assert all(f"  - {p}" in refusal(args, topology, gpus=8) for p in problems)

    args, topology = recipe(QWEN3_4B, "--mappa.colocate", "agent", "--vllm.tensor_parallel_size", "2")
    assert "--vllm.tensor_parallel_size 2: colocated engines take one GPU each" in placement.colocation_problems(args, topology)

    # A team shares one GPU set: the agents need one GPU count.
    args, topology = recipe(QWEN3_4B, "--rollout.micro_batch_size", "1", "--mappa.colocate", "team")
    topology.agents[2].num_gpus_per_node, topology.agents[2].vllm_num_engines = 1, 1
    assert placement.colocation_problems(args, topology) == [
        "--mappa.colocate team puts every agent on one GPU set, but the agents' actors have different GPU counts "
        "(problem_solver: 2, code_executor: 2, verifier: 1); give them one num_gpus_per_node"]

    # What each colocated model asks Ray for: one over the models a GPU holds (actor, reference, engine).
    assert placement.gpu_share(recipe(QWEN3_4B, "--mappa.colocate", "agent")[0], topology) == 0.3333
    assert placement.gpu_share(recipe(QWEN3_4B, "--mappa.colocate", "team")[0], topology) == 0.1111


def test_a_change_that_fits_is_named_when_one_exists():
    # 3 agents x (2 actor + 2 reference + 2 engines) on 15 GPUs: the GPUs it needs, fewer per agent, or colocation
    # (the memory of each placement said); one engine fewer per agent fits.
    args, topology = recipe(QWEN3_4B, "--rollout.micro_batch_size", "1")
    assert advice(refusal(args, topology, gpus=15)) == [CLUSTER.format(18),
                                                        f"or {AGENT}: 6 GPUs, at most 86.1 GiB a GPU",
                                                        f"or {TEAM}: 2 GPUs, at most 108.1 GiB a GPU"]
    assert placement.check(placement.with_changes(args, [("vllm", "num_engines", 1)]), topology, 15, 80.0).need == 15
    # Without Adam offload nor checkpointing the actor does not fit its 2 GPUs; checkpointing alone does.
    args, topology = recipe(QWEN3_4B, "--rollout.micro_batch_size", "1")
    args.actor.gradient_checkpointing_enable = False
    assert advice(refusal(args, topology, gpus=18)) == [
        "--actor.gradient_checkpointing_enable: at most 79.8 GiB a GPU, fits"]


def test_mappa_plan_command():
    mappa = [sys.executable, "-m", "openrlhf_mappa.tools.mappa", "plan"]
    fits = subprocess.run(mappa + RECIPE + ["--mappa.model", str(QWEN3_4B), "--rollout.micro_batch_size", "1",
                                            "--mappa.gpus", "18", "--mappa.gpu_memory_gib", "80"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert fits.returncode == 0, fits.stderr[-2000:]
    assert "   2    1  verifier vLLM engine 1" in fits.stdout and "fits: 18 of 18 GPUs" in fits.stdout
    refused = subprocess.run(mappa + RECIPE + ["--mappa.model", str(QWEN3_4B), "--mappa.gpus", "8",
                                               "--mappa.gpu_memory_gib", "80"],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert refused.returncode == 1 and "REFUSED: the plan does not fit 8 x 80 GiB GPUs" in refused.stdout
    assert "<- beyond the cluster's GPUs" in refused.stdout
    # Colocated per agent (the GPU script's placement): a GPU's line names the three models it holds.
    colocated = subprocess.run(mappa + RECIPE + ["--mappa.model", str(QWEN3_4B), "--rollout.micro_batch_size", "1",
                                                 "--ds.adam_offload", "--mappa.colocate", "agent", "--vllm.enable_sleep",
                                                 "--ds.enable_sleep", "--mappa.gpus", "8", "--mappa.gpu_memory_gib", "80"],
                               capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert colocated.returncode == 0, colocated.stderr[-2000:]
    assert "placement: each agent's actor, reference and vLLM engines share that agent's GPUs" in colocated.stdout
    assert "   5  verifier: actor, reference, vLLM engine #1" in colocated.stdout and "fits: 6 of 8 GPUs" in colocated.stdout


def test_mappa_plan_without_a_gpu_checks_the_counts_and_says_the_memory_it_needs():
    # `mappa plan --mappa.gpus N` on a machine without a GPU (CUDA_VISIBLE_DEVICES empty, whatever this one has),
    # through the installed entry point: the plan by GPU counts, checked as the launcher checks --mappa.gpus alone,
    # with how to give the memory.
    mappa = [str(Path(sys.executable).parent / "mappa"), "plan", *RECIPE, "--mappa.model", str(QWEN3_4B),
             "--rollout.micro_batch_size", "1", "--mappa.gpus", "18"]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(mappa, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.startswith("mappa plan: 3 agents on 18 GPUs (memory not known); placement: ")
    assert "   2  GPUs: verifier/vllm" in proc.stdout and "total: 18 GPUs of the cluster's 18" in proc.stdout
    assert ("fits: 18 of 18 GPUs by count; GPU memory not checked: there is no GPU on this machine and no "
            f"--mappa.gpu_memory_gib\nGive --mappa.gpu_memory_gib G") in proc.stdout
    # Too few GPUs is refused by count alone, as at launch.
    few = subprocess.run(mappa[:-1] + ["8"], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert few.returncode == 1 and "REFUSED: the plan does not fit 8 GPUs:\n  - not enough GPUs" in few.stdout
    assert few.stdout.endswith(f"What to change, in this order:\n  1. {CLUSTER.format(18)}\n"
                               f"  2. or {AGENT}: 6 GPUs, fits\n  3. or {TEAM}: 2 GPUs, fits\n")


# ---------------------------------------------------------------- LoRA agents (topology key `lora`)


def lora_recipe(tmp_path, model, *extra, rank=16):
    """The recipe's team with a LoRA adapter per agent (rank 16 on every linear layer): one engine pool."""
    import yaml

    raw = yaml.safe_load((ROOT / "examples" / "configs" / "mathchat.yaml").read_text())
    for agent in raw["agents"]:
        agent["lora"] = {"rank": rank}
    path = tmp_path / "mathchat_lora.yaml"
    path.write_text(yaml.safe_dump(raw))
    argv = RECIPE[:1] + [str(path)] + RECIPE[2:]
    args = parse_args(argv + ["--mappa.model", str(model), *extra])
    return args, load_topology(str(path), model_override=args.mappa.model)


@pytest.mark.parametrize("name", ["qwen3-4b", "tiny"])
def test_lora_parameter_count_matches_peft(tmp_path, name):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    path = model_dir(tmp_path, name)
    size = placement.model_size(path)
    for targets in (["all-linear"], ["q_proj", "v_proj"]):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets[0] if targets == ["all-linear"] else targets))
        trained = sum(p.numel() for p in peft.parameters() if p.requires_grad)
        assert size.lora_params(8, targets) == trained


A = L * 16 * ((H + Q) + 2 * (H + K) + (Q + H) + 3 * (H + I))  # rank 16 on q k v o gate up down, by hand


def test_lora_plan_agrees_with_a_hand_computation(tmp_path):
    args, topology = lora_recipe(tmp_path, QWEN3_4B, "--rollout.micro_batch_size", "1")
    plan = placement.check(args, topology, gpus=8, gpu_gib=80.0)
    assert A == 33_030_144
    # Each agent: its actor (2 ranks), no reference (the base with the adapter off); one pool of 2 engines for all.
    assert plan.counts == {"problem_solver/actor": 2, "code_executor/actor": 2, "verifier/actor": 2, "pool qwen3-4b/vllm": 2}
    D = 2
    held = (2 * P + 2 * A + 2 * A + 12 * A) / D / GIB + 1  # frozen base and adapter; gradients and Adam of A only
    slot = {g.label(0): [(g, 0)] for g in plan.groups}
    assert plan.peak(slot["verifier actor rank 0/2"], "train") == pytest.approx(held + TRAIN, rel=1e-9)
    assert plan.peak(slot["verifier actor rank 0/2"], "sync") == pytest.approx(held, rel=1e-9)  # no gathered embedding
    slots = 3 * 2 * A / GIB  # max_loras 3 slots at max_lora_rank 16 on the targeted layers, bf16
    kv_gib = 0.6 * 80 - 2 * P / GIB - slots - (8192 * TOKEN_LAYER + 256 * V * 4) / GIB
    assert plan.peak(slot["pool qwen3-4b vLLM engine 0"], "rollout") == pytest.approx(0.6 * 80 + 1 + GRAPHS, rel=1e-9)
    text = placement.format_plan(plan)
    assert f"weights + 3 LoRA slots {(2 * P / GIB + slots):.1f}" in text and f"KV cache {kv_gib:.1f} GiB" in text
    assert (f"LoRA rank 16 on all-linear: 33.0M trained parameters (0.82% of the model); a sync sends "
            f"{2 * A / 2**20:.0f} MiB, not {2 * P / 2**20:.0f} MiB") in text
    assert "reference log-probs: this actor with the adapter off (no reference group)" in text
    assert "serves problem_solver, code_executor, verifier: the base model once, each agent's adapter by request " \
           "(max_loras 3, max_lora_rank 16)" in text

    # QLoRA: the base's linear layers in nf4 (4 bits and a byte of scale per 64 weights), the rest bf16.
    args, topology = lora_recipe(tmp_path, QWEN3_4B, "--rollout.micro_batch_size", "1", "--ds.load_in_4bit")
    plan = placement.check(args, topology, gpus=8, gpu_gib=80.0)
    linear = L * (H * Q + 2 * H * K + Q * H + 3 * H * I)
    base = 2 * (P - linear) + linear * 33 / 64
    held = (base + 2 * A + 2 * A + 12 * A) / D / GIB + 1
    slot = {g.label(0): [(g, 0)] for g in plan.groups}
    assert plan.peak(slot["verifier actor rank 0/2"], "train") == pytest.approx(held + TRAIN, rel=1e-9)
    text = placement.format_plan(plan)
    assert f"4-bit base (QLoRA): {base / GIB:.1f} GiB of weights in all, not {2 * P / GIB:.1f}" in text
    assert f"weights + 3 LoRA slots {(2 * P / GIB + slots):.1f}" in text  # the pool serves the bf16 base

    # Team colocation: per GPU, 3 actor ranks and 1 pool engine, each asking Ray for a quarter of it.
    args, topology = lora_recipe(tmp_path, QWEN3_4B, "--mappa.colocate", "team")
    assert placement.gpu_share(args, topology) == 0.25
    # Per agent, a pool serving three agents has no agent's GPUs to sit on.
    args, topology = lora_recipe(tmp_path, QWEN3_4B, "--mappa.colocate", "agent")
    assert "LoRA engine pools (pool qwen3-4b) serve several agents, so they cannot sit on one agent's GPUs: use " \
           "--mappa.colocate team or none" in refusal(args, topology, gpus=8)


def test_readme_lora_figures_are_the_plans(tmp_path):
    # The figures of the README and of docs/reference.md's LoRA section, as `mappa plan` computes them from the GPU
    # script's flags with a LoRA topology.
    readme = (ROOT / "README.md").read_text() + (ROOT / "docs" / "reference.md").read_text()
    figures = {}
    for env in ({"COLOCATE": "team", "GPUS_PER_AGENT": "8"}, {"COLOCATE": "none"}):
        argv, _ = script_flags(tmp_path, "train_mappa_mathchat.sh", **env)
        for name in ("qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b"):
            lora_argv = argv[: argv.index("--mappa.topology")] + argv[argv.index("--mappa.topology") + 2 :]
            figures[env["COLOCATE"], name] = lora_recipe(tmp_path, ROOT / "tests" / "fixtures" / name, *lora_argv)
    # The team of 4B agents on one GPU: one actor rank each and one pool engine, with forward micro-batches of 1.
    flags = "--rollout.micro_batch_size 1 --actor.num_gpus_per_node 1 --vllm.num_engines 1"
    args, topology = figures["team", "qwen3-4b"]
    one = placement.with_changes(args, [("rollout", "micro_batch_size", 1), ("actor", "num_gpus_per_node", 1),
                                        ("vllm", "num_engines", 1)])
    assert placement.check(one, topology, gpus=1, gpu_gib=80.0).need == 1
    assert f"3 × Qwen3-4B with LoRA: **1 GPU** of 80 GB (`COLOCATE=team` and `{flags}`)" in " ".join(readme.split())
    fits = {key: not placement.make_plan(*figures[key], 80.0).problems(8) for key in figures}
    largest = [n for n in ("qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b") if fits["none", n] or fits["team", n]]
    assert largest[-1] == "qwen3-14b" and fits["none", "qwen3-14b"]
    assert "the largest Qwen3 whose 3-agent team fits one 8 × 80 GB node is **Qwen3-14B**" in " ".join(readme.split())
    # A pool's engines take one GPU each (validate refuses tensor-parallel LoRA engines), which 32B's weights fill
    # whatever the GPU count: no KV cache for one sequence.
    for colocate in ("none", "team"):
        engines = [g for g in placement.make_plan(*figures[colocate, "qwen3-32b"], 80.0).groups if g.kind == "vllm"]
        assert "vLLM would refuse to start" in engines[0].problems[0]
    assert "3 × Qwen3-32B fits no layout: a pool's engine takes one GPU" in " ".join(readme.split())
    assert f"send {2 * A / 2**20:.0f} MiB per Qwen3-4B agent,\nnot {2 * P / 2**20:.0f} MiB" in readme


def test_host_memory_of_the_paper_recipe_is_planned_per_node(tmp_path):
    # The GPU script's flags: Adam states and fp32 gradients in pinned host memory (--ds.adam_offload), each sleeping
    # engine's bf16 weights there (--vllm.enable_sleep), 2 GiB per process; GPUs 0-5 on one node of 8.
    argv, _ = script_flags(tmp_path, "train_mappa_mathchat.sh")
    args, topology = planned(argv + ["--mappa.host_memory_gib", "1024"])
    D = 2
    actor = (12 + 4) * P / D / GIB + 2
    reference = 2  # its process only: no --ref.offload
    engine = 2 * P / GIB + 2
    node = 3 * D * (actor + reference + engine)
    assert round(node) == 261 and round(node - 3 * D * 6) == 225  # the gpu-path review's 225 GiB, plus the processes
    plan = placement.check(args, topology, gpus=8, gpu_gib=79.6)
    assert [round(sum(need.values()), 6) for _, _, need in plan.nodes()] == [round(node, 6)]
    assert f"host memory, node 0 (6 GPUs): {node:.1f} GiB of its 1024" in placement.format_plan(plan)

    # A node of 256 GiB: the GPUs fit, the host does not; Adam or the engines' weights back on the GPUs do not fit
    # them, so the node size is named.
    args.mappa.host_memory_gib = 256
    message = refusal(args, topology, gpus=8, gib=79.6)
    assert f"node 0 (6 GPUs) needs {node:.0f} GiB of host memory, more than its 256 GiB" in message
    back = "(host memory back for GPU memory): 6 GPUs, at most"
    assert advice(message) == [f"without --ds.adam_offload {back} 86.1 GiB a GPU",
                               f"or without --vllm.enable_sleep {back} 113.9 GiB a GPU",
                               "or nodes with at least 261 GiB of host memory, or fewer GPUs per node "
                               "(--mappa.gpus_per_node, with more nodes)"]
    # Nodes of 4 GPUs: node 0 holds 4 of the 6 GPUs (2 agents), node 1 the third agent's 2.
    args.mappa.gpus_per_node = 4
    assert [round(sum(n.values())) for _, _, n in placement.make_plan(args, topology, 79.6).nodes()] == [round(node * 4 / 6),
                                                                                                     round(node * 2 / 6)]
    # The references' weights offloaded too (--ref.offload: 6 x 3.7 GiB more) on a node of 270 GiB: the change that
    # fits gives host memory back for GPU memory, the references' weights on their GPUs again.
    args, topology = planned(argv + ["--ref.offload", "--mappa.host_memory_gib", "270"])
    assert f"needs {node + 3 * D * 2 * P / D / GIB:.0f} GiB of host memory" in refusal(args, topology, gpus=8, gib=79.6)
    first = advice(refusal(args, topology, gpus=8, gib=79.6))[0]
    assert first == "without --ref.offload (host memory back for GPU memory): 6 GPUs, at most 66.1 GiB a GPU, fits"


def test_the_plan_across_nodes(tmp_path):
    # The paper's recipe (the GPU script: each agent's actor, reference and 2 engines colocated on its 2 GPUs) on
    # 2 nodes of 4 GPUs: two agents fill node 0, the third takes half of node 1; no agent's GPUs span nodes, and
    # each node's host memory is its own agents' (the recipe's 261 GiB on one node: 2/3 and 1/3 of it).
    argv, _ = script_flags(tmp_path, "train_mappa_mathchat.sh")
    args, topology = planned(argv + ["--mappa.gpus_per_node", "4", "--mappa.host_memory_gib", "1024"])
    plan = placement.check(args, topology, gpus=8, gpu_gib=79.6)
    assert plan.place(8) == {"problem_solver": [0, 0], "code_executor": [0, 0], "verifier": [1, 1]}
    assert plan.place([4, 4]) == plan.place(8)  # the nodes as Ray reports them: the same plan
    assert not plan.across_nodes(8)
    text = placement.format_plan(plan, 8)
    assert "   1    1  verifier: actor, reference, vLLM engine #1" in text
    assert "total: 6 GPUs of the cluster's 8 on 2 nodes" in text
    agent = 2 * ((12 + 4) * P / 2 / GIB + 2 + 2 + 2 * P / GIB + 2)  # as in the host-memory test below, per agent
    assert [sum(need.values()) for _, _, need in plan.nodes(8)] == [pytest.approx(2 * agent), pytest.approx(agent)]
    assert f"host memory, node 1 (2 GPUs): {agent:.1f} GiB of its 1024" in text
    # Each node's own memory, as the launch reads it on each node: node 1 (one agent) fits 100 GiB, not 80.
    plan.host_gib = [1024, 100]
    assert not plan.problems(8)
    plan.host_gib = [1024, 80]
    assert plan.problems(8) == [f"node 1 (2 GPUs) needs {agent:.0f} GiB of host memory, more than its 80 GiB: actor Adam "
                                f"states 45, actor fp32 gradients 15, actor process 4, reference process 4, vllm weights "
                                f"15, vllm process 4"]
    # The team on all 8 GPUs: one set larger than a node spans both, and the plan says so; each agent's
    # weight sync is within a GPU (colocated).
    argv, _ = script_flags(tmp_path, "train_mappa_mathchat.sh", COLOCATE="team", GPUS_PER_AGENT="8")
    args, topology = planned(argv + ["--mappa.gpus_per_node", "4"])
    plan = placement.check(args, topology, gpus=8, gpu_gib=79.6)
    assert plan.place(8) == {"": [0, 0, 0, 0, 1, 1, 1, 1]}
    assert plan.across_nodes(8) == ["the team's GPUs: 8 GPUs on nodes 0, 1 (more than a node's 4)"]
    # GPUs of their own: 18 GPUs, refused on 8 whatever the nodes.
    argv, _ = script_flags(tmp_path, "train_mappa_mathchat.sh", COLOCATE="none")
    args, topology = planned(argv + ["--mappa.gpus_per_node", "4"])
    assert "need 18 GPUs but the cluster has 8" in refusal(args, topology, gpus=8, gib=79.6)


def test_three_14b_agents_on_two_nodes_of_8(tmp_path):
    # 3 x Qwen3-14B with the GPU script's flags on 2 nodes of 8 x 80 GB: 2 GPUs per agent do not fit (the
    # reference's weights beside the engine), 4 per agent do: two agents on node 0, the third on node 1.
    qwen3_14b = lambda argv: parse_args(argv + ["--mappa.model", str(ROOT / "tests" / "fixtures" / "qwen3-14b"),
                                                "--mappa.gpus_per_node", "8"])
    args = qwen3_14b(script_flags(tmp_path, "train_mappa_mathchat.sh")[0])
    topology = load_topology(str(ROOT / args.mappa.topology), model_override=args.mappa.model)
    assert "needs 92.0 GiB in the experience phase" in refusal(args, topology, gpus=16, gib=79.6)
    # The team on 8 GPUs splits vLLM's 0.6 three ways, which leaves no KV cache beside 14B weights: no saving helps;
    # each agent on its own 2 GPUs again, its engine with the whole 0.6 and the references' weights on CPU, fits.
    args = qwen3_14b(script_flags(tmp_path, "train_mappa_mathchat.sh", COLOCATE="team", GPUS_PER_AGENT="8")[0])
    message = refusal(args, topology, gpus=16, gib=79.6)
    assert "leaves 0.0 GiB of KV cache, 0 tokens, fewer than one --data.max_len sequence (28672)" in message
    assert advice(message) == ["--rollout.micro_batch_size 1: at most 119.1 GiB a GPU",
                               "then --ref.offload: at most 108.8 GiB a GPU",
                               "then --ds.ring_attn_size 2: at most 108.8 GiB a GPU", f"or {MORE_GPUS}"]
    agent = placement.with_changes(args, [("ref", "offload", True), ("mappa", "colocate", "agent"),
                                          ("vllm", "gpu_memory_utilization", 0.6), ("actor", "num_gpus_per_node", 2),
                                          ("ref", "num_gpus_per_node", 2), ("vllm", "num_engines", 2)])
    assert placement.check(agent, topology, gpus=16, gpu_gib=79.6).need == 6
    args = qwen3_14b(script_flags(tmp_path, "train_mappa_mathchat.sh", GPUS_PER_AGENT="4")[0])
    plan = placement.check(args, topology, gpus=16, gpu_gib=79.6)
    assert plan.need == 12 and plan.place(16) == {"problem_solver": [0] * 4, "code_executor": [0] * 4, "verifier": [1] * 4}
    assert plan.sizes["verifier"][1].params > 14e9
    # On GPUs of their own with one engine each (15 GPUs): an agent's actor, reference and engine together where a
    # node has room; the third agent's do not fit one node's 3 free GPUs, so its components go apart, its actor
    # beside its engine (the weight sync stays inside node 0), its reference on node 1.
    args.mappa.colocate, args.vllm.enable_sleep, args.ds.enable_sleep = "none", False, False
    args.actor.num_gpus_per_node = args.ref.num_gpus_per_node = 2
    args.vllm.num_engines, args.vllm.gpu_memory_utilization = 1, 0.9
    plan = placement.check(args, topology, gpus=16, gpu_gib=79.6)
    placed = plan.place(16)
    assert {k: set(v) for k, v in placed.items()} == {
        "problem_solver/actor": {0}, "problem_solver/reference": {0}, "problem_solver/vllm": {0},
        "code_executor/actor": {1}, "code_executor/reference": {1}, "code_executor/vllm": {1},
        "verifier/actor": {0}, "verifier/reference": {1}, "verifier/vllm": {0}}
    assert not plan.across_nodes(16)
    # An engine of 8 tensor-parallel GPUs on nodes of 4: no node holds one, refused (vLLM's tensor parallelism
    # stays inside a node).
    args.vllm.tensor_parallel_size, args.mappa.gpus_per_node = 8, 4
    problems = placement.make_plan(args, topology, None).problems(40)
    assert "the vLLM engines' tensor-parallel groups (8 GPUs each, on one node) fit no node's free GPUs on nodes of " \
           "4, 4, 4, 4, 4, 4, 4, 4, 4, 4 GPUs" in problems
    # With no cluster given (`mappa plan` without --mappa.gpus: as many nodes of 4 as it needs), refused alike.
    assert "the vLLM engines' tensor-parallel groups (8 GPUs each, on one node) fit no node's free GPUs on nodes of " \
           "4 GPUs" in placement.make_plan(args, topology, None).problems(None)


def test_long_actions_name_ring_attention(tmp_path):
    # The DSBench script with the authors' longest prompts (24K + 16K generated: --data.max_len 40960), Qwen3-4B, one
    # node of 8 x 80 GiB: a forward micro-batch of 2 such sequences does not fit beside each agent's engine: micro-
    # batches of 1 and the references' weights on CPU fit, as does a ring of the agent's 2 GPUs (each rank holds
    # half of every sequence's tokens).
    argv = script_flags(tmp_path, "train_mappa_dsbench.sh")[0] + ["--data.max_len", "40960"]
    args, topology = planned(argv)
    message = refusal(args, topology, gpus=8)
    assert "needs 89.5 GiB in the experience phase" in message
    assert advice(message) == ["--rollout.micro_batch_size 1: at most 80.7 GiB a GPU",
                               "then --ref.offload: at most 76.9 GiB a GPU, fits"]
    ring, _ = planned(argv + ["--ds.ring_attn_size", "2"])
    plan = placement.check(ring, topology, gpus=8, gpu_gib=80.0)
    assert plan.need == 6 and ring.ds.packing_samples is False  # packing is turned on per agent (agent_args)
    assert placement.agent_args(ring, topology.agents[0]).ds.packing_samples is True
    # Each rank's activations and logits are half of a whole sequence's, its weights and states unchanged.
    whole = {g.kind: g for g in placement.make_plan(args, topology, 80.0).groups if g.agent == "modeler"}
    half = {g.kind: g for g in plan.groups if g.agent == "modeler"}
    for kind, phase in (("actor", "experience"), ("actor", "train"), ("reference", "experience")):
        for label in ("activations", "logits"):
            assert half[kind].adds[phase][label] == pytest.approx(whole[kind].adds[phase][label] / 2), (kind, label)
    assert half["actor"].held == whole["actor"].held
    assert "ring attention: its ranks in rings of 2, each holding 20480 of a sequence's 40960 tokens" in \
        placement.format_plan(plan, 8)
    # Qwen3-14B at 64K tokens: a ring of 2 on 2 GPUs an agent is named and does not fit, then more GPUs; 4 an agent,
    # in rings of 2, fit.
    args14 = parse_args(argv[:-2] + ["--data.max_len", "65536", "--mappa.model", str(ROOT / "tests/fixtures/qwen3-14b")])
    topology14 = load_topology(str(ROOT / args14.mappa.topology), model_override=args14.mappa.model)
    assert advice(refusal(args14, topology14, gpus=8)) == ["--rollout.micro_batch_size 1: at most 162.6 GiB a GPU",
                                                           "then --ref.offload: at most 148.8 GiB a GPU",
                                                           "then --ds.ring_attn_size 2: at most 83.7 GiB a GPU",
                                                           f"or {MORE_GPUS}"]
    four = placement.with_changes(args14, [("ref", "offload", True), ("ds", "ring_attn_size", 2),
                                           ("actor", "num_gpus_per_node", 4), ("ref", "num_gpus_per_node", 4),
                                           ("vllm", "num_engines", 4)])
    assert placement.check(four, topology14, gpus=12, gpu_gib=80.0).need == 12
    # Per agent, in the topology: a ring for the modeler alone; the other agents' GPUs still do not fit.
    topology.agents[1].ring_attn_size = 2
    assert topology.agents[1].name == "modeler"
    problems = placement.make_plan(args, topology, 80.0).problems(8)
    assert len(problems) == 2 and not any("modeler" in p for p in problems)
    # A ring's ranks share their micro-batches: an odd GPU count is refused before any plan.
    with pytest.raises(SystemExit, match=r"agent 'data_engineer': its 3 actor GPUs must be a multiple of its "
                                         r"ring-attention size \(2\) x its tensor-parallel size \(1\): the ranks of a "
                                         r"ring or tensor-parallel group share each micro-batch"):
        from openrlhf_mappa.cli.train_mappa_ray import validate

        validate(parse_args(argv + ["--ds.ring_attn_size", "2", "--actor.num_gpus_per_node", "3",
                                    "--mappa.model", str(QWEN3_4B)]), topology)


def test_tensor_parallelism_splits_the_linear_layers_and_needs_zero_2(tmp_path):
    # DeepSpeed's AutoTP at ZeRO-2 on the verifier's 4 GPUs in pairs: each rank holds half of every linear layer
    # (hand-computed as LAYER's projections), and ZeRO-2 shards gradients and Adam states over the 2 pairs.
    from openrlhf_mappa.cli.train_mappa_ray import validate

    args, topology = recipe(QWEN3_4B, "--ds.zero_stage", "2", "--actor.num_gpus_per_node", "4",
                            "--ref.num_gpus_per_node", "4", "--rollout.micro_batch_size", "1")
    verifier = next(spec for spec in topology.agents if spec.name == "verifier")
    verifier.tensor_parallel_size = 2
    linear = L * (H * Q + 2 * H * K + Q * H + 3 * H * I)
    Pr = P - linear + linear / 2
    held = {g.agent: g.held for g in placement.make_plan(args, topology, 80.0).groups if g.kind == "actor"}
    assert held["verifier"]["weights"] == pytest.approx(2 * Pr / GIB)
    assert held["verifier"]["Adam states"] == pytest.approx(12 * Pr / 2 / GIB)
    assert held["verifier"]["gradients"] == pytest.approx(2 * Pr / 2 / GIB)
    assert held["problem_solver"]["Adam states"] == pytest.approx(12 * P / 4 / GIB)  # the flag's 1 elsewhere
    text = placement.format_plan(placement.make_plan(args, topology, 80.0))
    assert ("tensor parallelism (DeepSpeed AutoTP): every linear layer split over 2 ranks, ZeRO-2 over 2 "
            "data-parallel ranks") in text
    # Validation: a group's ranks share micro-batches; AutoTP trains with ZeRO 0-2 only.
    validate(args, topology)  # 16 a step: micro-batches of 1 on the verifier's 2 data-parallel ranks
    verifier.num_gpus_per_node = 3
    with pytest.raises(SystemExit, match=r"its 3 actor GPUs must be a multiple of its ring-attention size \(1\) x "
                                         r"its tensor-parallel size \(2\)"):
        validate(args, topology)
    verifier.num_gpus_per_node = None
    args.ds.zero_stage = 3
    with pytest.raises(SystemExit, match=r"agent 'verifier': tensor parallelism \(2\) is DeepSpeed's AutoTP, which "
                                         r"trains with ZeRO stages 0-2 only .*: pass --ds.zero_stage 2"):
        validate(args, topology)


def test_actor_threads_come_from_each_gpu_nodes_usable_cores(tmp_path):
    # F8: the threads once came from the launcher's os.cpu_count() over --mappa.gpus_per_node: a CPU head node's
    # cores, or every core of a container's host (224 / 8 = 28 threads per process against a 32-CPU quota).
    from openrlhf_mappa.launch import actor_threads

    affinity = len(os.sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text("100000 100000\n")  # a container's quota: one CPU
    assert placement.usable_cores(str(tmp_path)) == 1
    (tmp_path / "cpu.max").write_text("max 100000\n")  # no quota: the CPUs this process may run on
    assert placement.usable_cores(str(tmp_path)) == affinity
    assert placement.usable_cores(str(tmp_path / "no-cgroup-v2")) == affinity
    # Issue 63 (review 3, finding 8): cgroup v1 hosts keep the quota in cpu/cpu.cfs_quota_us, which was not
    # read.
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("150000\n")  # 1.5 CPUs: one core's worth, whole
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert affinity > 1 and placement.usable_cores(str(v1)) == 1
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")  # no quota
    assert placement.usable_cores(str(v1)) == affinity
    # Each GPU node's own cores over its own GPUs, the fewest of them: 32 over 8 GPUs, 64 over 4.
    assert actor_threads([32, 64], [8, 4]) == 4
    assert actor_threads([4], [8]) == 1  # never 0 threads


def test_mappa_plan_names_no_change_that_the_same_command_refuses():
    # A trained coach's engines judge after the team's engines sleep, so --vllm.enable_sleep is refused with it; the
    # plan once named sleep (and colocation, which brings it) as the change for such a team. Each change it names
    # now, applied in its order, is a command the launcher accepts; on GPUs of their own the savings named fit 24.
    from openrlhf_mappa.cli.train_mappa_ray import accepted

    mappa = [sys.executable, "-m", "openrlhf_mappa.tools.mappa", "plan"]
    trained = [*RECIPE, "--mappa.model", str(QWEN3_4B), "--mappa.coach.kind", "trained", "--mappa.coach.model",
               str(QWEN3_4B), "--mappa.gpu_memory_gib", "79.6"]
    for colocate in ("none", "agent", "team"):
        proc = subprocess.run(mappa + trained + ["--mappa.colocate", colocate, "--mappa.gpus", "8"],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 1 and "REFUSED: the plan does not fit 8 x 79.6 GiB GPUs" in proc.stdout, proc.stdout
        changes = advice(proc.stdout)
        assert changes[-1].endswith(", fits" if colocate == "none" else MORE_GPUS), changes
        assert not any("--vllm.enable_sleep" in change or "--mappa.colocate" in change for change in changes)
        argv = [*trained, "--mappa.colocate", colocate]
        for change in changes:
            if change.removeprefix("then ").startswith("--"):
                argv += change.removeprefix("then ").split(":")[0].split()
                args = parse_args(argv)
                topology = load_topology(args.mappa.topology, model_override=args.mappa.model)
                assert accepted(topology)(args), change
        if colocate == "none":
            assert changes[0] == CLUSTER.format(24) and placement.check(args, topology, 24, 79.6).need == 24


def test_mappa_plan_refuses_a_hub_it_cannot_reach_at_once(tmp_path):
    # With a hub id and no hub, `mappa plan` once retried for minutes, then said "fits" with no memory estimated;
    # the launcher refuses the same id in one request. The hub here: a port nothing listens on.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{port}", HF_HOME=str(tmp_path / "hf"))  # an empty cache
    argv = [sys.executable, "-m", "openrlhf_mappa.tools.mappa", "plan", *RECIPE, "--mappa.model",
            "Qwen/Qwen3-4B", "--mappa.gpus", "8", "--mappa.gpu_memory_gib", "79.6"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (f"mappa plan: --mappa.model: model 'Qwen/Qwen3-4B' is not a local directory (relative to {ROOT}), "
            f"and the Hugging Face hub (http://127.0.0.1:{port}) could not be reached") in proc.stderr, proc.stderr
    env["HF_HUB_OFFLINE"] = "1"
    offline = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert offline.returncode == 1 and "is not in the Hugging Face cache" in offline.stderr, offline.stderr


@pytest.mark.parametrize("script", ["train_mappa_mathchat.sh", "train_mappa_dsbench.sh"])
def test_the_gpu_scripts_pass_extra_flags_on(tmp_path, script):
    # The README's way without flash-attn is --ds.attn_implementation sdpa: the scripts once took no extra flags, so
    # it meant editing the script. The later flag wins in argparse.
    argv, _ = script_flags(tmp_path, script, "--ds.attn_implementation", "sdpa", "--ckpt.max_num", "2")
    assert argv[-4:] == ["--ds.attn_implementation", "sdpa", "--ckpt.max_num", "2"]
    args, _ = planned(argv)
    assert (args.ds.attn_implementation, args.ckpt.max_num) == ("sdpa", 2)
