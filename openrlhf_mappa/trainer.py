"""MAPPA trainer: each agent is its own policy with its own ZeRO-3 actor group, reference group and vLLM
engines (OpenRLHF's classes); one fit loop drives them all. A LoRA agent (topology `lora`) has no reference
group and shares its base model's engine pool, which serves its adapter (agent_trainer.py).

One step:  rollout (all episodes at once) -> coach verdicts -> per-action rewards -> per agent: OpenRLHF
Experiences (actor/ref log-probs, KL) -> token rewards, return-to-go, whitening (rewards.py) -> agent k's
experiences train agent k's actor only -> agent k's weights go to agent k's engines only.
"""

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import glob
import json
import os
import random
import shutil
import signal
import sys
import threading
import time
import types
from dataclasses import dataclass

import ray
import torch
from tqdm import tqdm

from openrlhf_mappa import placement, rewards
from openrlhf_mappa.coach.audit import BiasAudit, CoachFailure, check_failures, coach_step_metrics
from openrlhf_mappa.episode import Episode, read_jsonl
from openrlhf_mappa.evaluation import NoCoach, behaviour_metrics, evaluate, format_table, summarize
from openrlhf_mappa.placement import agent_args, trainee_specs
from openrlhf_mappa.resume import CHECKPOINT_MARKER
from openrlhf_mappa.rollout import AgentPolicy, rollout

# The user's terminal, where the run's own output goes: step lines, progress bars, evaluation tables and the
# watchdogs' messages to `err` (with tqdm.write, so they land above the bars). Without --mappa.verbose,
# train_mappa_ray sends the process's stdout and stderr (Ray's, vLLM's and DeepSpeed's output, and what Ray
# forwards from its workers) to a log file and points these at copies of the terminal's.
console = types.SimpleNamespace(out=sys.stdout, err=sys.stderr)


def step_line(step: int, total: int, metrics: dict, agents: list) -> str:
    """One step on one line, as OpenRLHF logs its steps: success rate, each agent's mean coach score, the
    agents' mean KL and policy loss, and the phase timings. A value missing that step is printed as '-'."""

    def num(v, spec):
        return "-" if v is None else format(v, spec)

    def mean(key):
        values = [metrics[f"agent/{a}/{key}"] for a in agents if metrics.get(f"agent/{a}/{key}") is not None]
        return sum(values) / len(values) if values else None

    coach = ", ".join(f"{a} {num(metrics.get(f'agent/{a}/coach_score'), '.2f')}" for a in agents)
    phases = ", ".join(f"{k} {num(metrics.get('time/' + k), '.1f')}s" for k in ("rollout", "experience", "train", "sync", "step"))
    return (f"[mappa] step {step}/{total} | success {num(metrics.get('outcome/success_rate'), '.3f')} | coach {coach} | "
            f"kl {num(mean('kl'), '.3g')} | loss {num(mean('policy_loss'), '.3g')} | {phases}")


def run_summary(run_dir: str) -> list:
    """The end of a run in a few lines, from its metrics.jsonl and eval.jsonl: steps and time, the success rate
    of the first and last 3 steps, each agent's coach score then and now, and every evaluation set's accuracy
    at its first and last evaluation."""
    metrics, evals = ([r for _, r in read_jsonl(path)] if os.path.exists(path) else []
                      for path in (os.path.join(run_dir, "metrics.jsonl"), os.path.join(run_dir, "eval.jsonl")))
    if not metrics:
        return ["[mappa] no step finished"]

    def mean(rows, key):
        values = [r[key] for r in rows if r.get(key) is not None]
        return f"{sum(values) / len(values):.3f}" if values else "-"

    first, last = metrics[:3], metrics[-3:]
    seconds = sum(r.get("time/step") or 0.0 for r in metrics)
    lines = [f"[mappa] {len(metrics)} steps ({seconds / 60:.1f} min of training steps); "
             f"success rate {mean(first, 'outcome/success_rate')} (first 3 steps) -> {mean(last, 'outcome/success_rate')} (last 3)"]
    agents = list(dict.fromkeys(k.split("/")[1] for r in metrics for k in r if k.startswith("agent/") and k.endswith("/coach_score")))
    if agents:
        scores = ", ".join(f"{a} {mean(first, f'agent/{a}/coach_score')} -> {mean(last, f'agent/{a}/coach_score')}" for a in agents)
        lines.append(f"[mappa] coach score (first 3 -> last 3 steps): {scores}")
    for dataset in dict.fromkeys(r.get("dataset") for r in evals):
        rows = [r for r in evals if r.get("dataset") == dataset]
        a, b = rows[0], rows[-1]
        lines.append(f"[mappa] evaluation {dataset}: accuracy {mean([a], 'accuracy')} (step {a['step']}) -> "
                     f"{mean([b], 'accuracy')} (step {b['step']})")
    return lines


class RunStopped(RuntimeError):
    """The run cannot usefully go on: too many of a step's episodes failed in the environment, or no agent trained
    for --mappa.max_untrained_steps steps in a row. The message says why and what to change."""


def check_placement(args, topology) -> None:
    """Before any actor exists: the plan (placement.py) against the Ray cluster's GPUs, logical or real, and
    their memory where known (the lower of --mappa.gpu_memory_gib and what this process's GPU reports) and the
    host memory of a node (--mappa.host_memory_gib, else this one's). Printed when it fits; refused,
    with the smallest change that would fit, when not. Ray itself would wait forever, silently, for GPUs
    that never come."""
    gpus = int(ray.cluster_resources().get("GPU", 0))
    # The card's memory as the CUDA driver reports it where this process sees a GPU (an "80 GB" card: 79.6 GiB),
    # the flag's where it is lower or none is seen; host memory and node sizes as this node and Ray see them.
    given, seen = args.mappa.gpu_memory_gib, placement.detect_gpus()[1]
    gib = args.mappa.gpu_memory_gib = min(g for g in (given, seen) if g) if given or seen else None
    args.mappa.host_memory_gib = args.mappa.host_memory_gib or placement.host_memory_gib()
    args.mappa.gpus_per_node = args.mappa.gpus_per_node or int(max(
        [n["Resources"].get("GPU", 0) for n in ray.nodes() if n["Alive"]] + [1]))
    try:
        plan = placement.check(args, topology, gpus, gib)
    except ValueError as e:
        raise SystemExit(f"[mappa] {e}\n(On CPU, MAPPA_CPU_NUM_GPUS sets a local cluster's logical GPUs.)") from None
    memory = "" if gib else " (GPU memory not known here: give --mappa.gpu_memory_gib to check it too)"
    print(f"[mappa] placement plan for {gpus} GPUs{memory}:\n{placement.format_plan(plan, gpus)}\n"
          f"actor and reference processes: {actor_threads(args)} OpenMP threads each (--mappa.actor_threads)",
          file=console.out, flush=True)


def actor_threads(args) -> int:
    """OpenMP threads per actor and reference process: --mappa.actor_threads, else this node's cores over its GPUs
    (at most one of a GPU's actor ranks trains at a time). Nodes are taken to be alike."""
    return args.mappa.actor_threads or max(1, (os.cpu_count() or 1) // (args.mappa.gpus_per_node or 1))


@dataclass
class Agent:
    """One agent's policy on the cluster."""

    spec: object
    args: object
    tokenizer: object
    engines: list
    actor: object  # RayActorGroup of PolicyModelActor
    ref: object  # RayActorGroup of ReferenceModelActor, or None when the KL coefficient is 0
    trainer: object  # AgentTrainer: OpenRLHF's BasePPOTrainer over this agent's actor, reference and engines


def engines_on(a, model: str, pg, share: float, cls=None, **lora) -> list:
    """Engines on a placement group: engine i on bundle i of `pg`, each asking Ray for `share` of the GPU
    (placement.gpu_share; OpenRLHF's create_vllm_engines asks 0.2, one policy's share, which a team's nine
    models on one GPU would not fit). Colocated, beside actor and reference rank i; a LoRA pool's (`cls`
    PoolEngine, `lora` vLLM's LoRA settings) on its own group when nothing is colocated."""
    from openrlhf.trainer.ray.vllm_engine import RolloutRayActor
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return [
        (cls or RolloutRayActor).options(
            num_cpus=share, num_gpus=share,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i,
                                                                 placement_group_capture_child_tasks=True),
        ).remote(
            model=model, enforce_eager=a.vllm.enforce_eager, tensor_parallel_size=1, seed=a.train.seed + i,
            worker_extension_cls="openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap", distributed_executor_backend="uni",
            max_model_len=a.data.max_len, enable_prefix_caching=a.vllm.enable_prefix_caching, dtype="bfloat16",
            trust_remote_code=True, full_determinism=a.train.full_determinism_enable, num_gpus=share,
            gpu_memory_utilization=a.vllm.gpu_memory_utilization, enable_sleep_mode=a.vllm.enable_sleep, **lora,
        )
        for i in range(a.vllm.num_engines)
    ]  # fmt: skip


def build_agents(args, topology, max_steps: dict, startup) -> list:
    """Every trainee's engines, actor and reference groups, initialised, and its AgentTrainer. `startup` (a
    StartupWatchdog) is told which agent is being created and, per component, a ref that is ready once that
    one is up.

    Colocated (--mappa.colocate), an agent's actor rank i, reference rank i and engine i share bundle i of one
    placement group: the agent's own (agent), or the team's (team). Their engines are created, and put to sleep
    with --vllm.enable_sleep, before any actor: vLLM sizes its KV cache from the GPU memory free when it starts
    (on the team's GPUs, one agent's engines after another's, for the same reason)."""
    from openrlhf.trainer.ray import create_vllm_engines
    from openrlhf.trainer.ray.launcher import RayActorGroup, ReferenceModelActor
    from openrlhf.trainer.ray.ppo_actor import PolicyModelActor
    from openrlhf.trainer.ray.vllm_engine import batch_vllm_engine_call
    from openrlhf.utils import get_strategy
    from ray.util.placement_group import placement_group
    from transformers import AutoTokenizer

    from openrlhf_mappa.agent_trainer import AdapterOff, AgentTrainer, LoraActor, PoolEngine

    check_placement(args, topology)
    # Ray gives an actor of less than one CPU (every colocated one) OMP_NUM_THREADS=1, which leaves torch's CPU ops
    # and DeepSpeed's CPU Adam (--ds.adam_offload: the optimizer step of billions of parameters) on one core.
    threads = {"env_vars": {"OMP_NUM_THREADS": str(actor_threads(args))}}
    threaded = lambda cls: types.SimpleNamespace(options=lambda **kw: cls.options(runtime_env=threads, **kw))
    per_agent = [(spec, agent_args(args, spec)) for spec in trainee_specs(args, topology)]
    colocate = args.mappa.colocate
    share = placement.gpu_share(args, topology) if colocate != "none" else 1
    gpu_set = lambda a: placement_group([{"GPU": 1, "CPU": 1}] * (a.actor.num_nodes * a.actor.num_gpus_per_node), strategy="PACK")
    pgs = {}  # agent -> the placement group its actor, reference and engines share (colocated only)
    if colocate == "agent":
        pgs = {spec.name: gpu_set(a) for spec, a in per_agent}
    elif colocate == "team":  # every agent has the same GPU count (placement.colocation_problems)
        team = gpu_set(per_agent[0][1])
        pgs = {spec.name: team for spec, _ in per_agent}

    engines, pools = {}, placement.lora_pools(args, topology)
    pool_of = {spec.name: label for label, specs in pools.items() for spec in specs}
    for spec, a in per_agent:
        startup.stage = f"agent {spec.name!r} (creating its engines)"
        label = pool_of.get(spec.name)
        if label in engines:  # a LoRA pool's engines, created with its first agent
            engines[spec.name] = engines[label]
            continue
        if label:
            ranks = [m.lora.rank for m in pools[label]]
            lora = dict(enable_lora=True, max_loras=len(ranks), max_lora_rank=placement.pool_max_rank(ranks))
            pg = pgs.get(spec.name) or placement_group([{"GPU": 1, "CPU": 1}] * a.vllm.num_engines, strategy="PACK")
            engines[label] = engines[spec.name] = engines_on(a, spec.model, pg, share, PoolEngine, **lora)
        elif colocate == "none":
            engines[spec.name] = create_vllm_engines(
                a.vllm.num_engines, a.vllm.tensor_parallel_size, spec.model, a.train.seed, a.train.full_determinism_enable,
                a.vllm.enable_prefix_caching, a.vllm.enforce_eager, a.data.max_len, None, a.vllm.gpu_memory_utilization, False,
            )  # fmt: skip
        else:
            engines[spec.name] = engines_on(a, spec.model, pgs[spec.name], share)
        startup.components += [(f"{label or f'agent {spec.name!r}'}: vLLM engine {i}", e.__ray_ready__.remote())
                               for i, e in enumerate(engines[spec.name])]
        if colocate == "team":
            # vLLM sizes its KV cache from the drop in the whole GPU's free memory while it profiles, so engines
            # starting at once on one GPU would count each other's loads as their own (a KV budget wrong or below
            # zero): each agent's engines start, and sleep, before the next agent's do.
            startup.stage = f"agent {spec.name!r} (its engines starting on the team's GPUs, one agent at a time)"
            ray.get([e.__ray_ready__.remote() for e in engines[spec.name]])
            if args.vllm.enable_sleep:
                batch_vllm_engine_call(engines[spec.name], "sleep")
    if colocate == "agent" and args.vllm.enable_sleep:
        startup.stage = "the colocated vLLM engines (starting, then put to sleep before the actors start)"
        batch_vllm_engine_call(distinct(sum(engines.values(), [])), "sleep")

    agents, init_refs = [], []
    for spec, a in per_agent:
        startup.stage = f"agent {spec.name!r} (creating its actors)"
        strategy = get_strategy(a)
        pg = pgs.get(spec.name)
        actor = RayActorGroup(a.actor.num_nodes, a.actor.num_gpus_per_node, threaded(LoraActor if spec.lora else PolicyModelActor),
                              pg=pg, num_gpus_per_actor=share)  # RayActorGroup calls .options() on its actor type
        ref = None
        if a.algo.kl.init_coef > 0 and spec.lora:
            ref = AdapterOff(actor)  # the base: its own actor with the adapter off
        elif a.algo.kl.init_coef > 0:
            ref = RayActorGroup(a.ref.num_nodes, a.ref.num_gpus_per_node, threaded(ReferenceModelActor), pg=pg,
                                num_gpus_per_actor=share)
            init_refs += ref.async_init_model_from_pretrained(strategy, spec.model)
        steps = max_steps[spec.name]  # its learning-rate schedule's length (train_mappa_ray.schedule_steps)
        init_refs += actor.async_init_model_from_pretrained(strategy, spec.model, steps, engines[spec.name])
        tokenizer = AutoTokenizer.from_pretrained(spec.model, trust_remote_code=True)
        trainer = AgentTrainer(strategy, actor, ref, engines[spec.name], tokenizer, spec.name if spec.lora else None)
        agents.append(Agent(spec, a, tokenizer, engines[spec.name], actor, ref, trainer))
        # A component answers this ping once it is up: an actor runs one caller's calls in order, so its
        # answer comes after its init.
        startup.components += [(f"agent {name!r}: {what}", h.__ray_ready__.remote())
                               for name, what, h in components(agents[-1:]) if "vLLM" not in what]
        if colocate == "team":
            # On the team's GPUs, one agent's actors load (ZeRO-3 gathers every weight once) and offload before
            # the next agent's load: all at once, the team's weights would be on the GPUs together.
            ray.get(init_refs)
    startup.stage = None
    ray.get(init_refs)
    for ag in agents:  # each adapter into its pool's engines: as initialised, or as resumed from a checkpoint
        if ag.trainer.adapter:
            ag.trainer.broadcast_to_vllm()
    # The shared-policy baseline: every other role plays and trains through the first agent's components.
    for spec in topology.agents[len(agents) :]:
        agents.append(dataclasses.replace(agents[0], spec=spec, args=agent_args(args, spec)))
    return agents


def experience_of(action):
    """One action as an OpenRLHF Experience: the sequence is prompt + response, and the action mask
    (shifted by one, as OpenRLHF's) covers the response tokens only, so tool output never trains."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    seq = action.prompt_ids + action.response_ids
    action_mask = torch.zeros(len(seq), dtype=torch.bool)
    action_mask[len(action.prompt_ids) :] = True
    reward = torch.tensor([action.reward], dtype=torch.float32)
    return Experience(
        sequences=torch.tensor([seq]),
        attention_mask=torch.ones(1, len(seq), dtype=torch.long),
        action_mask=action_mask[1:].unsqueeze(0),
        rewards=reward,
        response_length=torch.tensor([float(len(action.response_ids))]),
        truncated=torch.tensor([action.truncated]),
        total_length=torch.tensor([float(len(seq))]),
        prompts=[action.prompt_text],
        labels=[""],
        info={"reward": reward, "response_length": torch.tensor([float(len(action.response_ids))])},
    )


def distinct(handles: list) -> list:
    """The handles once each, in order: a LoRA pool's engines belong to each of its agents."""
    return list({id(h): h for h in handles}.values())


def owners(agents: list) -> list:
    """The agents that own their components (actor, reference, engines): all of them, or under a shared
    policy only the first, whose components the other roles reuse (see build_agents)."""
    first = {}
    for ag in agents:
        first.setdefault(id(ag.actor), ag)
    return list(first.values())


def components(agents: list) -> list:
    """(agent, component, Ray actor handle) for every process of every agent (a shared policy's once)."""
    out = []
    for ag in owners(agents):
        out += [(ag.spec.name, f"vLLM engine {i}", e) for i, e in enumerate(ag.engines)]
        out += [(ag.spec.name, f"actor rank {i}", h) for i, h in enumerate(ag.actor._actor_handlers)]
        if ag.ref is not None and not ag.trainer.adapter:  # a LoRA agent's reference is its actor
            out += [(ag.spec.name, f"reference rank {i}", h) for i, h in enumerate(ag.ref._actor_handlers)]
    return out


def find_dead(agents: list, timeout_s: float = 5.0) -> list:
    """'agent X: component' for each dead process. A ping to a dead actor fails at once; a busy live one
    just does not answer within the timeout, which is fine: only a failed ping counts as dead."""
    pings = {h.__ray_ready__.remote(): f"agent {name!r}: {what}" for name, what, h in components(agents)}
    ready, _ = ray.wait(list(pings), num_returns=len(pings), timeout=timeout_s)
    dead = []
    for ref in ready:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError:
            dead.append(pings[ref])
    return dead


class Watchdog(threading.Thread):
    """Stops the run promptly when one agent's engine or actor dies, naming it.

    Without it, a dead vLLM engine can hang the run: its actor blocks in the weight broadcast's collective
    until the collective's timeout (10 minutes). Every `interval_s` the watchdog pings all components; on a
    death it records which and interrupts the main thread (SIGINT ends a blocking ray.get), and if that does
    not end the process within a grace period, it exits hard. Steps already logged stay on disk."""

    def __init__(self, agents: list, interval_s: float = 5.0, grace_s: float = 60.0):
        super().__init__(daemon=True, name="mappa-watchdog")
        self.agents, self.interval_s, self.grace_s = agents, interval_s, grace_s
        self.dead, self.reason, self.done = [], None, threading.Event()

    def check(self):
        """Why the run must stop now, or None."""
        self.dead = find_dead(self.agents)
        return f"{'; '.join(self.dead)} died" if self.dead else None

    def run(self):
        while not self.done.wait(self.interval_s):
            self.reason = self.check()
            if self.reason:
                print(f"[mappa] stopping: {self.reason}", file=console.err, flush=True)
                # Repeated: one SIGINT can be lost (landing in a finalizer or callback, it is only printed as
                # "Exception ignored in ..."); a start-up on a loaded machine once blocked on after it.
                deadline = time.time() + self.grace_s
                while time.time() < deadline:
                    os.kill(os.getpid(), signal.SIGINT)
                    if self.done.wait(5.0):
                        return
                os._exit(1)


def startup_waits(models: list) -> list:
    """What a slow start-up may be waiting for, as far as the driver can see: a build lock in the extension
    cache (a build killed midway leaves it, and every later build of that op waits for it to go), a placement
    group Ray cannot place (no free GPU), a model still downloading from the hub."""
    from huggingface_hub.constants import HF_HUB_CACHE
    from torch.utils.cpp_extension import get_default_build_root

    seen = []
    cache = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    for lock in glob.glob(os.path.join(cache, "**", "lock"), recursive=True):
        seen.append(f"the build lock {lock} ({time.time() - os.path.getmtime(lock):.0f} s old; "
                    f"a build killed midway leaves it: delete it if no build is running)")
    for pg in ray.util.placement_group_table().values():
        if pg["state"] == "PENDING":
            free = ray.available_resources().get("GPU", 0)
            seen.append(f"a placement group Ray cannot place: {list(pg['bundles'].values())}, {free:g} GPUs free")
    for model in models:
        parts = glob.glob(os.path.join(HF_HUB_CACHE, "models--" + model.replace("/", "--"), "blobs", "*.incomplete"))
        if parts and not os.path.isdir(model):
            seen.append(f"the download of {model} ({sum(map(os.path.getsize, parts)) / 2**20:.0f} MiB so far)")
    return seen


class StartupWatchdog(Watchdog):
    """A start-up never waits in silence. Every `warn_s` while engines and actors start, it names on the
    console the components not up yet and what they may be waiting for (startup_waits); after `timeout_s`
    it stops the run with that message, as Watchdog does. A run killed while DeepSpeed built an
    op once left a lock that made every later start-up wait, silently, for as long as nobody looked."""

    def __init__(self, warn_s: float, timeout_s: float, models: list):
        super().__init__(agents=None, interval_s=min(5.0, warn_s))
        self.warn_s, self.timeout_s, self.models = warn_s, timeout_s, models
        self.t0, self.next_warn = time.time(), warn_s
        self.stage, self.components = None, []  # filled in by build_agents: (label, ref ready once it is up)

    def check(self):
        elapsed = time.time() - self.t0
        stop = elapsed >= self.timeout_s
        if elapsed < self.next_warn and not stop:
            return None
        watched = list(self.components)
        ready, _ = ray.wait([r for _, r in watched], num_returns=len(watched), timeout=0) if watched else ([], [])
        waiting = [label for label, r in watched if r not in set(ready)] + ([self.stage] if self.stage else [])
        seen = startup_waits(self.models)
        report = (f"start-up not done after {elapsed:.0f} s; not up yet: {', '.join(waiting) or 'none'}; "
                  f"waiting for: {'; '.join(seen) or 'nothing seen from here (still loading?)'}")
        if stop:
            return f"{report}. Stopped by --mappa.startup_timeout_s {self.timeout_s:g}."
        print(f"[mappa] {report}. Stops after --mappa.startup_timeout_s {self.timeout_s:g}.", file=console.err, flush=True)
        self.next_warn += self.warn_s
        return None


def rotate_checkpoints(agent_ckpt_dir: str, keep: int) -> list:
    """Delete all but the `keep` newest DeepSpeed checkpoints (_actor/global_step<N>) and HF exports
    (global_step<N>_hf) of one agent, once a team checkpoint is written; returns the paths deleted.
    DeepSpeed's own rotation runs before each save and is given one more (agent_args): with --ckpt.max_num 1 it
    would delete the team's checkpoint while the next is half saved, and a kill then leaves nothing to resume.
    It never rotates HF exports (a full model per save: 8 GB for a 4B agent in bf16)."""
    deleted = []
    for pattern, suffix in ((os.path.join(agent_ckpt_dir, "_actor", "global_step*"), ""),
                            (os.path.join(agent_ckpt_dir, "global_step*_hf"), "_hf")):
        saved = {}  # step -> path
        for path in glob.glob(pattern):
            step = os.path.basename(path)[len("global_step") : len(os.path.basename(path)) - len(suffix)]
            if step.isdigit() and os.path.isdir(path):
                saved[int(step)] = path
        deleted += [saved[step] for step in sorted(saved)[: max(0, len(saved) - keep)]]
    for path in deleted:
        shutil.rmtree(path)
    return deleted


def truncate_logs(run_dir: str, step: int) -> None:
    """Keep only the lines of steps <= `step` in metrics.jsonl and episodes.jsonl. A resumed run redoes the
    steps after its checkpoint, which would otherwise appear twice; a line cut off by a kill is dropped."""
    for name in ("metrics.jsonl", "episodes.jsonl", "eval.jsonl"):
        path = os.path.join(run_dir, name)
        if not os.path.exists(path):
            continue
        kept, dropped = [], 0
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    record = None
                if isinstance(record, dict) and record.get("step", 0) <= step:
                    kept.append(line.rstrip("\n") + "\n")
                else:
                    dropped += 1
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)
        if dropped:
            print(f"[mappa] {path}: kept {len(kept)} lines up to step {step}, dropped {dropped} (later steps or cut off)",
                  file=console.out, flush=True)


class MappaTrainer:
    def __init__(self, args, topology, agents: list, coach, tasks: list, run_dir: str, eval_sets: dict = None):
        self.args, self.topology, self.agents, self.coach, self.tasks = args, topology, agents, coach, tasks
        self.run_dir = run_dir
        self.eval_sets = eval_sets or {}  # dataset name -> tasks
        # Who trains whose actions: each agent its own, or with a shared policy, all of them the first's.
        self.trainees = owners(agents)
        owner_of_actor = {id(ag.actor): ag.spec.name for ag in self.trainees}
        self.owner = {ag.spec.name: owner_of_actor[id(ag.actor)] for ag in agents}
        self.mappa = args.mappa
        # The outcome baseline trains on no verdict: asking an API coach anyway would cost money for nothing.
        # --mappa.coach.score_outcome_runs asks it all the same, for a comparison that is logged, never trained on.
        self.scored = self.mappa.reward == "process" or self.mappa.coach.score_outcome_runs
        self.rollout_coach = coach if self.scored else NoCoach("outcome baseline: not scored")
        self.bias_audit = BiasAudit(self.mappa.coach.bias_threshold, self.mappa.coach.bias_window)
        self.coach_cost_usd = 0.0
        # The coach template in use (an index into topology.coach_stages) and the first step it scored.
        self.stage, self.stage_since, self.stage_waits_noted = 0, 1, set()
        # Steps in a row in which no agent trained, and the message that stops the run (--mappa.max_untrained_steps).
        self.untrained_steps, self.stalled = 0, None
        os.makedirs(run_dir, exist_ok=True)
        self.policies, self.eval_policies = (
            {
                ag.spec.name: AgentPolicy(
                    engines=ag.engines,
                    tokenizer=ag.tokenizer,
                    max_new_tokens=ag.args.rollout.max_new_tokens,
                    max_len=args.data.max_len,
                    sampling=dict(temperature=temperature, top_p=args.rollout.top_p),
                    adapter=ag.trainer.adapter,
                )
                for ag in agents
            }
            for temperature in (args.rollout.temperature, args.eval.temperature)
        )
        # One event loop for the whole run: the coach's HTTP client and its semaphore belong to the loop
        # they were first used on, so a fresh asyncio.run() per step would break them at step 2.
        self.loop = asyncio.new_event_loop()
        self.loggers = []
        if args.logger.wandb.key:
            from openrlhf.utils.logging_utils import WandbLogger

            self.loggers.append(WandbLogger(args))
        if args.logger.tensorboard_dir:
            from openrlhf.utils.logging_utils import TensorboardLogger

            self.loggers.append(TensorboardLogger(args))

    def batches(self, start_step: int):
        """(step, tasks) for every step of every pass over the data; each task repeated n_samples times."""
        bs, n = self.args.rollout.batch_size, self.args.rollout.n_samples_per_prompt
        steps_per_pass = len(self.tasks) // bs
        for step in range(start_step, steps_per_pass * self.args.train.num_episodes):
            rng = random.Random(self.args.train.seed + step // steps_per_pass)
            order = list(range(len(self.tasks)))
            rng.shuffle(order)
            chunk = order[(step % steps_per_pass) * bs : (step % steps_per_pass + 1) * bs]
            yield step + 1, [self.tasks[i] for i in chunk for _ in range(n)]

    def resume(self, step: int):
        """Continue after step `step`: logs cut back to it, every agent checked to have loaded that step,
        and each agent's engines given its actor's loaded weights (they start from the base model)."""
        truncate_logs(self.run_dir, step)
        if not step:
            return
        for ag in self.trainees:
            loaded = ag.trainer.init_checkpoint_states()["global_step"]
            if loaded != step:
                raise RuntimeError(f"resume: agent {ag.spec.name!r} loaded the checkpoint of step {loaded}, expected {step}")
        for ag in self.trainees:
            ag.trainer.broadcast_to_vllm()
        self.restore(step)

    def restore(self, step: int):
        """The driver's own state as the team checkpoint of step `step` left it (see write_marker): the coach's
        cost so far, the coach template in use, the bias audit's window."""
        marker = json.load(open(os.path.join(self.args.ckpt.path, CHECKPOINT_MARKER)))
        self.coach_cost_usd = marker.get("coach_cost_usd", 0.0)
        if marker.get("coach_template"):  # its name was checked against the topology by resume.check_resume
            name, since = marker["coach_template"]["name"], marker["coach_template"]["since_step"]
            self.set_stage([s.name for s in self.topology.coach_stages].index(name), since)
            print(f"[mappa] coach criteria: resuming with coach template {name!r} (in use since step {since})",
                  file=console.out, flush=True)
        # The bias audit's window, as the steps up to the checkpoint left it: its warnings and the figures a
        # coach is shown (--mappa.coach.show_bias) would otherwise restart from nothing.
        path, by_step = os.path.join(self.run_dir, "episodes.jsonl"), {}
        for _, ep in read_jsonl(path) if os.path.exists(path) else []:
            if step - self.bias_audit.window.maxlen < ep["step"] <= step:
                by_step.setdefault(ep["step"], []).append(Episode.from_record(ep))
        for k in sorted(by_step):
            self.bias_audit.update(by_step[k])

    def fit(self, start_step: int = 0):
        total = (len(self.tasks) // self.args.rollout.batch_size) * self.args.train.num_episodes
        every = self.args.eval.steps
        if start_step == 0:
            self.evaluate(0)  # the untrained models: the baseline every later evaluation compares with
        steps = tqdm(self.batches(start_step), total=total, initial=start_step, desc="MAPPA steps", file=console.err)
        for step, tasks in steps:
            with tqdm(total=len(tasks), desc=f"step {step} rollout", unit="episode", leave=False, file=console.err) as bar:
                metrics = self.train_step(step, tasks, progress=bar.update)
            self.log(step, metrics)
            tqdm.write(step_line(step, total, metrics, [ag.spec.name for ag in self.agents]), file=console.err)
            if self.stalled:
                raise RunStopped(self.stalled)
            self.advance_criteria(step, metrics)  # before the checkpoint, which records the template in use
            if (every > 0 and step % every == 0) or step == total:
                self.evaluate(step)
            if self.args.ckpt.save_steps > 0 and step % self.args.ckpt.save_steps == 0:
                self.save_checkpoints(step)
        ray.get([ref for ag in self.trainees for ref in ag.actor.async_save_model()])
        for logger in self.loggers:
            logger.close()
        self.loop.run_until_complete(self.coach.aclose())

    @contextlib.contextmanager
    def engines_awake(self):
        """With --vllm.enable_sleep: every agent's engines awake while the team generates (an episode passes
        through all agents), and asleep after, when colocated actors use their memory."""
        from openrlhf.trainer.ray.vllm_engine import batch_vllm_engine_call

        engines = distinct([e for ag in self.trainees for e in ag.engines])  # a LoRA pool's serve several agents
        if self.args.vllm.enable_sleep:
            batch_vllm_engine_call(engines, "wake_up")
        try:
            yield
        finally:
            if self.args.vllm.enable_sleep:
                batch_vllm_engine_call(engines, "sleep")

    def train_step(self, step: int, tasks: list, progress=None) -> dict:
        t_start = t0 = time.time()
        c = self.mappa.coach
        workspace = os.path.join(self.run_dir, "workspaces")
        bias = self.bias_audit.prompt_text() if c.show_bias else None  # the steps before this one
        with self.engines_awake():
            episodes = self.loop.run_until_complete(
                rollout(self.topology, tasks, self.policies, self.rollout_coach, workspace, step, coach_bias=bias,
                        coach_mode=c.mode if self.scored else "per_action", progress=progress)
            )
        t_rollout = time.time() - t0
        coach_metrics = coach_step_metrics(episodes, c.price_in, c.price_out)
        coach_metrics.update(self.bias_audit.update(episodes))
        self.coach_cost_usd += coach_metrics.get("coach/cost_usd", 0.0)
        if c.price_in or c.price_out:
            coach_metrics["coach/cost_usd_total"] = self.coach_cost_usd
        failed = [ep for ep in episodes if ep.env_error]
        if failed:  # contained by the rollout: each is a failed episode that trains nothing (rollout.run_episode)
            limit = self.mappa.env.max_failure_fraction
            said = (f"{len(failed)} of {len(episodes)} episodes ended with an exception in the environment (they "
                    f"train nothing). First: {failed[0].env_error}")
            tqdm.write(f"[mappa] step {step}: {said}", file=console.err)
            if len(failed) / len(episodes) > limit:
                self.write_episodes(episodes)
                self.log(step, {**coach_metrics, "outcome/env_failed_episodes": len(failed)})
                raise RunStopped(f"step {step}: {said}. That is more than --mappa.env.max_failure_fraction {limit:g} "
                                 f"of them; the step's episodes are in {self.run_dir}/episodes.jsonl.")
        if self.scored:  # verdicts paid for but mostly failed: stop, even when only logged
            try:
                check_failures(episodes, coach_metrics, c.max_failure_fraction)
            except CoachFailure as e:  # keep what the step produced, so the failures can be inspected
                self.write_episodes(episodes)
                self.log(step, coach_metrics)
                raise CoachFailure(f"step {step}: {e} The step's episodes are in {self.run_dir}/episodes.jsonl.") from None
        counts = rewards.assign_rewards(episodes, self.mappa.reward, c.on_failure, c.neutral_score,
                                        self.topology.reward_scale, self.mappa.train_truncated)
        if c.standardize_task_type and self.mappa.reward == "process":
            rewards.standardize_by_task_type(episodes)
        if self.mappa.norm_scope == "group":
            rewards.group_normalize(episodes)

        # Per agent: trainable actions -> Experiences -> actor/ref forward (log-probs, KL), by OpenRLHF's maker.
        t0 = time.time()
        actions_of = {ag.spec.name: [] for ag in self.trainees}
        for ep in episodes:
            for action in ep.actions:
                if action.reward is not None:
                    actions_of[self.owner[action.agent]].append(action)
        batches, kept_actions, dropped = self.make_experiences(actions_of, step)
        untrained = {ag.spec.name: self.untrained_reason(ag, episodes, dropped[ag.spec.name])
                     for ag in self.trainees if ag.spec.name not in batches}
        for name, why in untrained.items():
            tqdm.write(f"[mappa] step {step}: agent {name!r} trained on nothing: {why}", file=console.err)
        self.untrained_steps = self.untrained_steps + 1 if len(untrained) == len(self.trainees) else 0
        most = self.mappa.max_untrained_steps
        if most and self.untrained_steps >= most:
            self.stalled = (f"no agent trained in {self.untrained_steps} steps in a row (--mappa.max_untrained_steps "
                            f"{most}); at step {step}, "
                            + "; ".join(f"agent {n!r}: {why}" for n, why in untrained.items()))
        rewards.compute_advantages(batches, self.args.algo.kl.init_coef, scope=self.mappa.norm_scope)
        t_experience = time.time() - t0

        # Record each trained action's mean advantage over its own tokens.
        for name, exps in batches.items():
            per_action = []
            for e in exps:
                per_action += ((e.advantages * e.action_mask).sum(1) / e.action_mask.sum(1).clamp(min=1)).tolist()
                e.kl = None  # consumed by the advantages; OpenRLHF's actor does not read it
            for action, adv in zip(kept_actions[name], per_action):
                action.advantage = adv

        # Agent k's experiences train agent k's actor, whose weights then go to agent k's engines: OpenRLHF's
        # train_step.
        t0 = time.time()
        trained = [ag for ag in self.trainees if ag.spec.name in batches]
        status = self.per_agent(lambda ag: ag.trainer.train_step(batches[ag.spec.name], step)[0], trained)
        # time/sync: the syncs' share of the phase (the slowest agent's, or all of them one after another).
        syncs = [s["timing/broadcast"] for s in status.values()]
        t_sync = (sum(syncs) if self.mappa.colocate == "team" else max(syncs, default=0.0))
        t_train = time.time() - t0 - t_sync

        self.write_episodes(episodes)
        metrics = self.step_metrics(episodes, batches, status, dropped, counts)
        metrics.update(coach_metrics)
        metrics.update({"time/rollout": t_rollout, "time/experience": t_experience, "time/train": t_train,
                        "time/sync": t_sync, "time/step": time.time() - t_start})
        if self.topology.coach_stages:
            metrics["coach/template_stage"] = self.stage  # 0-based, in coach_templates' order
        return metrics

    def per_agent(self, fn, agents: list) -> dict:
        """{agent: fn(agent)}: at once for agents on GPUs of their own (--mappa.colocate none or agent), one after
        another on the team's shared GPUs, where each agent's phase needs the memory the others' would take."""
        if self.mappa.colocate == "team":
            return {ag.spec.name: fn(ag) for ag in agents}
        with concurrent.futures.ThreadPoolExecutor(max(1, len(agents))) as pool:
            return dict(zip([ag.spec.name for ag in agents], pool.map(fn, agents)))

    def make_experiences(self, actions_of: dict, step: int):
        """Each trainee's kept actions (batch_rule) as OpenRLHF Experiences with its actor's and reference's
        log-probs and KL: (batches, kept actions, dropped counts), by agent; an agent with no batch is absent."""
        kept_actions, dropped = {}, {}
        for ag in self.trainees:
            kept, dropped[ag.spec.name] = self.batch_rule(actions_of[ag.spec.name], step)
            if kept:
                kept_actions[ag.spec.name] = kept

        def forward(ag):
            maker = ag.trainer.experience_maker
            return maker.make_experience(maker.split_rollout_samples([experience_of(a) for a in kept_actions[ag.spec.name]]))

        batches = self.per_agent(forward, [ag for ag in self.trainees if ag.spec.name in kept_actions])
        return batches, kept_actions, dropped

    def advance_criteria(self, step: int, metrics: dict):
        """After step `step`: when the rule of the next template in the topology's coach_templates holds on this
        step's metrics, that template scores from step + 1 on. Stages advance in order, one per step at most;
        a metric with no value this step (e.g. a code error rate when no code ran) switches nothing."""
        stages = self.topology.coach_stages
        if self.stage + 1 >= len(stages):
            return
        stage = stages[self.stage + 1]
        value = step if stage.metric == "step" else metrics.get(stage.metric)
        if stage.holds(value):
            tqdm.write(f"[mappa] coach criteria: after step {step}, {stage.metric} = {value:g} ({stage.when}): coach "
                       f"template {stages[self.stage].name!r} -> {stage.name!r}, in use from step {step + 1}", file=console.out)
            self.set_stage(self.stage + 1, step + 1)
        elif value is None and stage.name not in self.stage_waits_noted:
            self.stage_waits_noted.add(stage.name)
            tqdm.write(f"[mappa] coach criteria: step {step} logged no value of {stage.metric}; coach template "
                       f"{stage.name!r} waits for a step where {stage.when}", file=console.out)

    def set_stage(self, index: int, since: int):
        self.stage, self.stage_since = index, since
        self.coach.template = self.topology.coach_stages[index].template

    def untrained_reason(self, ag, episodes: list, dropped: int) -> str:
        """Why agent `ag` trained on no action in this step (its actions, or under a shared policy every role's),
        each reason with its count and the flag that changes it."""
        name, a = ag.spec.name, ag.args
        mine = [(ep, x) for ep in episodes for x in ep.actions if self.owner[x.agent] == name]
        skipped = sum(self.owner[s["agent"]] == name for ep in episodes for s in ep.skipped_actions)
        cut = {id(x) for ep, x in mine if not ep.env_error and x.truncated and not self.mappa.train_truncated}
        unscored = {}
        for ep, x in mine:
            if x.reward is None and not ep.env_error and id(x) not in cut:
                status = x.verdict.status if x.verdict else "missing"
                unscored[status] = unscored.get(status, 0) + 1
        env_failed = sum(bool(ep.env_error) for ep, _ in mine)
        of = f"of its {len(mine)} actions"
        limit = "its max_new_tokens in the topology" if ag.spec.max_new_tokens else "--rollout.max_new_tokens"
        why = [f"{len(cut)} {of} cut off at {limit} ({a.rollout.max_new_tokens} tokens) and left out: raise it, or "
               f"train them with --mappa.train_truncated"] if cut else []
        if unscored:
            statuses = ", ".join(f"{k} {n}" for k, n in unscored.items())
            why.append(f"{sum(unscored.values())} {of} without a coach score ({statuses}): --mappa.coach.on_failure "
                       f"outcome or neutral trains them")
        if env_failed:
            why.append(f"{env_failed} {of} in episodes whose environment raised (env_error in episodes.jsonl)")
        if dropped:
            why.append(f"{dropped} {of} left over by the batch rule, less than one --train.batch_size "
                       f"({a.train.batch_size}) batch: lower --train.batch_size, or raise --rollout.batch_size")
        if skipped:
            why.append(f"{skipped} actions not taken: the prompt did not fit --data.max_len ({a.data.max_len}) minus "
                       f"{limit} even without its history: raise --data.max_len")
        return "; ".join(why) or "the environment gave it no turn"

    def batch_rule(self, actions: list, step: int):
        """Keep a whole number of global train batches (train.batch_size) per agent and step.

        DeepSpeed's gradient accumulation is fixed by train.batch_size, and data-parallel ranks with
        unequal micro-batch counts deadlock in all-reduce. So an agent whose action count varies (a Code
        Executor acting once or twice) trains on floor(n / B) * B of its actions, picked at random with a
        seeded RNG, and skips the update when n < B. Dropped actions are counted in the metrics."""
        B = self.args.train.batch_size
        keep = (len(actions) // B) * B
        picked = random.Random(self.args.train.seed * 1000003 + step).sample(actions, keep) if keep else []
        return picked, len(actions) - keep

    def step_metrics(self, episodes, batches, status, dropped, counts) -> dict:
        c = self.mappa.coach
        m = {
            "outcome/success_rate": sum(ep.success for ep in episodes) / len(episodes),
            # episodes stopped by an agent's max_actions or max_episode_actions (failures; see rollout.py)
            "outcome/action_limit_episodes": sum(bool(ep.action_limit) for ep in episodes),
            # episodes ended by an exception in the environment (failures that train nothing; see rollout.py)
            "outcome/env_failed_episodes": sum(bool(ep.env_error) for ep in episodes),
            "coach/left_out": counts["left_out"],
            "reward_scale": self.topology.reward_scale,
            **({f"coach/fallback_{c.on_failure}": counts["fallback"]} if c.on_failure != "skip" else {}),
        }
        m.update(behaviour_metrics(episodes, [ag.spec.name for ag in self.agents]))
        for ag in self.agents:
            name = ag.spec.name
            scored = [a.verdict.score for ep in episodes for a in ep.actions
                      if a.agent == name and a.verdict and a.verdict.score is not None]  # fmt: skip
            p = f"agent/{name}/"
            m[p + "coach_score"] = sum(scored) / len(scored) if scored else None
            m[p + "outcome_success"] = m["outcome/success_rate"]
            m[p + "truncated_left_out"] = counts["truncated_left_out"].get(name, 0)
            if self.owner[name] != name:  # a shared policy's training metrics are under the first agent's name
                continue
            m[p + "trained_actions"] = sum(len(e.sequences) for e in batches.get(name, []))
            m[p + "dropped_for_batching"] = dropped[name]
            m[p + "updated"] = int(name in status)
            if name in batches:
                kl = torch.cat([e.info["kl"] for e in batches[name]])
                m[p + "kl"] = kl.mean().item()
            if name in status:  # a LoRA agent's adapter sync against a full model's
                m.update({p + k: v for k, v in ag.trainer.synced.items()})
            for key in ("policy_loss", "actor_lr", "actor_grad_norm", "ppo_clip_ratio"):
                if name in status and key in status[name]:
                    m[p + key] = status[name][key]
        return m

    def evaluate(self, step: int):
        """Every --eval.dataset, n samples per task at --eval.temperature, on the current weights: one line
        per dataset in eval.jsonl (read by `mappa report`), the per-problem results in eval/, and the
        loggers' eval/ namespace."""
        e, names = self.args.eval, [ag.spec.name for ag in self.agents]
        for dataset, tasks in self.eval_sets.items():
            workspace = os.path.join(self.run_dir, "workspaces", f"eval-{dataset}")
            total = len(tasks) * e.n_samples_per_prompt
            with self.engines_awake(), tqdm(total=total, desc=f"evaluation {dataset}", unit="episode", leave=False,
                                            file=console.err) as bar:
                episodes = self.loop.run_until_complete(
                    evaluate(self.topology, tasks, self.eval_policies, e.n_samples_per_prompt, workspace, step, bar.update)
                )
            summary, problems = summarize(episodes, names, tasks)
            os.makedirs(os.path.join(self.run_dir, "eval"), exist_ok=True)
            with open(os.path.join(self.run_dir, "eval", f"{dataset}-step{step}.json"), "w", encoding="utf-8") as f:
                json.dump({"step": step, "dataset": dataset, "summary": summary, "problems": problems}, f, indent=1)
            with open(os.path.join(self.run_dir, "eval.jsonl"), "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": step, "dataset": dataset, **summary}) + "\n")
            for logger in self.loggers:
                logger.log_eval(step, {f"{dataset}/{k}": v for k, v in summary.items()})
            tqdm.write(f"[mappa] evaluation after step {step}\n{format_table({dataset: summary})}", file=console.err)

    def write_episodes(self, episodes: list):
        with open(os.path.join(self.run_dir, "episodes.jsonl"), "a", encoding="utf-8") as f:
            for ep in episodes:
                f.write(ep.to_json() + "\n")

    def log(self, step: int, metrics: dict):
        with open(os.path.join(self.run_dir, "metrics.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        clean = {k: v for k, v in metrics.items() if v is not None}
        for logger in self.loggers:
            logger.log_train(step, clean)

    def save_checkpoints(self, step: int):
        """OpenRLHF-style resumable checkpoints (and HF exports with --ckpt.save_hf), one directory per agent."""
        refs = []
        for ag in self.trainees:
            refs += ag.actor.async_run_method(
                method_name="save_checkpoint", tag=f"global_step{step}", client_states={"global_step": step}
            )
        ray.get(refs)
        self.write_marker(step)
        for ag in self.trainees:  # only now: the marker names a step all agents saved
            rotate_checkpoints(ag.args.ckpt.path, self.args.ckpt.max_num)

    def write_marker(self, step: int):
        """Only once every agent saved is step `step` a checkpoint of the whole team (see resume.check_resume); the
        marker says so, with the driver's state that restore() reads back. Written atomically."""
        marker = os.path.join(self.args.ckpt.path, CHECKPOINT_MARKER)
        state = {"step": step, "coach_cost_usd": self.coach_cost_usd}
        if self.topology.coach_stages:  # the template in use for the next step, read by restore()
            name = self.topology.coach_stages[self.stage].name
            state["coach_template"] = {"name": name, "since_step": self.stage_since}
        with open(marker + ".tmp", "w") as f:
            json.dump(state, f)
        os.replace(marker + ".tmp", marker)
