"""The upstream pull requests in patches/*.patch, each a plain diff against the pinned openrlhf. Each applies
cleanly to a copy of the installed package (conftest.openrlhf_copy), and brings a check that imports the patched
copy ahead of the installed one and asserts what the patch fixes. Every check also runs against an unpatched copy
and must fail there, for the reason its patch gives: a check that passed without its patch would prove nothing.

Run as a script, this file is the checks' runner (see run_checks); pytest runs it once for all of them.
"""

import json
import os
import re
import signal
import subprocess
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import openrlhf_copy

ROOT = Path(__file__).resolve().parents[1]

# patch file -> (its check, what the check says on the unpatched copy)
SERIES = {
    "openrlhf_lora_vllm_sync.patch": ("check_lora_vllm_sync", "base_model.model.model.embed_tokens.weight is not"),
    "openrlhf_vllm_gpu_share.patch": ("check_vllm_gpu_share", "unexpected keyword argument 'gpu_share'"),
    "openrlhf_train_ppo_ray_get_parser.patch": ("check_get_parser", "train_ppo_ray imports ray"),
    "openrlhf_agent_step_rewards.patch": ("check_agent_step_rewards", "the executor returned no step_rewards"),
    "openrlhf_flash_attn_lazy_import.patch": ("check_flash_attn_lazy_import", "No module named 'flash_attn"),
}
HEAVY = ("torch", "ray", "vllm", "deepspeed", "transformers", "peft")


# ---- the checks: each runs in its own process, its openrlhf copy first on sys.path ----


def check_lora_vllm_sync():
    """(a) broadcast_to_vllm of a LoRA actor delivers the merged weights under the base model's names."""
    import copy
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    from openrlhf.models import Actor
    from openrlhf.trainer.ray import ppo_actor
    from openrlhf_mappa.tools.tiny_model import build_tiny_model

    tiny = tempfile.mkdtemp()
    build_tiny_model(tiny)
    base_model = lambda: AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.bfloat16)  # noqa: E731

    class Engine:
        """Loads what it is sent as OpenRLHF's WorkerWrap.update_weight does: a (name, dtype, shape) call, then
        the tensor through the sync group's broadcast, loaded under that name into a plain copy of the base model
        (what a vLLM engine started from --pretrain holds; one cannot start here)."""

        def __init__(self):
            self.model = base_model()
            self.params, self.loaded = dict(self.model.named_parameters()), []
            self.update_weight = SimpleNamespace(remote=self.announce)

        def announce(self, name, dtype, shape, empty_cache=False):
            assert name in self.params, f"{name} is not a parameter of the engine's model"
            assert dtype == torch.bfloat16 and tuple(shape) == tuple(self.params[name].shape), (name, dtype, shape)
            self.loaded.append(name)

        def receive(self, tensor):
            self.params[self.loaded[-1]].data.copy_(tensor)

    # Stand-ins for what a CPU process cannot have: a Ray cluster (the engine's calls are made directly, so
    # ray.get gets their results), CUDA streams, and the DeepSpeed engine whose .module is the peft model.
    ppo_actor.ray = SimpleNamespace(get=lambda refs: refs)
    torch.cuda.current_stream = torch.cuda.synchronize = lambda *a: None
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    os.environ["LOCAL_RANK"] = "0"  # DeepSpeed's zero.Init (ZeRO-3) reads it from the launcher

    def synced(zero_stage, adapters=None):
        """A LoRA actor as OpenRLHF's PolicyModelActor builds it, after one broadcast_to_vllm to a new Engine."""
        ds_config = {"zero_optimization": {"stage": zero_stage}, "bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1}
        actor = Actor(tiny, attn_implementation="eager", param_dtype="bf16", lora_rank=4, lora_alpha=8,
                      target_modules="all-linear", ds_config=ds_config)  # fmt: skip
        for name, param in actor.model.named_parameters():
            if "lora_B" in name:  # peft starts B at 0 (no change); a training step moves it
                param.data.normal_(std=0.05)
            if adapters and name in adapters:
                param.data.copy_(adapters[name])
        trainer = object.__new__(ppo_actor.ActorPPOTrainer)  # its __init__ builds losses and buffers, unused here
        trainer.strategy = SimpleNamespace(args=SimpleNamespace(
            vllm=SimpleNamespace(enable_prefix_caching=False, sync_with_ray=False),
            ds=SimpleNamespace(zero_stage=zero_stage, tensor_parallel_size=1),
        ))  # fmt: skip
        trainer.actor = SimpleNamespace(model=SimpleNamespace(module=actor.model))
        trainer.vllm_engines, trainer.use_cuda_ipc = [Engine()], False
        trainer._model_update_group = SimpleNamespace(broadcast=lambda t, src, stream: trainer.vllm_engines[0].receive(t))
        trainer.broadcast_to_vllm()
        return actor.model, trainer.vllm_engines[0]

    torch.manual_seed(0)
    peft_model, engine = synced(2)
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters()}
    # Only the adapted layers change in training, so only they are sent: 2 layers x 7 linear modules.
    lora_layers = {n.rsplit(".lora_A", 1)[0] for n in before if ".lora_A." in n}
    assert len(engine.loaded) == len(set(engine.loaded)) == len(lora_layers) == 14, engine.loaded
    merged = dict(copy.deepcopy(peft_model).merge_and_unload().named_parameters())  # peft's own merge
    untrained = base_model()
    base = dict(untrained.named_parameters())
    for name in engine.loaded:
        assert torch.equal(engine.params[name], merged[name]), f"{name}: not the merged weight"
        assert not torch.equal(merged[name], base[name]), f"{name}: the adapter changed nothing"
    tokens = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11]])
    with torch.no_grad():
        served, trained, before_training = (m(tokens).logits.float() for m in (engine.model, peft_model, untrained))
    assert (served - trained).abs().max() < (before_training - trained).abs().max() / 10, "the engine serves another model"
    assert all(torch.equal(p, before[n]) for n, p in peft_model.named_parameters()), "the actor was merged in place"

    # ZeRO-3: each base weight is a shard until gathered with its layer's adapters; the same adapters, the same result.
    sharded, engine3 = synced(3, adapters={n: p for n, p in before.items() if ".lora_" in n})
    assert any(hasattr(p, "ds_shape") and p.numel() == 0 for p in sharded.parameters())  # partitioned indeed
    assert engine3.loaded == engine.loaded and all(torch.equal(engine3.params[n], engine.params[n]) for n in engine.loaded)


def check_vllm_gpu_share():
    """(b) create_vllm_engines asks Ray for `gpu_share` of a GPU per engine; without it, as before."""
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup

    from openrlhf.trainer.ray import vllm_engine

    asked = []

    class Recorder:  # in place of RolloutRayActor: starting an engine needs a Ray cluster and a GPU
        @staticmethod
        def options(**options):
            return SimpleNamespace(remote=lambda **kwargs: asked.append((options, kwargs)))

    vllm_engine.RolloutRayActor = Recorder
    shared = PlacementGroup(PlacementGroupID.from_random())  # a colocated run's group; nothing schedules on it
    common = dict(num_engines=3, tensor_parallel_size=1, pretrain="model", seed=0, full_determinism=False,
                  enable_prefix_caching=False, enforce_eager=True, max_model_len=64, shared_pg=shared)  # fmt: skip
    for share, expected in ((1 / 9, 1 / 9), (None, 0.2)):
        asked.clear()
        vllm_engine.create_vllm_engines(**common, **({} if share is None else {"gpu_share": share}))
        assert len(asked) == 3
        for i, (options, kwargs) in enumerate(asked):
            assert options["num_gpus"] == options["num_cpus"] == kwargs["num_gpus"] == expected, (share, options, kwargs)
            assert options["scheduling_strategy"].placement_group_bundle_index == i
            assert kwargs["seed"] == i and kwargs["tensor_parallel_size"] == 1


def check_get_parser():
    """(c) train_ppo_ray's parser and checks, importable and usable without Ray, torch, vLLM or DeepSpeed."""
    import importlib.abc
    import importlib.util

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in HEAVY:
                raise ImportError(f"train_ppo_ray imports {name} before training")

    sys.meta_path.insert(0, Refuse())
    from openrlhf.cli import train_ppo_ray

    # hierarchize's own file: its package's __init__ imports torch (train() imports it from there, as before)
    path = os.path.join(os.path.dirname(train_ppo_ray.__file__), "..", "utils", "config.py")
    spec = importlib.util.spec_from_file_location("openrlhf_config", path)
    config = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(config)
    parser = train_ppo_ray.get_parser()
    flags = ["--algo.advantage.estimator", "reinforce", "--actor.eps_clip", "0.3", "--rollout.batch_size", "8"]
    args = config.hierarchize(parser.parse_args(flags))
    train_ppo_ray.validate(args)
    assert args.actor.eps_clip_low_high == (0.3, 0.3) and args.rollout.batch_size == 8  # a default validate derives
    bad = config.hierarchize(parser.parse_args(flags[:2] + ["--rollout.batch_size", "1", "--rollout.micro_batch_size",
                                                            "4", "--actor.num_gpus_per_node", "2"]))  # fmt: skip
    try:
        train_ppo_ray.validate(bad)
    except AssertionError as e:
        assert "The number of sample batches must be greater" in str(e)
    else:
        raise AssertionError("validate() let too few sample batches through")
    assert not [m for m in sys.modules if m.split(".")[0] in HEAVY]


def check_agent_step_rewards():
    """(d) the multi-turn executor's per-step rewards reach each action's own returns."""
    import asyncio

    import torch
    from vllm import SamplingParams

    from openrlhf.trainer.ppo_utils.experience import Experience
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
    from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor
    from openrlhf_mappa.cli.flags import upstream_cli
    from openrlhf_mappa.tools.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    script = {"three steps": [1.0, 2.0, 4.0], "two steps": [0.5, -1.0]}  # label -> each step's reward
    replies = ["x = 2", "so y = 4", "answer: 8"]

    class Env(AgentInstanceBase):
        def __init__(self):
            self.step_count = 0

        async def reset(self, states, **kwargs):
            return {"observation": states["observation"]}

        async def step(self, states, **kwargs):
            rewards = script[states["label"]]
            self.step_count += 1
            return {"rewards": torch.tensor(rewards[self.step_count - 1]), "environment_feedback": " ok. ",
                    "done": self.step_count == len(rewards)}  # fmt: skip

    class Policy:  # fixed replies in place of a vLLM engine, so that each step's tokens are known
        def __init__(self):
            self.turn = 0

        async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
            text, self.turn = replies[self.turn], self.turn + 1
            ids = tokenizer(text=text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            return SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, text=text, finish_reason="stop", logprobs=None)])

    executor, outputs = MultiTurnAgentExecutor(Env), {}
    for label in script:
        outputs[label] = asyncio.run(executor.execute(prompt="Find y.", label=label, sampling_params=SamplingParams(
            max_tokens=32), max_length=256, hf_tokenizer=tokenizer, llm_engine=Policy()))  # fmt: skip
    for label, out in outputs.items():
        assert "step_rewards" in out, "the executor returned no step_rewards"
        assert out["step_rewards"] == script[label] and out["reward"] == sum(script[label]), out
        spans = [tokenizer.decode(out["observation_tokens"][start:end]) for start, end in out["action_ranges"]]
        assert spans == [r + tokenizer.eos_token for r in replies[: len(script[label])]], spans

    get_parser, validate, hierarchize = upstream_cli()  # train_ppo_ray's own defaults (0.11.2 has no get_parser)
    args = hierarchize(get_parser().parse_args(["--algo.advantage.estimator", "reinforce"]))
    validate(args)
    make = SamplesGenerator._process_response_into_experience  # reads no state of its generator (Ray, engines)
    samples = [make(None, out, max_len=256) for out in outputs.values()]
    batch = Experience.concat_experiences(samples, tokenizer.pad_token_id)  # as split_rollout_samples batches
    batch.index, batch.kl = [0, 1], torch.zeros(batch.action_mask.shape)
    maker = RemoteExperienceMaker(None, None, None, None, FixedKLController(0.0), SimpleNamespace(args=args), tokenizer)
    (batch,) = maker.compute_advantages_and_returns([batch])

    for row, out in enumerate(outputs.values()):
        rewards = out["step_rewards"]
        for k, (start, end) in enumerate(out["action_ranges"]):
            # action_mask[j] is token j + 1: step k's tokens are returns[start - 1 : end - 1]
            to_go = batch.returns[row, start - 1 : end - 1]
            assert torch.allclose(to_go, torch.tensor(sum(rewards[k:]))), (row, k, to_go)
    assert batch.info["return"].tolist() == [sum(r) for r in script.values()] and batch.step_rewards is None


def check_flash_attn_lazy_import():
    """(e) openrlhf.models and the launcher import without flash-attn; packing imports it where it is used."""
    import types

    import torch

    # MAPPA's import hook would run openrlhf with flash-attn stand-ins (patches/flash_attn_stub.py): off here, and
    # flash_attn unimportable, as on a machine without it, whether or not this one has it.
    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "_PatchFinder"]
    sys.modules["flash_attn"] = None
    import openrlhf.models  # noqa: F401
    import openrlhf.trainer.ray.launcher  # noqa: F401
    from openrlhf.models.ring_attn_utils import gather_and_pad_tensor, unpad_and_slice_tensor

    sequences = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0]])
    mask = (sequences != 0).long()
    try:
        unpad_and_slice_tensor(sequences, mask, None)
    except ImportError as e:
        assert "flash_attn" in str(e), e
    else:
        raise AssertionError("packing ran without flash-attn")

    # flash-attn cannot be built without CUDA: MAPPA's torch versions of its four helpers stand in for it.
    from openrlhf_mappa.patches import flash_attn_stub as helpers

    names = ("flash_attn", "flash_attn.bert_padding", "flash_attn.utils", "flash_attn.utils.distributed")
    stand_in = {name: types.ModuleType(name) for name in names}
    for name in ("index_first_axis", "pad_input", "rearrange", "unpad_input"):
        setattr(stand_in["flash_attn.bert_padding"], name, getattr(helpers, name))
    stand_in["flash_attn.utils.distributed"].all_gather = helpers.all_gather
    sys.modules.update(stand_in)
    packed, position_ids, _, pad_len, indices = unpad_and_slice_tensor(sequences, mask, None)
    assert packed.tolist() == [[1, 2, 3, 4, 5]] and position_ids.tolist() == [[0, 1, 2, 0, 1]] and pad_len == 0
    assert torch.equal(gather_and_pad_tensor(packed, None, 0, indices, 2, 4), sequences)


# ---- the runner ----


def run_checks(jobs: list) -> dict:
    """Run each job (check name, openrlhf copy, log file) in a process of its own; returns {log: exit code}.

    All but check_get_parser import openrlhf's trainer, and with it vLLM, DeepSpeed, peft and transformers: some
    20 s of CPU on this 2-core machine, each time. So this runner imports them once and forks a child per check,
    which puts its copy first on sys.path (as PYTHONPATH would) before anything imports openrlhf. check_get_parser,
    whose point is that none of them loads, forks before they do."""
    children = {}
    light = [job for job in jobs if job[0] == "check_get_parser"]
    for check, copy_root, log in light:
        children[fork_check(check, copy_root, log)] = log
    import deepspeed, peft, ray, torch, transformers, vllm  # noqa: F401, E401
    for check, copy_root, log in [job for job in jobs if job not in light]:
        children[fork_check(check, copy_root, log)] = log
    codes = {}
    while children:
        pid, status = os.wait()
        codes[children.pop(pid)] = os.waitstatus_to_exitcode(status)
    return codes


def fork_check(check: str, copy_root: str, log: str) -> int:
    """A child process that runs `check` with `copy_root` first on sys.path, its output in `log`: exit code 0 if the
    check passed and the openrlhf it imported was the copy's."""
    pid = os.fork()
    if pid:
        return pid
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1), os.dup2(fd, 2)
    signal.alarm(300)  # a hung check ends, not the whole run
    code = 1
    try:
        assert "openrlhf" not in sys.modules
        sys.path.insert(0, copy_root)
        globals()[check]()
        import openrlhf

        assert openrlhf.__file__.startswith(copy_root), f"checked {openrlhf.__file__}, not the copy"
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    print(json.dumps(run_checks(json.loads(Path(sys.argv[1]).read_text()))))


# ---- the tests ----


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    """Every check, on its patch's copy and on an unpatched one: {patch: (patched (code, log), unpatched (code,
    log))}. MAPPA_CPU_MODE=0: none of MAPPA's CPU patches touch the copies (only flash_attn_stub, which lets the
    unpatched openrlhf import without flash-attn; check_flash_attn_lazy_import turns it off)."""
    tmp = tmp_path_factory.mktemp("upstream")
    unpatched = openrlhf_copy(tmp / "unpatched")
    jobs, logs = [], {}
    for patch, (check, _) in SERIES.items():
        patched = openrlhf_copy(tmp / patch.removesuffix(".patch"), patch)
        logs[patch] = (str(tmp / f"{check}.patched.log"), str(tmp / f"{check}.unpatched.log"))
        jobs += [(check, patched, logs[patch][0]), (check, unpatched, logs[patch][1])]
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    env = dict(os.environ, MAPPA_CPU_MODE="0", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, __file__, str(tmp / "jobs.json")], capture_output=True, text=True,
                          timeout=600, env=env, cwd=tmp)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = json.loads(proc.stdout.splitlines()[-1])
    return {patch: tuple((codes[log], Path(log).read_text()) for log in pair) for patch, pair in logs.items()}


def test_the_series_is_every_patch_file_and_the_package_docstring_lists_it():
    assert sorted(p.name for p in (ROOT / "patches").glob("*.patch")) == sorted(SERIES)
    # A patch's change to upstream's own tests (benchmarks/upstream_tests.py applies it) belongs to a patch.
    test_changes = [p.name.removesuffix(".tests.diff") + ".patch"
                    for p in (ROOT / "patches").glob("*.tests.diff")]
    assert test_changes and set(test_changes) <= set(SERIES), test_changes
    docstring = (ROOT / "patches" / "__init__.py").read_text()
    assert all(f"`{patch}`" in docstring for patch in SERIES), "list each patch in patches/__init__.py"


@pytest.mark.parametrize("patch", SERIES)
def test_patch_applies_cleanly_and_explains_itself(tmp_path, patch):
    openrlhf_copy(tmp_path, patch)  # asserts: applies, no fuzz, no offset
    header = (ROOT / "patches" / patch).read_text().split("\n--- a/", 1)[0]
    assert header.startswith("Upstream candidate for openrlhf 0.11.2: ") and f"patch -p1 < {patch}" in header
    assert "Test: " in header or patch == "openrlhf_train_ppo_ray_get_parser.patch"  # (c) names tests/test_launch.py


def test_the_series_applies_together(tmp_path):
    # Each diff touches files no other one does, so any subset can be merged upstream in any order.
    touched = [set(re.findall(r"^\+\+\+ b/(\S+)", (ROOT / "patches" / p).read_text(), re.M)) for p in SERIES]
    assert all(touched) and sum(map(len, touched)) == len(set().union(*touched)), touched
    openrlhf_copy(tmp_path, *SERIES)


@pytest.mark.parametrize("patch", SERIES)
def test_check_passes_patched_and_fails_unpatched(checked, patch):
    (code, log), (unpatched_code, unpatched_log) = checked[patch]
    assert code == 0, f"{SERIES[patch][0]} on the patched copy:\n{log[-4000:]}"
    assert unpatched_code != 0 and SERIES[patch][1] in unpatched_log, (
        f"{SERIES[patch][0]} must fail on the unpatched copy, saying {SERIES[patch][1]!r}:\n{unpatched_log[-4000:]}"
    )
