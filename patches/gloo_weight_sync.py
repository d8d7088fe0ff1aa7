"""Patch `gloo_weight_sync`: DeepSpeed -> vLLM weight sync over a private gloo group.

Why: the sync group is vLLM's `PyNcclCommunicator`, which has no CPU path, and
`--vllm.sync_with_ray` with gloo fails ("the new group's world size should be less or equal to the
world size set by init_process_group") because the default group is already owned by DeepSpeed/vLLM.
A gloo process group built directly on its own TCPStore needs neither. Upstream candidate: honour
`--vllm.sync_backend gloo` in `stateless_init_process_group` and allocate the receive buffer on the
worker's own device instead of "cuda".

How: `stateless_init_process_group` returns a small object with the same `broadcast(tensor, src,
stream)` the sync code calls; `WorkerWrap.update_weight` receives into a CPU tensor. Each policy's sync
group has its own port, so several policies (MAPPA's agents) never share one.
"""

from datetime import timedelta

import torch

from openrlhf_mappa.compat import refuse_outside_cpu_mode

refuse_outside_cpu_mode(__name__)

FITS = ("0.11.2",)


class GlooBroadcastGroup:
    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 600.0):
        store = torch.distributed.TCPStore(
            host, port, world_size, is_master=(rank == 0), timeout=timedelta(seconds=timeout_s)
        )
        self.rank, self.world_size = rank, world_size
        self.pg = torch.distributed.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s))

    def broadcast(self, tensor, src=0, stream=None):
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([tensor], opts).wait()


def stateless_init_process_group(master_address, master_port, rank, world_size, device=None):
    return GlooBroadcastGroup(master_address, master_port, rank, world_size)


def update_weight(self, name, dtype, shape, empty_cache=False):
    weight = torch.empty(shape, dtype=dtype, device="cpu")
    if self._model_update_with_ray:
        import ray.util.collective as collective

        collective.broadcast(weight, 0, group_name=self._model_update_group)
    else:
        self._model_update_group.broadcast(weight, src=0)
    self.model_runner.model.load_weights(weights=[(name, weight)])


def apply(module):
    from openrlhf_mappa.compat import check_version

    check_version("gloo_weight_sync", "openrlhf", FITS)
    if module.__name__ == "openrlhf.utils.distributed_util":
        module.stateless_init_process_group = stateless_init_process_group
    else:
        module.WorkerWrap.update_weight = update_weight
