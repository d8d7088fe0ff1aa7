"""Patch `cpu_device`: map openrlhf's CUDA-only device calls to the CPU.

Why: about 70 call sites in openrlhf 0.11 assume CUDA (`torch.cuda.current_device()`,
`torch.cuda.set_device/synchronize/empty_cache/current_stream`, `torch.device(f"cuda:...")`,
`init_device_mesh("cuda", ...)`), so no actor can start on a CPU-only host. Upstream candidate: one
`get_accelerator_device()` helper (DeepSpeed already has `get_accelerator()`) used at those sites.

How: in each patched openrlhf module only, the module-global name `torch` is replaced by a thin view of
torch whose `cuda` namespace answers with the CPU device and no-ops, and whose `torch.device` maps
"cuda..." to "cpu". The real `torch` module and every other library are untouched.
"""

import torch

from openrlhf_mappa.compat import refuse_outside_cpu_mode

refuse_outside_cpu_mode(__name__)

FITS = ("0.11.2",)
CPU = torch.device("cpu")


def _device(spec=None, *args, **kwargs):
    if isinstance(spec, str) and spec.startswith("cuda"):
        return CPU
    return torch.device(spec, *args, **kwargs)


class _CpuCuda:
    """torch.cuda as openrlhf uses it, answered for a host without CUDA."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device():
        return CPU

    @staticmethod
    def set_device(*_args, **_kwargs):
        pass

    @staticmethod
    def synchronize(*_args, **_kwargs):
        pass

    @staticmethod
    def empty_cache():
        pass

    @staticmethod
    def current_stream(*_args, **_kwargs):
        return None


class _CpuTorch:
    """A view of torch for one module: everything is torch's own except `cuda` and `device`."""

    cuda = _CpuCuda()
    device = staticmethod(_device)

    def __getattr__(self, name):
        return getattr(torch, name)


_CPU_TORCH = _CpuTorch()


def _init_device_mesh(device_type, *args, **kwargs):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu" if device_type == "cuda" else device_type, *args, **kwargs)


def _barrier_only():
    torch.distributed.barrier()


def apply(module):
    from openrlhf_mappa.compat import check_version

    check_version("cpu_device", "openrlhf", FITS)
    if getattr(module, "torch", None) is torch:
        module.torch = _CPU_TORCH
    if hasattr(module, "init_device_mesh"):
        module.init_device_mesh = _init_device_mesh
    if module.__name__ == "openrlhf.utils.distributed_util":
        # This function imports torch locally, so the module-level view above cannot reach it.
        module.torch_dist_barrier_and_cuda_sync = _barrier_only
