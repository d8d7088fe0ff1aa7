"""The CPU patches (patches/*.py) and their import hook (openrlhf_mappa.compat), exercised for real.

Activation tests run in fresh interpreters (`sys.executable -c ...`): the hook is installed by the .pth file
at interpreter start and decides once per process, so only a new process shows a clean state. Each child
prints one `FACTS {json}` line; the assertions are made here so a failure shows the whole picture.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

from conftest import training
from openrlhf_mappa import placement
from openrlhf_mappa.compat import PatchVersionError, check_version
from openrlhf_mappa.patches import cpu_device
from openrlhf_mappa.patches.flash_attn_stub import index_first_axis, pad_input, unpad_input

CHILD_TIMEOUT_S = 120  # a hang (e.g. Ray waiting) fails the test instead of blocking the run


def child_env(**overrides):
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAPPA_CPU_MODE", "MAPPA_CPU_NUM_GPUS", "RAY_ADDRESS", "VLLM_CPU_KVCACHE_SPACE")}
    env.update(overrides)
    return env


def run_child(code, **env):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=child_env(**env),
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)


def facts_of(proc):
    assert proc.returncode == 0, f"child failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("FACTS ")]
    assert len(lines) == 1, f"expected one FACTS line, stdout was:\n{proc.stdout[-4000:]}"
    return json.loads(lines[0][len("FACTS "):])


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ── 1. activation ──


def test_cpu_mode_on_patches_ppo_actor_without_flash_attn():
    proc = run_child("""
        import importlib.util, json, sys
        import torch
        real_current_device, real_device = torch.cuda.current_device, torch.device

        import openrlhf.trainer.ray.ppo_actor as pa
        import openrlhf.models.ring_attn_utils as ra
        import openrlhf.utils.distributed_util as du
        from openrlhf_mappa.patches import cpu_device, flash_attn_stub, gloo_weight_sync

        pa.torch.cuda.synchronize()  # torch's own raises without CUDA; the view's is a no-op
        try:
            torch.cuda.current_device()
            real_raises = None
        except Exception as e:
            real_raises = type(e).__name__
        print("FACTS " + json.dumps(dict(
            flash_attn_installed=importlib.util.find_spec("flash_attn") is not None,
            cuda_available=torch.cuda.is_available(),
            patches=pa.__mappa_cpu_patches__,
            ring_attn_patches=ra.__mappa_cpu_patches__,
            current_device=str(pa.torch.cuda.current_device()),
            cuda0=str(pa.torch.device("cuda:0")),
            cuda_plain=str(pa.torch.device("cuda")),
            cpu=str(pa.torch.device("cpu")),
            view_tensor_is_torch_tensor=pa.torch.tensor is torch.tensor,
            module_torch_is_real=pa.torch is torch,
            stateless_is_gloo=du.stateless_init_process_group is gloo_weight_sync.stateless_init_process_group,
            barrier_is_patched=du.torch_dist_barrier_and_cuda_sync is cpu_device._barrier_only,
            unpad_is_stub=ra.unpad_input is flash_attn_stub.unpad_input,
            flash_attn_modules=sorted(n for n in sys.modules if n.split(".")[0] == "flash_attn"),
            real_current_device_same=torch.cuda.current_device is real_current_device,
            real_current_device_module=torch.cuda.current_device.__module__,
            real_device_same=torch.device is real_device,
            real_cuda0_type=torch.device("cuda:0").type,
            real_raises=real_raises,
            offload_is_noop=pa.offload_deepspeed_states(object()) is None,  # DeepSpeed's would assert FusedAdam
            cpu_sleep_mode_available=__import__("vllm.platforms.cpu").platforms.cpu.CpuPlatform().is_sleep_mode_available(),
        )))
    """, MAPPA_CPU_MODE="1")
    f = facts_of(proc)
    assert f["flash_attn_installed"] is False  # the point: the import works without the package
    assert f["patches"] == ["cpu_device", "hybrid_engine"]
    assert f["offload_is_noop"] is True and f["cpu_sleep_mode_available"] is True
    assert f["ring_attn_patches"] == ["flash_attn_stub", "cpu_device"]
    # Inside the patched module, CUDA device calls answer with the CPU.
    assert f["current_device"] == "cpu"
    assert f["cuda0"] == "cpu" and f["cuda_plain"] == "cpu" and f["cpu"] == "cpu"
    assert f["module_torch_is_real"] is False and f["view_tensor_is_torch_tensor"] is True
    assert f["stateless_is_gloo"] is True
    assert f["barrier_is_patched"] is True
    assert f["unpad_is_stub"] is True
    # The stand-in flash_attn was removed after ring_attn_utils executed.
    assert f["flash_attn_modules"] == []
    # The real torch is untouched.
    assert f["real_current_device_same"] is True and f["real_device_same"] is True
    assert f["real_current_device_module"] == "torch.cuda"
    assert f["real_cuda0_type"] == "cuda"
    if not f["cuda_available"]:
        assert f["real_raises"] is not None


def test_cpu_mode_off_leaves_openrlhf_untouched():
    # MAPPA_CPU_MODE=0 forces the decision a CUDA build of torch makes by itself; on this
    # CPU-only machine forcing it is the only way to see that path.
    proc = run_child("""
        import importlib, json, sys
        import torch
        from openrlhf_mappa.compat import WATCHED

        modules = {}
        for name in WATCHED:
            if not name.startswith("openrlhf."):
                continue
            try:
                m = importlib.import_module(name)
            except ImportError as e:
                modules[name] = dict(error=type(e).__name__, missing=e.name, message=str(e))
            else:
                modules[name] = dict(patches=m.__mappa_cpu_patches__, has_torch=hasattr(m, "torch"),
                                     torch_is_real=getattr(m, "torch", torch) is torch)
        du = sys.modules["openrlhf.utils.distributed_util"]
        print("FACTS " + json.dumps(dict(
            modules=modules,
            stateless_module=du.stateless_init_process_group.__module__,
            barrier_module=du.torch_dist_barrier_and_cuda_sync.__module__,
            flash_attn_modules=sorted(n for n in sys.modules if n.split(".")[0] == "flash_attn"),
        )))
    """, MAPPA_CPU_MODE="0")
    f = facts_of(proc)
    modules = f["modules"]
    # Every module imports without flash-attn, on GPUs too (as README promises for --ds.attn_implementation sdpa): the
    # launcher and ppo_actor reach ring_attn_utils, which alone gets a patch, the lazy flash-attn import (upstream
    # openrlhf fails there on ModuleNotFoundError: flash_attn). No stand-in flash_attn is left behind.
    assert [name for name, m in modules.items() if "error" in m] == []
    assert f["flash_attn_modules"] == []
    assert modules["openrlhf.trainer.ppo_utils.replay_buffer"]["has_torch"] is True
    for name, m in modules.items():
        assert m["patches"] == (["flash_attn_stub"] if name == "openrlhf.models.ring_attn_utils" else []), name
        assert m["torch_is_real"] is True, name
    assert f["stateless_module"] == "openrlhf.utils.distributed_util"
    assert f["barrier_module"] == "openrlhf.utils.distributed_util"


RAY_PROBE = """
    import json, os
    import ray
    ray.init(num_cpus=1, include_dashboard=False{extra})
    try:
        facts = dict(gpus=ray.cluster_resources().get("GPU", 0), patches=ray.__mappa_cpu_patches__,
                     kv_cache=os.environ.get("VLLM_CPU_KVCACHE_SPACE"))
    finally:
        ray.shutdown()
    print("FACTS " + json.dumps(facts))
"""


@pytest.mark.e2e  # starts Ray (tests/README.md: every such test is e2e)
def test_cpu_mode_off_ray_init_adds_no_gpus():
    f = facts_of(run_child(RAY_PROBE.format(extra=""), MAPPA_CPU_MODE="0", MAPPA_CPU_NUM_GPUS="3"))
    assert f["patches"] == ["ray_logical_gpus"]  # the wrapper is there (lazy) but passes through
    assert f["gpus"] == 0
    assert f["kv_cache"] is None


@pytest.mark.e2e  # starts Ray (tests/README.md: every such test is e2e)
def test_cpu_mode_on_ray_init_gets_logical_gpus():
    f = facts_of(run_child(RAY_PROBE.format(extra=""), MAPPA_CPU_MODE="1", MAPPA_CPU_NUM_GPUS="3"))
    assert f["gpus"] == 3.0
    assert f["kv_cache"] == "1"


@pytest.mark.e2e  # starts Ray (tests/README.md: every such test is e2e)
def test_cpu_mode_on_ray_init_keeps_explicit_num_gpus():
    f = facts_of(run_child(RAY_PROBE.format(extra=", num_gpus=1"), MAPPA_CPU_MODE="1", MAPPA_CPU_NUM_GPUS="3"))
    assert f["gpus"] == 1.0


@pytest.mark.parametrize("address, knob, expected", [
    (None, "0", {"include_dashboard": False}),  # a new local CPU cluster, the tests' setting: no dashboard
    (None, None, {}),  # unset: Ray's own default (a dashboard)
    (None, "1", {}),
    ("127.0.0.1:6379", "0", None),  # connecting to a running cluster: untouched
])
def test_dashboard_knob_applies_to_a_new_local_cpu_cluster_only(monkeypatch, address, knob, expected):
    # ray.init itself is stood in for by a recorder (what the wrapper passes is the point; no cluster starts).
    import types

    from openrlhf_mappa import compat
    from openrlhf_mappa.patches import ray_logical_gpus

    monkeypatch.setattr(compat, "_cpu_mode", True)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("MAPPA_CPU_NUM_GPUS", "2")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    if knob is None:
        monkeypatch.delenv("MAPPA_CPU_RAY_DASHBOARD", raising=False)
    else:
        monkeypatch.setenv("MAPPA_CPU_RAY_DASHBOARD", knob)
    calls = []
    fake_ray = types.SimpleNamespace(init=lambda *args, **kwargs: calls.append(kwargs))
    ray_logical_gpus.apply(fake_ray)
    # As if no `ray start` cluster were running on this machine.
    monkeypatch.setattr("ray._private.services.canonicalize_bootstrap_address", lambda a: a)
    fake_ray.init(**({"address": address} if address else {}))
    (kwargs,) = calls
    dashboard = {k: v for k, v in kwargs.items() if k == "include_dashboard"}
    if expected is None:
        assert kwargs == {"address": address}
    else:
        assert dashboard == expected and kwargs["num_gpus"] == 2


# The decision on a GPU cluster. The one thing mocked in these two tests: a CUDA build of torch (and whether
# it sees a device), which cannot exist on this CPU-only machine. `torch.version.cuda` / `.hip` and
# `torch.cuda.is_available` are set in the child before anything asks for the decision.
SIMULATED_BUILD = """
        import torch
        torch.version.cuda, torch.version.hip = {cuda!r}, {hip!r}
        torch.cuda.is_available = lambda: {device}
"""


@pytest.mark.parametrize("cuda, hip, device, forced, expected", [
    ("12.8", None, False, None, False),  # a `ray job submit` driver on a GPU cluster: CUDA build, no device
    ("12.8", None, True, None, False),  # a GPU worker
    (None, "6.4", False, None, False),  # a ROCm build
    ("12.8", None, False, "1", True),  # forced on
    (None, None, False, None, True),  # a CPU-only build (this machine, unmocked)
])  # fmt: skip
def test_cpu_mode_follows_the_torch_build_not_the_visible_devices(cuda, hip, device, forced, expected):
    code = SIMULATED_BUILD.format(cuda=cuda, hip=hip, device=device) + """
        import json
        from openrlhf_mappa.compat import cpu_mode
        import openrlhf.utils.distributed_util as du
        print("FACTS " + json.dumps(dict(cpu_mode=cpu_mode(), patches=du.__mappa_cpu_patches__,
                                         stateless_module=du.stateless_init_process_group.__module__)))
    """
    f = facts_of(run_child(code, **({"MAPPA_CPU_MODE": forced} if forced else {})))
    assert f["cpu_mode"] is expected
    if expected:
        assert f["patches"] == ["cpu_device", "gloo_weight_sync"]
    else:
        assert f["patches"] == [] and f["stateless_module"] == "openrlhf.utils.distributed_util"


def test_patched_class_pickled_by_ray_refuses_to_load_in_a_cuda_process(tmp_path):
    # A @ray.remote class is pickled by value (the module attribute is Ray's wrapper, not the class), so
    # its methods' globals travel too: in a patched process, openrlhf's `torch` is cpu_device's view.
    blob = tmp_path / "actor_class.pkl"
    facts_of(run_child(f"""
        import json
        from ray._common.serialization import pickle_dumps  # what Ray uses to export an actor class
        from openrlhf.trainer.ray.ppo_actor import PolicyModelActor
        import openrlhf.trainer.ray.ppo_actor as pa
        open({str(blob)!r}, "wb").write(pickle_dumps(PolicyModelActor.__ray_metadata__.modified_class, "x"))
        print("FACTS " + json.dumps(dict(patches=pa.__mappa_cpu_patches__)))
    """))
    assert b"openrlhf_mappa.patches.cpu_device" in blob.read_bytes()  # the patch travels with the class

    # A GPU worker has flash-attn, which cannot be built here: an empty stand-in package with the names
    # openrlhf imports (the second mocked thing) lets openrlhf's modules load, unpatched, as they would there.
    fake = tmp_path / "site" / "flash_attn"
    (fake / "utils").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "bert_padding.py").write_text("index_first_axis = pad_input = rearrange = unpad_input = None\n")
    (fake / "utils" / "__init__.py").write_text("")
    (fake / "utils" / "distributed.py").write_text("all_gather = None\n")
    # bitsandbytes (which peft imports when present) would load its CUDA kernels for the simulated build, and this
    # torch has none: hidden, as if not installed (the third).
    proc = run_child(SIMULATED_BUILD.format(cuda="12.8", hip=None, device=True) + f"""
        import sys
        sys.modules["bitsandbytes"] = None
        import ray.cloudpickle
        ray.cloudpickle.loads(open({str(blob)!r}, "rb").read())
        print("LOADED")
    """, PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path / "site"), os.environ.get("PYTHONPATH")])))
    assert proc.returncode != 0 and "LOADED" not in proc.stdout
    assert "RuntimeError: openrlhf_mappa: openrlhf_mappa.patches.cpu_device (a CPU-mode patch) was loaded in a " \
           "process that is not in CPU mode (torch built with CUDA 12.8" in proc.stderr, proc.stderr[-3000:]
    assert "Run the driver with the same CUDA build of torch as the workers, or with MAPPA_CPU_MODE=0" in proc.stderr


# ── 2. version refusal ──


def test_check_version_refuses_other_release():
    with pytest.raises(PatchVersionError) as info:
        check_version("cpu_device", "openrlhf", ("0.10.0",))
    message = str(info.value)
    assert "'cpu_device'" in message
    assert "openrlhf 0.10.0" in message  # what the patch was written for
    assert "openrlhf 0.11.2 is installed" in message
    assert "make install" in message and "patches/cpu_device.py" in message and "MAPPA_CPU_MODE=0" in message


def test_check_version_accepts_real_fits():
    check_version("cpu_device", "openrlhf", cpu_device.FITS)
    check_version("cpu_device", ("not-a-real-dist-xyz", "openrlhf"), cpu_device.FITS)  # first installed wins


def test_check_version_reports_missing_distribution():
    with pytest.raises(PatchVersionError, match=r"not-a-real-dist-xyz \(not installed\) is installed"):
        check_version("some_patch", "not-a-real-dist-xyz", ("1.0",))


def test_patch_for_other_release_refuses_the_import():
    proc = run_child("""
        import openrlhf_mappa.patches.cpu_device as cpu_device
        cpu_device.FITS = ("0.10.0",)
        import openrlhf.trainer.ray.ppo_actor
        print("imported")
    """, MAPPA_CPU_MODE="1")
    assert proc.returncode != 0
    assert "imported" not in proc.stdout
    assert "PatchVersionError" in proc.stderr
    assert "'cpu_device' was written for openrlhf 0.10.0, but openrlhf 0.11.2 is installed" in proc.stderr


# ── 3. GlooBroadcastGroup ──

GLOO_RANK = """
    import sys
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    from openrlhf_mappa.patches.gloo_weight_sync import GlooBroadcastGroup

    rank, own_port, sync_port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    # This process already owns a default group (as DeepSpeed / vLLM do), of world size 1.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{own_port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    group = GlooBroadcastGroup("127.0.0.1", sync_port, rank, 2, timeout_s=60)
    if rank == 0:
        g = torch.Generator().manual_seed(1234)
        bf16 = torch.randn(4, 8, generator=g).to(torch.bfloat16)
        fp32 = torch.randn(3, 5, generator=g)
    else:
        bf16 = torch.zeros(4, 8, dtype=torch.bfloat16)
        fp32 = torch.zeros(3, 5)
    group.broadcast(bf16, src=0)
    group.broadcast(fp32, src=0, stream=None)
    assert dist.get_world_size() == 1  # the default group is unchanged
    torch.save({"bf16": bf16, "fp32": fp32}, out)
    dist.destroy_process_group()
"""


def test_gloo_broadcast_group_beside_an_existing_default_group(tmp_path):
    sync_port = free_port()
    procs = []
    for rank in (0, 1):
        cmd = [sys.executable, "-c", textwrap.dedent(GLOO_RANK), str(rank), str(free_port()), str(sync_port),
               str(tmp_path / f"rank{rank}.pt")]
        procs.append(subprocess.Popen(cmd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        results.append((p.returncode, err))
    for rank, (rc, err) in enumerate(results):
        assert rc == 0, f"rank {rank} failed:\n{err[-4000:]}"
    sent, received = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert sent["bf16"].dtype == received["bf16"].dtype == torch.bfloat16
    assert sent["fp32"].dtype == received["fp32"].dtype == torch.float32
    assert sent["bf16"].abs().sum() > 0 and sent["fp32"].abs().sum() > 0  # rank 1 started from zeros
    assert torch.equal(received["bf16"], sent["bf16"])
    assert torch.equal(received["fp32"], sent["fp32"])


# ── 4. flash-attn stand-ins ──


def test_unpad_pad_round_trip_and_seqlens():
    # Row 0: right-padded, 3 tokens; row 1: left-padded (as openrlhf pads prompts), 2 tokens; row 2: full, 5.
    mask = torch.tensor([[1, 1, 1, 0, 0],
                         [0, 0, 0, 1, 1],
                         [1, 1, 1, 1, 1]])
    hidden = torch.arange(3 * 5 * 4, dtype=torch.float32).reshape(3, 5, 4) + 1  # no zero entries
    tokens, indices, cu_seqlens, max_seqlen, used_seqlens = unpad_input(hidden, mask)

    assert indices.tolist() == [0, 1, 2, 8, 9, 10, 11, 12, 13, 14]  # flat positions b * 5 + s
    assert cu_seqlens.tolist() == [0, 3, 5, 10] and cu_seqlens.dtype == torch.int32
    assert max_seqlen == 5 and isinstance(max_seqlen, int)
    assert used_seqlens.tolist() == [3, 2, 5]
    assert torch.equal(tokens, hidden[mask.bool()])

    padded = pad_input(tokens, indices, 3, 5)
    assert padded.shape == hidden.shape
    assert torch.equal(padded, hidden * mask[..., None])  # real tokens back in place, padding zero


def test_unpad_with_unused_mask_and_index_first_axis():
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    unused = torch.tensor([[0, 0, 1, 0], [0, 1, 1, 0]])
    hidden = torch.randn(2, 4, 3)
    tokens, indices, cu_seqlens, max_seqlen, used_seqlens = unpad_input(hidden, mask, unused)
    assert indices.tolist() == [0, 1, 2, 4, 5, 6]
    assert cu_seqlens.tolist() == [0, 3, 6] and max_seqlen == 3
    assert used_seqlens.tolist() == [2, 1]
    assert torch.equal(tokens, index_first_axis(hidden.reshape(8, 3), indices))
    assert torch.equal(tokens, hidden.reshape(8, 3)[[0, 1, 2, 4, 5, 6]])



RING_RANK = """
    import json, os, sys
    import torch, torch.distributed as dist
    rank, port, model_dir, stand_ins = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import openrlhf_mappa.compat
    from openrlhf.models import Actor
    from openrlhf.models.ring_attn_utils import set_ring_attn_group
    sys.path.insert(0, stand_ins)
    import ring_flash_attn

    torch.manual_seed(0)
    seqs = torch.randint(3, 300, (3, 11))
    mask = torch.ones_like(seqs)
    mask[0, :4] = mask[2, :2] = 0  # left-padded prompts, as OpenRLHF pads them
    out = {}
    for ring in (False, True):  # a plain padded forward first (no collective), then the ring of both ranks
        actor = Actor(model_dir, attn_implementation="sdpa", packing_samples=ring)
        actor.model.float()
        if ring:  # what OpenRLHF's strategy does for --ds.ring_attn_size 2 (setup_ring_attn)
            group = dist.new_group([0, 1])
            set_ring_attn_group(group)
            ring_flash_attn.substitute_hf_flash_attn(group, 1)
        logp = actor(seqs, torch.ones(3, 5), attention_mask=mask, ring_attn_group=group if ring else None)
        logp.sum().backward()
        grad = actor.model.model.embed_tokens.weight.grad
        if ring:  # each rank's gradient covers its half of the tokens, counted once per rank of the ring (as
            dist.all_reduce(grad, group=group)  # flash-attn's reduce-scatter does; DeepSpeed averages it over them)
            grad /= 2
        out[ring] = (logp.detach(), grad)
    print("FACTS " + json.dumps({"logp": (out[True][0] - out[False][0]).abs().max().item(),
                                 "grad": (out[True][1] - out[False][1]).abs().max().item(),
                                 "grad_size": out[False][1].abs().max().item()}))
"""


def test_ring_attention_on_two_ranks_matches_one_forward(tiny_model):
    # OpenRLHF's ring path for real on 2 gloo ranks: its packing, its split of the packed tokens over the ring, its
    # gather of the log-probs (flash_attn_stub's all_gather, differentiable as flash-attn's is), with only the
    # attention kernel a stand-in (tests/stand_ins/ring_flash_attn.py: flash-attn needs CUDA). Log-probs and gradients
    # equal a plain padded forward's (5e-7 and 3e-6 measured); with the kernel attending to its own rank's tokens only,
    # or a gather without a gradient, they would not.
    port, stand_ins = str(free_port()), os.path.join(os.path.dirname(__file__), "stand_ins")
    cmd = lambda rank: [sys.executable, "-c", textwrap.dedent(RING_RANK), str(rank), port, tiny_model, stand_ins]
    procs = [subprocess.Popen(cmd(r), env=child_env(MAPPA_CPU_MODE="1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in (0, 1)]  # fmt: skip
    try:
        outs = [p.communicate(timeout=CHILD_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs):
        facts = facts_of(subprocess.CompletedProcess(p.args, p.returncode, out, err))
        assert facts["logp"] < 1e-5 and facts["grad"] < 1e-4 * facts["grad_size"], facts


# ── 5. the placement check at launch ──
# In a child process like the activation tests: a Ray driver left in the pytest process can crash it at exit.


@pytest.mark.e2e  # starts Ray (tests/README.md: every such test is e2e)
def test_placement_check_and_pinned_groups_on_a_real_two_node_cluster(tmp_path):
    # Two nodes of 1 logical GPU each, as a user starts them (`ray start --head`, then `ray start --address` on the
    # other node; here both on 127.0.0.1). Two agents x (actor + engine) need 4 GPUs: refused. One shared policy
    # needs 2, an exact fit, but no node has room for both its actor and its engine: the plan puts them on
    # different nodes and says the weight sync crosses them, and the launch's placement groups follow the plan.
    # On CPU no GPU memory is known, so the launch checks the count only (the memory model: test_placement.py).
    topology = {"name": "two", "env": "mathchat", "coach_template": "{agent_output} PROCESS_SCORE",
                "agents": [{"name": n, "model": "m", "role": n, "prompt": "{task}"} for n in ("a", "b")]}
    topology["agents"][1]["max_new_tokens"] = 64  # a per-agent value that wins over the flag: printed
    (tmp_path / "t.yaml").write_text(json.dumps(topology))  # YAML is a superset of JSON
    flags = ["--mappa.topology", str(tmp_path / "t.yaml"), "--actor.num_gpus_per_node", "1", "--vllm.num_engines", "1",
             "--algo.kl.init_coef", "0", "--rollout.batch_size", "2", "--train.batch_size", "2",
             "--ds.attn_implementation", "sdpa"]  # as every CPU run: flash-attn's kernels are on no node here
    ray_cli, port = os.path.join(os.path.dirname(sys.executable), "ray"), free_port()
    common = ["--block", "--num-gpus", "1", "--num-cpus", "2", f"--dashboard-agent-listen-port={free_port()}",
              "--disable-usage-stats"]
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay within 107 bytes
    head = [ray_cli, "start", "--head", f"--port={port}", "--include-dashboard=false", "--temp-dir", f"{temp}/0", *common]
    worker = [ray_cli, "start", f"--address=127.0.0.1:{port}", "--temp-dir", f"{temp}/1", *common]
    try:
        with training(head, tmp_path / "head", env=child_env()), training(worker, tmp_path / "worker", env=child_env()):
            proc = run_child(f"""
                import io, json, time, ray
                from ray.util.placement_group import placement_group_table
                from openrlhf_mappa.cli.train_mappa_ray import parse_args
                from openrlhf_mappa.team import load_topology
                from openrlhf_mappa.console import console
                from openrlhf_mappa import placement
                from openrlhf_mappa.launch import check_placement, gpu_nodes, on_each_node, pinned_groups
                ray.init(address="127.0.0.1:{port}")
                deadline = time.time() + 120
                while len(gpu_nodes()) < 2 and time.time() < deadline:  # the worker node joins
                    time.sleep(0.5)
                facts = {{"gpus": ray.cluster_resources().get("GPU"), "nodes": [n for n, _ in gpu_nodes()]}}
                args = parse_args({flags!r})
                try:
                    check_placement(args, load_topology(args.mappa.topology))
                except SystemExit as e:
                    facts["refused"] = str(e)
                args = parse_args({flags!r} + ["--mappa.shared_policy"])
                console.out = out = io.StringIO()  # the run's own output goes to the terminal's stream, console.console
                plan, nodes = check_placement(args, load_topology(args.mappa.topology))
                facts["printed"], facts["host"] = out.getvalue(), args.mappa.host_memory_gib
                groups = pinned_groups(plan, nodes)
                # what the launch reads on each node when the GPUs' memory is known
                facts["host_read"] = on_each_node(placement.host_memory_gib, nodes)
                ray.get([pg.ready() for pg in groups.values()], timeout=60)
                facts["bundles"] = {{key: sorted(placement_group_table(pg)["bundles_to_node_id"].values())
                                    for key, pg in groups.items()}}
                ray.shutdown()
                print("FACTS " + json.dumps(facts))
            """)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    facts = facts_of(proc)
    assert facts["gpus"] == 2.0 and len(facts["nodes"]) == 2
    message = facts["refused"]
    assert "not enough GPUs" in message and "need 4 GPUs" in message and "has 2" in message
    assert "a/actor: 1" in message and "a/vllm: 1" in message and "b/actor: 1" in message and "b/vllm: 1" in message
    assert "What to change, in this order:\n  1. a cluster of 4 GPUs" in message and "MAPPA_CPU_NUM_GPUS" in message
    printed = facts["printed"]
    assert "placement plan for 2 GPUs (GPU memory not known here" in printed
    assert "total: 2 GPUs of the cluster's 2 on 2 nodes" in printed
    assert "1  GPUs: a/actor, on node 0" in printed and "1  GPUs: a/vllm, on node 1" in printed
    assert "across nodes: a: actor on node 0, vLLM engines on node 1: its weight sync crosses nodes" in printed
    assert f"node 0: Ray node {facts['nodes'][0]}, 1 GPUs" in printed and f"node 1: Ray node {facts['nodes'][1]}" in printed
    assert "agent 'b': max_new_tokens 64 from the topology, not --rollout.max_new_tokens " in printed
    assert "agent 'a':" not in printed
    # Each node's host memory, read on that node (both are this machine here); not read without a memory plan.
    assert facts["host"] is None
    assert facts["host_read"] == [pytest.approx(placement.host_memory_gib(), rel=1e-6)] * 2
    # Each placement group's bundle on the node the plan names, not wherever Ray's PACK would put it.
    assert facts["bundles"] == {"a/actor": [facts["nodes"][0]], "a/vllm": [facts["nodes"][1]]}


# ── 5. ZeRO-3 gathers on gloo ──

ZERO3_RANK = """
    import glob, json, os, sys
    import deepspeed, torch
    import torch.distributed as tdist
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    rank, port, model_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)

    # gloo runs async work on a thread pool: a gather nobody waits for may finish after the code that follows its
    # launch. Made certain here: an async gather's data lands when it is waited for, or else at the next broadcast,
    # after whatever ran in between (in the race seen: rank 0's copy of the checkpoint into the weight, broadcast
    # by GatheredParameters' exit).
    pending = []

    class Landing:
        def __init__(self, land):
            self.land, self.done = land, False
            pending.append(self)

        def wait(self, *args, **kwargs):
            if not self.done:
                self.done = True
                pending.remove(self)
                self.land()
            return True

        def is_completed(self):
            return self.done

    def land_pending():
        while pending:
            pending[0].wait()

    into, to_list, broadcast = tdist.all_gather_into_tensor, tdist.all_gather, tdist.broadcast  # DeepSpeed binds some at init

    def gather_into(output_tensor, input_tensor, group=None, async_op=False):
        if not async_op:
            return into(output_tensor, input_tensor, group=group)
        scratch = torch.empty_like(output_tensor)
        into(scratch, input_tensor, group=group)
        return Landing(lambda: output_tensor.copy_(scratch))

    def gather_list(tensor_list, tensor, group=None, async_op=False):
        if not async_op:
            return to_list(tensor_list, tensor, group=group)
        scratch = [torch.empty_like(t) for t in tensor_list]
        to_list(scratch, tensor, group=group)
        return Landing(lambda: [t.copy_(x) for t, x in zip(tensor_list, scratch)])

    def broadcast_after(tensor, src, group=None, async_op=False):
        land_pending()
        return broadcast(tensor, src, group=group, async_op=async_op)

    tdist.all_gather_into_tensor, tdist.all_gather, tdist.broadcast = gather_into, gather_list, broadcast_after
    deepspeed.init_distributed("gloo")
    from openrlhf.utils.deepspeed.deepspeed_utils import get_train_ds_config
    import deepspeed.runtime.zero.partition_parameters as zero3

    config = get_train_ds_config(offload=False, adam_offload=False, stage=3, zpg=1)  # as OpenRLHF's actor builds it
    keep = HfDeepSpeedConfig({**config, "train_micro_batch_size_per_gpu": 1})  # ZeRO-3 loading while alive
    saved = {k: v for f in glob.glob(model_dir + "/*.safetensors") for k, v in load_file(f).items()}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    wrong = []
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            if not torch.equal(p.data, saved[name].to(p.dtype)):
                wrong.append(f"{name} (max |diff| {(p.data.float() - saved[name].float()).abs().max():.3g})")
    patches = getattr(zero3, "__mappa_cpu_patches__", [])
    print("FACTS " + json.dumps({"wrong": wrong, "params": len(saved), "patches": patches}))
"""


def test_zero3_from_pretrained_on_gloo_loads_the_checkpoint(tiny_model):
    # Without patches/zero3_gloo_allgather.py, one load in two to four put uninitialised values (up to 1e38, or
    # NaN) in a weight: DeepSpeed waited only on the last of a layer's gathers, and gloo may finish an earlier one
    # after it. Here a gather's data lands only when waited for or at the next collective (ZERO3_RANK's Landing),
    # so without the patch every load of a layer's weight and bias goes wrong: one load says it, each time.
    port = str(free_port())
    cmd = lambda rank: [sys.executable, "-c", textwrap.dedent(ZERO3_RANK), str(rank), port, tiny_model]
    procs = [subprocess.Popen(cmd(r), env=child_env(MAPPA_CPU_MODE="1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in (0, 1)]  # fmt: skip
    try:
        outs = [p.communicate(timeout=CHILD_TIMEOUT_S * 2) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs):
        facts = facts_of(subprocess.CompletedProcess(p.args, p.returncode, out, err))
        assert facts["patches"] == ["zero3_gloo_allgather"]  # the patch was applied to DeepSpeed's ZeRO-3 module
        assert facts["params"] > 0 and facts["wrong"] == [], facts["wrong"]
