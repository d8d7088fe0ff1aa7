"""Patch `hybrid_engine`: let OpenRLHF's hybrid engine (colocation, vLLM and DeepSpeed sleep) run on CPU, and
log its calls.

Why: on a GPU, sleep frees memory for the model that shares the GPU: a vLLM engine drops its KV cache and
moves its weights to CPU memory (--vllm.enable_sleep); a DeepSpeed actor moves its optimizer states and
gradients (--ds.enable_sleep). On CPU there is nothing to free. vLLM's CPU worker already answers sleep and
wake_up with a no-op, but vLLM's config check refuses sleep mode on CPU; DeepSpeed's offload_states asserts
its CUDA-only FusedAdam; and colocated, openrlhf syncs weights through CUDA IPC handles (with
--vllm.sync_backend nccl, the default). Upstream candidates: vLLM's CpuPlatform reporting sleep mode as
available (a no-op), openrlhf skipping the offload when the states already live in CPU memory and choosing IPC
only on CUDA.

How: CpuPlatform.is_sleep_mode_available answers True; openrlhf's offload/reload of an actor's DeepSpeed
states are no-ops; an actor's sync backend is gloo (the broadcast over patches/gloo_weight_sync.py, as without
colocation). Since nothing on CPU would fail if these calls came in the wrong order, with MAPPA_CALL_LOG set
each engine's start-up (`__init__`: vLLM's profiling) / sleep / wake_up / generate and each actor's offload /
reload / training appends a JSON line to that file as it begins and another as it ends (pid, a call id, which
model; the end line its start and end time, and a training's the actor's plan of micro-batches under token
budgets), from the process that runs it. Appended by every process to one file, the lines' order is the order
things happened in, whatever each process's clock says: a test checks from it the order a GPU needs
(tests/test_resume_e2e.py) and which calls were in flight together, and that the actor planned to train every
row it was given (tests/test_debate_e2e.py).
"""

import functools
import itertools
import json
import operator
import os
import time

_calls = itertools.count()  # this process's call ids

from openrlhf_mappa.compat import refuse_outside_cpu_mode

refuse_outside_cpu_mode(__name__)

FITS = ("0.11.2",)


def log_call(event: str, model: str, call: int, **extra) -> None:
    path = os.environ.get("MAPPA_CALL_LOG")
    if path:  # one short line per write, appended: lines from many processes never interleave
        line = json.dumps({"event": event, "model": model, "pid": os.getpid(), "call": call, **extra})
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def logged_async(method, event: str):
    @functools.wraps(method)
    async def wrapper(self, *args, **kwargs):
        call, t0 = next(_calls), time.time()
        # __init__ is given it; it keeps it in self.kwargs
        model = kwargs.get("model") or self.kwargs["model"]
        log_call(event, model, call, begin=True)
        out = await method(self, *args, **kwargs)
        log_call(event, model, call, t0=t0, t1=time.time(), tags=kwargs.get("tags"))
        return out

    return wrapper


def logged(method, event: str, model_of, extra=lambda self: {}):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        call, t0 = next(_calls), time.time()
        log_call(event, model_of(self), call, begin=True)
        out = method(self, *args, **kwargs)
        log_call(event, model_of(self), call, t0=t0, t1=time.time(), **extra(self))
        return out

    return wrapper


def apply(module):
    if module.__name__ == "vllm.platforms.cpu":
        module.CpuPlatform.is_sleep_mode_available = lambda self: True
        return
    from openrlhf_mappa.compat import check_version

    check_version("hybrid_engine", "openrlhf", FITS)
    if module.__name__ == "openrlhf.trainer.ray.vllm_engine":
        engine = module.RolloutRayActor.__ray_metadata__.modified_class
        for name in ("__init__", "sleep", "wake_up", "generate"):
            setattr(engine, name, logged_async(getattr(engine, name), name))
        return
    # openrlhf.trainer.ray.ppo_actor: DeepSpeed's states stay where they are (CPU memory); the calls are
    # logged.
    model = operator.attrgetter("strategy.args.actor.model_name_or_path")
    actor = module.PolicyModelActor.__ray_metadata__.modified_class
    actor.offload_states = logged(lambda self: None, "offload", model)
    actor.reload_states = logged(lambda self: None, "reload", model)
    # Token budgets: the train call's end line carries the actor's own plan, the rows of each micro-batch (by
    # their lengths) as upstream's setup_dynamic_batch split them and ppo_train then trained them, so that a
    # test can find every row of the agent's batch in it: an actor planning for fewer rows trains part of
    # them.
    setup = module.NaiveReplayBuffer.setup_dynamic_batch

    def planned(self, strategy):
        setup(self, strategy)
        self.plan = [[int(self.items[i].total_length) for i in mb] for mb in self.dynamic_indices]

    module.NaiveReplayBuffer.setup_dynamic_batch = planned
    actor.fit = logged(actor.fit, "train", model,
                       lambda self: {"plan": getattr(self.trainer.replay_buffer, "plan", None)})
    init = module.ActorPPOTrainer.__init__

    @functools.wraps(init)
    def gloo_sync_init(self, strategy, *args, **kwargs):
        strategy.args.vllm.sync_backend = "gloo"  # this actor's own copy of the args; CUDA IPC needs CUDA
        init(self, strategy, *args, **kwargs)

    module.ActorPPOTrainer.__init__ = gloo_sync_init
    # The offload at start-up (init_model_from_pretrained).
    module.offload_deepspeed_states = lambda *args, **kwargs: None
