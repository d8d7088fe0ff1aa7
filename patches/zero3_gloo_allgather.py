"""Patch `zero3_gloo_allgather`: ZeRO-3 parameter gathers complete before their data is used, on gloo.

Why: `Init._allgather_params_coalesced` (used by `GatheredParameters` over several parameters, e.g. a
layer's weight and bias while `from_pretrained` loads a checkpoint) launches one async all-gather per
parameter and waits only on the last, relying on NCCL's in-order stream. gloo runs async work on a thread
pool, out of order: an earlier gather can land after rank 0 has copied the checkpoint in, overwriting a
weight with the uninitialised partitions (values up to 1e38). That model then gives NaN log-probs on every
rank, in about one start of two on a 2-rank CPU run. Upstream candidate (DeepSpeed): wait on every handle.

How: in that module only, `dist.all_gather_into_tensor` / `dist.all_gather` wait for an async gather before
returning its (finished) work handle. Gathers stay in the same order on every rank, so nothing can deadlock.
"""

from openrlhf_mappa.compat import refuse_outside_cpu_mode

refuse_outside_cpu_mode(__name__)

FITS = ("0.19.6",)


def _waited(gather):
    def call(*args, **kwargs):
        work = gather(*args, **kwargs)
        if kwargs.get("async_op") and work is not None:
            work.wait()
        return work

    return call


def apply(module):
    from openrlhf_mappa.compat import check_version

    check_version("zero3_gloo_allgather", "deepspeed", FITS)
    module.dist = _WaitingComm(module.dist)


class _WaitingComm:
    """deepspeed.comm as that module sees it: its own, except that the gathers it launches are waited for."""

    def __init__(self, comm):
        self._comm = comm
        self.all_gather_into_tensor = _waited(comm.all_gather_into_tensor)
        self.all_gather = _waited(comm.all_gather)

    def __getattr__(self, name):
        return getattr(self._comm, name)
