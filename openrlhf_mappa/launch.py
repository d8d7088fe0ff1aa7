"""Launching a team on the Ray cluster: the placement check against the cluster's GPUs, then every agent's
placement group, vLLM engines, ZeRO-3 actor and reference groups and its AgentTrainer (build_agents), and the
views of the result the loop and the health checks use (owners, components)."""

import copy
import dataclasses
import types
from dataclasses import dataclass

import ray

from openrlhf_mappa import placement
from openrlhf_mappa.console import console
from openrlhf_mappa.placement import Member, agent_args, members


def gpu_nodes() -> list:
    """(Ray node id, GPUs) of the cluster's live nodes that have GPUs, the largest first: the plan's node k."""
    nodes = [(n["NodeID"], int(n["Resources"].get("GPU", 0))) for n in ray.nodes() if n["Alive"]]
    return sorted([n for n in nodes if n[1]], key=lambda n: -n[1])


def on_each_node(read, nodes: list, *args, gpus: int = 0) -> list:
    """read(*args) run on each of the (Ray node id, GPUs) `nodes`: what that node has, where the launcher's own node
    may be a CPU head of another size. `gpus`: what the task holds there (1: it sees a GPU, as an actor does)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, num_gpus=gpus)(read)
    return ray.get([task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(*args)
                    for node_id, _ in nodes])


def check_placement(args, topology, allowed=lambda a: True) -> tuple:
    """Before any actor exists: the plan (placement.py) against the Ray cluster's nodes and their GPUs, logical
    or real, and their memory where known (the lowest of --mappa.gpu_memory_gib, what this process's GPU
    reports and each GPU node's, placement.node_gpus) and the host memory of a node (--mappa.host_memory_gib,
    else each node's own). Printed when it fits;
    refused, with what to change, when not: Ray itself would wait forever, silently, for
    GPUs that never come (`allowed`: placement.check's). Sets --mappa.actor_threads where 0 (actor_threads).
    Refuses a GPU node that cannot import a kernel the flags need (placement.needed_modules), or whose GPUs
    admit one process each, naming it.
    Returns (the plan, gpu_nodes())."""
    nodes = gpu_nodes()
    gpus = [n for _, n in nodes]
    # One task per GPU node: its cores, the kernels the flags need imported there, its GPUs' memory (the
    # launcher's node may be a CPU head, or hold another Python than the workers).
    needed = placement.needed_modules(args, topology)
    cores, broken, cards = (zip(*on_each_node(placement.node_check, nodes, list(needed))) if nodes
                            else ((), (), ()))
    # The card's memory as the CUDA driver reports it where this process sees a GPU (an "80 GB" card: 79.6
    # GiB), as nvidia-smi does on each GPU node, the flag's where it is lower or none is seen; host memory and
    # node sizes as the nodes and Ray see them.
    reported = [min(size for size, _ in c) for c in cards if c]  # each node's smallest GPU
    known = [gib for gib in (args.mappa.gpu_memory_gib, placement.detect_gpus()[1], *reported) if gib]
    gib = args.mappa.gpu_memory_gib = min(known, default=None)
    if gib:  # the plan's host memory needs its GPU memory plan: no Ray task per node otherwise
        args.mappa.host_memory_gib = args.mappa.host_memory_gib or on_each_node(placement.host_memory_gib, nodes)
    args.mappa.gpus_per_node = args.mappa.gpus_per_node or max(gpus + [1])
    try:
        plan = placement.check(args, topology, gpus, gib, allowed=allowed)
    except ValueError as e:
        raise SystemExit(f"[mappa] {e}\n(On CPU, MAPPA_CPU_NUM_GPUS sets a local cluster's logical GPUs.)") from None
    memory = "" if gib else " (GPU memory not known here: give --mappa.gpu_memory_gib to check it too)"
    refusals = []
    for k, ((node_id, _), found, listed) in enumerate(zip(nodes, broken, cards)):
        refusals += placement.module_refusals(needed, found, f"on node {k} (Ray node {node_id})")
        # An engine's front-end and core, and colocated actors, share a GPU; such a GPU refuses the second.
        modes = sorted({mode for _, mode in listed} - {"Default"})
        if modes:
            refusals.append(f"node {k} (Ray node {node_id}): GPUs in compute mode {', '.join(modes)}, which "
                            "admits one process a GPU, and MAPPA runs several on one (a vLLM engine's "
                            f"processes, colocated actors): set Default there (`sudo nvidia-smi -c DEFAULT`)")
    if refusals:
        raise SystemExit("[mappa] " + "\n".join(refusals))
    args.mappa.actor_threads = args.mappa.actor_threads or actor_threads(list(cores), gpus)
    # A topology's per-agent value wins over the flag (agent_args): said here, so a flag that changes nothing
    # for that agent is no surprise.
    flag = lambda group, name: getattr(getattr(args, group), name)
    overrides = [f"agent {spec.name!r}: {key} {getattr(spec, key)} from the topology, not --{group}.{name} "
                 f"{flag(group, name)}\n"
                 for spec in topology.agents for key, group, name in placement.AGENT_OVERRIDES
                 if getattr(spec, key) and getattr(spec, key) != flag(group, name)]
    names = "".join(f"node {k}: Ray node {node_id}, {n} GPUs\n" for k, (node_id, n) in enumerate(nodes))
    print(f"[mappa] placement plan for {sum(gpus)} GPUs{memory}:\n{placement.format_plan(plan, gpus)}\n{names}"
          f"{''.join(overrides)}actor and reference processes: {args.mappa.actor_threads} OpenMP threads each "
          f"(--mappa.actor_threads)", file=console.out, flush=True)
    return plan, nodes


def pinned_groups(plan, nodes: list) -> dict:
    """GPU set (placement.gpu_set) -> its placement group, bundle i on the Ray node the plan puts the set's GPU i
    on: Ray's own PACK would fill nodes in creation order, splitting a set, or an agent's actor from its engines,
    where the plan keeps them on one node."""
    from ray.util.placement_group import placement_group

    return {key: placement_group([{"GPU": 1, "CPU": 1}] * len(on), strategy="PACK",
                                 bundle_label_selector=[{"ray.io/node-id": nodes[k][0]} for k in on])
            for key, on in plan.place([n for _, n in nodes]).items()}


def actor_threads(cores: list, gpus: list) -> int:
    """OpenMP threads per actor and reference process where --mappa.actor_threads is 0: the fewest over the GPU
    nodes of a node's usable cores (placement.usable_cores, read on that node) over its GPUs. At most one of a
    GPU's actor ranks trains at a time; a CPU head node's cores, or a container's host's, are none of theirs."""
    return max(1, min((c // g for c, g in zip(cores, gpus)), default=1))


@dataclass
class Agent(Member):
    """One agent's policy on the cluster: its Member (spec, args) and its processes."""

    tokenizer: object
    engines: list
    actor: object  # RayActorGroup of PolicyModelActor
    ref: object  # RayActorGroup of ReferenceModelActor, or None when the KL coefficient is 0
    trainer: object  # AgentTrainer: OpenRLHF's BasePPOTrainer over this agent's actor, reference and engines


def engines_on(a, model: str, pg, share: float, cls=None, **lora) -> list:
    """Engines on a placement group: engine i on bundle i of `pg`, each asking Ray for `share` of the GPU
    (placement.gpu_share; OpenRLHF's create_vllm_engines asks 0.2, one policy's share, which a team's nine
    models on one GPU would not fit). Colocated, beside actor and reference rank i; a LoRA pool's (`cls`
    PoolEngine, `lora` vLLM's LoRA settings) on its own group when nothing is colocated, as `mappa eval`'s."""
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
            gpu_memory_utilization=a.vllm.gpu_memory_utilization, enable_sleep_mode=a.vllm.enable_sleep,
            # every action's sampling log-probs after temperature and top-p, as OpenRLHF's correction asks them
            logprobs_mode="processed_logprobs", max_logprobs=1, **lora,
        )
        for i in range(a.vllm.num_engines)
    ]  # fmt: skip


def new_engines(a, model: str, pg, share: float, lora_ranks: list = None) -> list:
    """One agent's vLLM engines on `pg`, or a LoRA pool's (lora_ranks: its adapters' ranks), as a run and
    `mappa eval` create them: a pool's and colocated ones (share < 1) by engines_on; on GPUs of their own
    OpenRLHF's create_vllm_engines, tensor-parallel ones too (each on one node: the plan; pg None: a group of
    their own)."""
    from openrlhf.trainer.ray import create_vllm_engines

    from openrlhf_mappa.agent_trainer import PoolEngine

    if lora_ranks:
        return engines_on(a, model, pg, share, PoolEngine, enable_lora=True, max_loras=len(lora_ranks),
                          max_lora_rank=placement.pool_max_rank(lora_ranks))
    if share < 1:
        return engines_on(a, model, pg, share)
    v = a.vllm
    return create_vllm_engines(
        v.num_engines, v.tensor_parallel_size, model, a.train.seed, a.train.full_determinism_enable,
        v.enable_prefix_caching, v.enforce_eager, a.data.max_len, pg, v.gpu_memory_utilization, False,
        logprobs_mode="processed_logprobs",
    )


def start_engines(args, topology, team: list, pg_of, share: float, startup) -> dict:
    """{agent: its vLLM engines} (a LoRA pool's once, shared by its agents), each on its placement group (pg_of:
    (owner, component) -> the group of its GPU set), started, and asleep with --vllm.enable_sleep before any
    actor starts (build_agents)."""
    from openrlhf.trainer.ray.vllm_engine import batch_vllm_engine_call

    colocate = args.mappa.colocate
    engines, pools = {}, placement.lora_pools(args, topology)
    for m in team:
        spec, a, label = m.spec, m.args, m.pool
        startup.stage = f"agent {spec.name!r} (creating its engines)"
        if label in engines:  # a LoRA pool's engines, created with its first agent
            engines[spec.name] = engines[label]
            continue
        if label:
            ranks = [member.spec.lora.rank for member in pools[label]]
            engines[label] = engines[spec.name] = new_engines(a, spec.model, pg_of(label, "vllm"), share,
                                                              ranks)
        else:
            engines[spec.name] = new_engines(a, spec.model, pg_of(spec.name, "vllm"), share)
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
    return engines


def build_agents(args, topology, max_steps: dict, startup, allowed=lambda a: True) -> list:
    """Every trainee's engines, actor and reference groups, initialised, and its AgentTrainer. `startup` (a
    StartupWatchdog) is told which agent is being created and, per component, a ref that is ready once that
    one is up. `allowed`: placement.check's, for the changes named when the plan does not fit.

    Each GPU set of the plan has a placement group, its bundles on the plan's nodes (pinned_groups). Colocated
    (--mappa.colocate), an agent's actor rank i, reference rank i and engine i share bundle i of one: the
    agent's (agent), or the team's (team). Their engines are created, and put to sleep
    with --vllm.enable_sleep, before any actor: vLLM sizes its KV cache from the GPU memory free when it starts
    (on the team's GPUs, one agent's engines after another's, for the same reason)."""
    from openrlhf.trainer.ray.launcher import RayActorGroup, ReferenceModelActor
    from openrlhf.trainer.ray.ppo_actor import PolicyModelActor
    from openrlhf.utils import get_strategy
    from transformers import AutoTokenizer

    from openrlhf_mappa.agent_trainer import AdapterOff, AgentTrainer, LoraActor

    plan, nodes = check_placement(args, topology, allowed)
    # Ray gives an actor of less than one CPU (every colocated one) OMP_NUM_THREADS=1, which leaves torch's CPU ops
    # and DeepSpeed's CPU Adam (--ds.adam_offload: the optimizer step of billions of parameters) on one core.
    threads = {"env_vars": {"OMP_NUM_THREADS": str(args.mappa.actor_threads)}}
    threaded = lambda cls: types.SimpleNamespace(options=lambda **kw: cls.options(runtime_env=threads, **kw))
    team = members(args, topology)
    colocate = args.mappa.colocate
    share = placement.gpu_share(args, topology) if colocate != "none" else 1
    pgs = pinned_groups(plan, nodes)
    pg_of = lambda owner, kind: pgs[placement.gpu_set(colocate, f"{owner}/{kind}")]
    engines = start_engines(args, topology, team, pg_of, share, startup)

    agents, init_refs = [], []
    for m in team:
        spec, a = m.spec, m.args
        # The ranks of one ring get the same micro-batches (upstream's duplicate_actors: ring x tensor-parallel size)
        group = lambda count, cls, kind: RayActorGroup(*count, threaded(cls), pg=pg_of(spec.name, kind),
                                                       num_gpus_per_actor=share,
                                                       duplicate_actors=a.ds.ring_attn_size * a.ds.tensor_parallel_size)
        startup.stage = f"agent {spec.name!r} (creating its actors)"
        strategy = get_strategy(a)
        actor_strategy = get_strategy(actor_args(a, spec, topology)) if a.train.dynamic_batch_enable else strategy
        # RayActorGroup calls .options() on its actor type
        actor = group((a.actor.num_nodes, a.actor.num_gpus_per_node), LoraActor if spec.lora else PolicyModelActor,
                      "actor")
        ref = None
        if m.has_reference:
            ref = group((a.ref.num_nodes, a.ref.num_gpus_per_node), ReferenceModelActor, "reference")
            init_refs += ref.async_init_model_from_pretrained(strategy, spec.model)
        elif a.algo.kl.init_coef > 0:  # a LoRA agent's: the base, its own actor with the adapter off
            ref = AdapterOff(actor)
        steps = max_steps[spec.name]  # its learning-rate schedule's length (train_mappa_ray.schedule_steps)
        init_refs += actor.async_init_model_from_pretrained(actor_strategy, spec.model, steps, engines[spec.name])
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


def actor_args(a, spec, topology):
    """Agent `spec`'s args (`a`) as its actor ranks get them. With token budgets, upstream's actor plans for
    rollout.batch_size x n_samples_per_prompt actions a step (one per sample) and leaves any more untrained
    (ReplayBuffer.setup_dynamic_batch); an agent may act several times an episode, so they plan for its most."""
    planned = copy.deepcopy(a)
    planned.rollout.batch_size *= Member(spec, a).most_actions(topology)
    return planned


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
