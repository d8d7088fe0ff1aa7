"""The GPU plan, before any actor starts (`mappa plan`, and the same check at launch): which GPU holds which
agent's actor, reference and vLLM engines, and each GPU's estimated peak memory in each phase of a step
(rollout, experience, train, sync: what sleeps in each, and the placements, in docs/reference.md). A plan that
cannot fit is refused, listing what to change, in order (advice).

Memory per GPU in bytes, at the worst case the flags allow (every action --data.max_len tokens). P parameters,
D data-parallel ranks, b micro-batch, s = --data.max_len, h hidden, L layers, V vocabulary, I intermediate,
k = key/value heads x head dim, TP an engine's tensor-parallel size:
  training states (ZeRO, bf16 with fp32 Adam): weights 2P, gradients 2P, Adam 12P; ZeRO-1 shards Adam over D,
      ZeRO-2 also the gradients, ZeRO-3 also the weights; --ds.adam_offload puts Adam in host memory.
  activations: checkpointed, each layer's input b*s*h*2 (x L) plus one layer recomputed, b*s*(6h + 2k + 4I)*2;
      eager attention adds b*heads*s^2*4 per stored layer. A forward without gradients holds one layer's.
  logits: b*s*V x 10 training (fp32 logits, their fp32 gradient, a bf16 copy), x 6 in a forward pass.
  ring attention (--ds.ring_attn_size r) gives each rank s/r of a sequence's tokens, so activations and logits
      divide by r.
  token budgets (--train.dynamic_batch_enable, packed on GPUs) replace b*s/r by a micro-batch's tokens on a rank,
      max(B*r*TP, s)/r for budget B: --train.max_tokens_per_gpu in training, --rollout.max_tokens_per_gpu in the
      experience forwards (upstream's split fills a ring x tensor-parallel group to B per GPU; a longer action
      goes alone).
  ZeRO-3 gathers two layers' weights at a time; the sync gathers the embedding, V*h*2 (and a CUDA IPC copy).
  a vLLM engine: --vllm.gpu_memory_utilization x the GPU, less weights 2P/TP and an activation reserve (8192
      batched tokens, logits of 256 sequences), is KV cache, 2*L*k*2 / TP bytes per token.
  CUDA context and communication buffers: 1 GiB per process (DeepSpeed rank or engine).
"""

import copy
import functools
import importlib.util
import math
import os
import subprocess
import sys
from dataclasses import dataclass, field

from openrlhf_mappa.topology import VLLM_LORA_RANKS, AgentSpec

GIB = 2**30
PHASES = ("rollout", "experience", "train", "sync")
CONTEXT_GIB = 1.0
GRAPHS_GIB = 0.5  # vLLM's captured graphs, allocated outside --vllm.gpu_memory_utilization's share
HOST_PROCESS_GIB = 2.0  # host memory of one actor or engine process: Python, torch, CUDA and NCCL libraries
DEFAULT_GPUS_PER_NODE = 8
VLLM_BATCHED_TOKENS, VLLM_SEQS = 8192, 256


# Per-agent topology keys that win over a flag: (the key, the flag's group, its name). agent_args applies them,
# and the launch prints each one that changes a flag's value (launch.check_placement).
AGENT_OVERRIDES = (("max_new_tokens", "rollout", "max_new_tokens"), ("vllm_num_engines", "vllm", "num_engines"),
                   ("num_gpus_per_node", "actor", "num_gpus_per_node"), ("ring_attn_size", "ds", "ring_attn_size"),
                   ("tensor_parallel_size", "ds", "tensor_parallel_size"))


def agent_args(args, spec):
    """A per-agent copy of OpenRLHF's args (model, resources, checkpoint/export paths): OpenRLHF's actor,
    checkpoint and sync code read `strategy.args`, so each agent's files and sync group stay apart."""
    a = copy.deepcopy(args)
    a.actor.model_name_or_path = spec.model
    a.actor.adam.lr = spec.lr or args.actor.adam.lr
    for key, group, name in AGENT_OVERRIDES:
        setattr(getattr(a, group), name, getattr(spec, key) or getattr(getattr(args, group), name))
    a.ref.num_gpus_per_node = spec.num_gpus_per_node or args.ref.num_gpus_per_node
    a.ds.packing_samples |= a.ds.ring_attn_size > 1  # a ring splits packed sequences (upstream turns it on too)
    a.ds.load_in_4bit &= spec.lora is not None  # QLoRA: a full-weight agent's weights train, so they stay bf16
    a.ckpt.path = os.path.join(args.ckpt.path, spec.name)
    a.ckpt.max_num = args.ckpt.max_num + 1  # the team's checkpoint stays while the next is saved (rotate_checkpoints)
    a.ckpt.output_dir = os.path.join(args.ckpt.output_dir, spec.name)
    if spec.lora is not None:  # OpenRLHF's actor wraps its model with peft from these
        l = spec.lora
        a.ds.lora.rank, a.ds.lora.alpha, a.ds.lora.dropout = l.rank, l.alpha, l.dropout
        a.ds.lora.target_modules = "all-linear" if l.target_modules == ("all-linear",) else list(l.target_modules)
    # The team logs once (MappaTrainer); each agent's OpenRLHF trainer would open a wandb run of its own.
    a.logger.wandb.key, a.logger.tensorboard_dir = None, None
    return a


def trainee_specs(args, topology) -> list:
    """The agents that own weights: all, or with --mappa.shared_policy only the first, whose policy plays every
    role (the baseline MAPPA's separate weights are compared against). A trained coach
    (--mappa.coach.kind trained) is one more, last: its own engines and actor, as an agent's."""
    c, coach = getattr(args.mappa, "coach", None), []
    if getattr(c, "kind", None) == "trained":
        from openrlhf_mappa.episode import COACH_NAME

        tokens = 1 if c.reply == "digit" else c.max_tokens or None  # one digit (TrainedCoach.attach)
        coach = [AgentSpec(COACH_NAME, c.model, "the team's coach", "", max_new_tokens=tokens, lr=c.lr or None)]
    if not args.mappa.shared_policy:
        return topology.agents + coach
    models = {spec.model for spec in topology.agents}
    if len(models) > 1:
        raise SystemExit(f"--mappa.shared_policy trains one model for every role, but the topology names "
                         f"{len(models)} ({', '.join(sorted(models))}); pick one with --mappa.model")
    return topology.agents[:1]


@dataclass
class Member:
    """One trainee (trainee_specs: an agent whose weights train, or a trained coach) and its own args
    (agent_args). Each per-agent fact is computed here once; the plan, the launch, the CLI, the doctor and the
    trainer read it (launch.Agent is a Member with its processes)."""

    spec: AgentSpec
    args: object

    @property
    def actor_gpus(self) -> int:
        return self.args.actor.num_nodes * self.args.actor.num_gpus_per_node

    @property
    def ref_gpus(self) -> int:
        return self.args.ref.num_nodes * self.args.ref.num_gpus_per_node

    @property
    def has_reference(self) -> bool:
        """A reference group of its own: with KL on, a full-weight agent's (a LoRA agent's is its actor,
        adapter off)."""
        return self.args.algo.kl.init_coef > 0 and self.spec.lora is None

    @property
    def pool(self):
        """A LoRA agent's engine pool, labelled by its name or its base model's last path part; None: engines
        of its own."""
        if self.spec.pool:
            return f"pool {os.path.basename(self.spec.pool.rstrip('/'))}"

    def most_actions(self, topology) -> int:
        """The most actions its weights take in one episode: its max_actions, or every role's (under
        --mappa.shared_policy, and a trained coach's, which judges every action); at most
        max_episode_actions."""
        n = (sum(a.max_actions for a in topology.agents) if self.args.mappa.shared_policy
             or self.spec not in topology.agents else self.spec.max_actions)
        return min(n, topology.max_episode_actions or n)

    def schedule_steps(self, topology, num_tasks: int) -> int:
        """Its learning-rate schedule's length in optimizer steps, by --mappa.lr_horizon: "authors" as their
        base_controller.py (a member taking more steps runs past its end, where transformers' cosine rises
        again); "max_actions" the most steps it can take (most_actions, so its schedule ends at its last
        step)."""
        t, r = self.args.train, self.args.rollout
        if self.args.mappa.lr_horizon == "authors":
            return max(1, t.num_episodes * (num_tasks * r.n_samples_per_prompt // t.batch_size
                                            * t.max_epochs))
        return (num_tasks // r.batch_size * t.num_episodes * t.max_epochs
                * max(1, r.batch_size * r.n_samples_per_prompt * self.most_actions(topology) // t.batch_size))


def members(args, topology) -> list:
    """The trainees as Members, in order."""
    return [Member(spec, agent_args(args, spec)) for spec in trainee_specs(args, topology)]


def scored(args) -> bool:
    """Whether the coach is asked about the team's actions: a run-wide fact, not a member's (a process run, or
    an outcome baseline with --mappa.coach.score_outcome_runs, logged and never trained on)."""
    return args.mappa.reward == "process" or args.mappa.coach.score_outcome_runs


def colocation_problems(args, topology) -> list:
    """What --mappa.colocate cannot place, in words. A shared GPU holds one actor rank, reference rank and engine
    of each agent on it, so the three need as many GPUs each; tensor-parallel engines there are not built."""
    if args.mappa.colocate == "none":
        return []
    out, sizes = [], {}
    for m in members(args, topology):
        a, sizes[m.spec.name] = m.args, m.actor_gpus
        if m.has_reference and m.ref_gpus != m.actor_gpus:
            out.append(f"agent {m.spec.name!r}: {m.ref_gpus} reference GPUs, but its actor has "
                       f"{m.actor_gpus}; colocated they share GPUs one rank each (--ref.num_gpus_per_node)")
        if a.vllm.tensor_parallel_size != 1:
            out.append(f"--vllm.tensor_parallel_size {a.vllm.tensor_parallel_size}: colocated engines take one GPU "
                       f"each")
        elif a.vllm.num_engines != m.actor_gpus:
            out.append(f"agent {m.spec.name!r}: {a.vllm.num_engines} vLLM engines on its actor's "
                       f"{m.actor_gpus} GPUs; colocated, one engine per GPU (--vllm.num_engines "
                       f"{m.actor_gpus})")
    pools = lora_pools(args, topology)
    if pools and args.mappa.colocate == "agent":
        out.append(f"LoRA engine pools ({', '.join(pools)}) serve several agents, so they cannot sit on one agent's "
                   f"GPUs: use --mappa.colocate team or none")
    if args.mappa.colocate == "team" and len(set(sizes.values())) > 1:
        out.append("--mappa.colocate team puts every agent on one GPU set, but the agents' actors have different GPU "
                   f"counts ({', '.join(f'{n}: {g}' for n, g in sizes.items())}); give them one num_gpus_per_node")
    return out


def gpu_share(args, topology) -> float:
    """The GPU fraction each colocated model asks Ray for: one over the models a GPU holds (OpenRLHF's 0.2 fits
    one policy's three, not a team's), rounded down to Ray's 1e-4 so a GPU's shares never sum above 1."""
    team = members(args, topology)[: None if args.mappa.colocate == "team" else 1]
    engines = len({m.pool or m.spec.name for m in team})  # a LoRA agent's: its pool's
    models = len(team) + sum(m.has_reference for m in team) + engines
    return int(1e4 / models) / 1e4


@dataclass(frozen=True)
class ModelSize:
    """What the memory model needs of a causal language model, from one build of it on the meta device."""

    kind: str  # config.json's model_type
    params: int
    layer_params: int  # one decoder layer's
    hidden: int
    layers: int
    vocab: int
    heads: int
    kv_dim: int  # key/value heads x head dim
    intermediate: int
    linear_shapes: dict  # (in, out) features of each linear layer of one decoder layer, by name (what LoRA targets)
    linear_names: tuple  # every linear layer's name: one decoder layer's, then the others' (the output head)

    def lora_params(self, rank: int, targets) -> int:
        """An adapter's parameters: A (rank x in) and B (out x rank) per targeted layer, in every decoder layer."""
        shapes = self.linear_shapes
        names = shapes if "all-linear" in targets else [t for t in targets if t in shapes]
        return self.layers * sum(rank * sum(shapes[n]) for n in names)

    @property
    def layer_act(self) -> int:  # activation bytes per token through one decoder layer
        return 2 * (6 * self.hidden + 2 * self.kv_dim + 4 * self.intermediate)


@functools.cache
def model_size(model: str) -> ModelSize:
    """The shapes of a model (a directory or hub id: its config.json, from the cache or fetched alone), from one
    build on the meta device, which allocates nothing: any architecture transformers, or the model's own code,
    builds. Its decoder layers are the module list with one entry per hidden layer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    linear = lambda module: {name.rpartition(".")[2]: (m.in_features, m.out_features)
                             for name, m in module.named_modules() if isinstance(m, torch.nn.Linear)}
    try:
        config = AutoConfig.from_pretrained(model, trust_remote_code=True)
        with torch.device("meta"):
            built = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
        text = config.get_text_config()
        L, h, heads = text.num_hidden_layers, text.hidden_size, text.num_attention_heads
        layer = next(m for m in built.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == L)[0]
        kv = (getattr(text, "num_key_value_heads", None) or heads) * (getattr(text, "head_dim", None) or h // heads)
        shapes, intermediate = linear(layer), text.intermediate_size
    except Exception as e:  # offline and not cached, unknown repo or architecture, not a decoder: said so
        raise ValueError(f"{model}: no shapes from a meta-device build ({type(e).__name__}: {str(e)[:200]})") from None
    return ModelSize(text.model_type, sum(p.numel() for p in built.parameters()),
                     sum(p.numel() for p in layer.parameters()), h, L, text.vocab_size, heads, kv, intermediate,
                     shapes, tuple(sorted(shapes)) + tuple(sorted(set(linear(built)) - set(shapes))))


@dataclass
class Group:
    """One agent's actor, reference or engines: how many GPUs, and what each of its GPUs holds per phase."""

    agent: str
    kind: str  # "actor", "reference", "vllm"
    gpus: int
    tp: int  # GPUs per process: an engine's tensor-parallel size, else 1
    held: dict  # label -> GiB, on each GPU in every phase (what stays while it sleeps)
    adds: dict = field(default_factory=dict)  # phase -> {label: GiB} on top of `held`
    host: dict = field(default_factory=dict)  # label -> GiB of host memory (its node's), per GPU of the group
    notes: list = field(default_factory=list)
    problems: list = field(default_factory=list)  # what cannot work whatever the GPU count (KV cache too small)

    def label(self, i: int) -> str:
        if self.kind == "vllm":
            return f"{self.agent} vLLM engine {i // self.tp}" + (f" (TP rank {i % self.tp})" if self.tp > 1 else "")
        return f"{self.agent} {self.kind} rank {i}/{self.gpus}"


def micro_tokens(a, micro: int, budget) -> float:
    """A micro-batch's tokens on one rank (`a` an agent's args): `micro` sequences of --data.max_len over its ring,
    or with token budgets (packed on GPUs: train_mappa_ray.packing_problems) what upstream's split puts in one, the
    budget on each GPU of a ring x tensor-parallel group, or one longer action alone."""
    ring, s = a.ds.ring_attn_size, a.data.max_len
    if a.train.dynamic_batch_enable:
        return max(budget * ring * a.ds.tensor_parallel_size, s) / ring
    return micro * s / ring


def component_groups(m: Member, size: ModelSize, gpu_gib: float) -> list:
    """A member's groups, by the module docstring's model. A LoRA agent trains its adapter only and has no
    reference group (its actor, adapter off) and no engines of its own (its pool's)."""
    a, name, lora = m.args, m.spec.name, m.spec.lora
    s, h, L, V = a.data.max_len, size.hidden, size.layers, size.vocab
    token_layer = size.layer_act + (size.heads * s * 4 if a.ds.attn_implementation == "eager" else 0)  # + scores
    t = s / a.ds.ring_attn_size  # a sequence's tokens on one rank

    def forward(n: float) -> dict:  # n tokens, no gradients: one layer's activations at a time, then the logits
        return {"activations": n * token_layer / GIB, "logits": n * V * 6 / GIB}

    zero3 = a.ds.zero_stage == 3
    gathered = {"ZeRO-3 gathered layers": 2 * size.layer_params * 2 / GIB} if zero3 else {}
    P, D, tp = size.params, m.actor_gpus, a.ds.tensor_parallel_size
    linear = size.layers * sum(i * o for i, o in size.linear_shapes.values())
    # AutoTP: a rank holds 1/tp of every linear layer, and ZeRO shards its states over the D/tp data-parallel ranks.
    P, Z = P - linear + linear / tp, D / tp
    trained = size.lora_params(lora.rank, lora.target_modules) if lora else P
    shard = lambda nbytes, stage: nbytes / (Z if a.ds.zero_stage >= stage else 1)
    offloads = a.ds.enable_sleep and not a.ds.adam_offload  # OpenRLHF's offload skips an actor whose Adam is on CPU
    if a.ds.adam_offload:  # ZeRO's offloaded optimizer keeps fp32 gradients beside Adam, in pinned host memory
        states = {"gradient buckets": h * h * 4 / GIB}
        host = {"Adam states": shard(12 * trained, 1) / GIB, "fp32 gradients": shard(4 * trained, 1) / GIB}
    else:
        states = {"gradients": shard(2 * trained, 2) / GIB, "Adam states": shard(12 * trained, 1) / GIB}
        host = dict(states) if offloads else {}  # asleep, its states wait in pinned host memory
    n = micro_tokens(a, a.train.micro_batch_size, a.train.max_tokens_per_gpu)
    n_exp = micro_tokens(a, a.rollout.micro_batch_size, a.rollout.max_tokens_per_gpu)
    stored = n * h * 2 * L + n * token_layer if a.actor.gradient_checkpointing_enable else n * token_layer * L
    largest = V * h * 2 / GIB  # the embedding, the largest tensor the sync gathers
    ipc = a.mappa.colocate != "none" and a.vllm.sync_backend == "nccl"  # OpenRLHF's colocated sync: CUDA IPC
    base = 2 * P
    if a.ds.load_in_4bit:  # QLoRA: bitsandbytes' nf4 linear layers, 4 bits and a byte of scale per 64; the rest bf16
        base -= linear * (2 - 0.5 - 1 / 64)
    weights = {"weights": shard(base, 3) / GIB, **({"adapter": shard(2 * trained, 3) / GIB} if lora else {})}
    actor = Group(name, "actor", D, 1, {**weights, **({} if offloads else states), "CUDA context": CONTEXT_GIB}, {
        "experience": {**forward(n_exp), **gathered},
        "train": {**(states if offloads else {}), "activations": stored / GIB, "logits": n * V * 10 / GIB,
                  **gathered},
        "sync": {} if lora else {**({"gathered embedding": largest} if zero3 else {}),
                                 **({"its CUDA IPC copy": largest} if ipc else {})},
    }, host={**host, "process": HOST_PROCESS_GIB})
    if lora:
        actor.notes.append(f"LoRA rank {lora.rank} on {', '.join(lora.target_modules)}: {trained / 1e6:.1f}M trained "
                           f"parameters ({100 * trained / P:.2f}% of the model); a sync sends "
                           f"{2 * trained / 2**20:.0f} MiB, not {2 * P / 2**20:.0f} MiB")
        if a.algo.kl.init_coef > 0:
            actor.notes.append("reference log-probs: this actor with the adapter off (no reference group)")
        if a.ds.load_in_4bit:
            actor.notes.append(f"4-bit base (QLoRA): {base / GIB:.1f} GiB of weights in all, not {2 * P / GIB:.1f}; "
                               f"its pool's engines serve the bf16 base")
    if tp > 1:
        actor.notes.append(f"tensor parallelism (DeepSpeed AutoTP): every linear layer split over {tp} ranks, ZeRO-"
                           f"{a.ds.zero_stage} over {Z:.0f} data-parallel ranks; activations counted whole")
    if a.train.dynamic_batch_enable:
        actor.notes.append(f"token budgets: a micro-batch holds {n:.0f} tokens on a rank in training, {n_exp:.0f} in "
                           f"the experience forwards (--train/--rollout.max_tokens_per_gpu)")
    if a.ds.ring_attn_size > 1:
        actor.notes.append(f"ring attention: its ranks in rings of {a.ds.ring_attn_size}, each holding {t:.0f} of a "
                           f"sequence's {s} tokens (the reference's too)")
    if a.ds.adam_offload:
        actor.notes.append(f"Adam states and fp32 gradients in host memory: {sum(host.values()):.1f} GiB per rank")
    if offloads:
        actor.notes.append("--ds.enable_sleep: gradients and Adam states on CPU outside the train phase")
    elif a.ds.enable_sleep:
        actor.notes.append("--ds.enable_sleep offloads nothing with --ds.adam_offload (OpenRLHF skips it)")
    groups = [actor]
    if m.has_reference:
        R = m.ref_gpus
        weights = 2 * P / (R if zero3 else 1) / GIB
        held = {"weights": 0.0 if a.ref.offload else weights, "CUDA context": CONTEXT_GIB}
        groups.append(Group(name, "reference", R, 1, held, {"experience": {**forward(n_exp), **gathered}},
                            host={**({"weights": weights} if a.ref.offload else {}), "process": HOST_PROCESS_GIB}))
    return groups if lora else groups + [engine_group(a, name, size, gpu_gib)]


def engine_group(a, name: str, size: ModelSize, gpu_gib: float, adapters: list = ()) -> Group:
    """The vLLM engines of one agent, or of a LoRA pool (`name` the pool's, `adapters` its agents' Lora): the
    base once, and for LoRA a slot per agent at the pool's max_lora_rank on every targeted layer."""
    s, tp = a.data.max_len, a.vllm.tensor_parallel_size
    weights = 2 * size.params / tp / GIB
    if adapters:  # vLLM allocates max_loras slots of max_lora_rank on each module any adapter targets
        targets = sorted({t for lora in adapters for t in lora.target_modules})
        rank = pool_max_rank([lora.rank for lora in adapters])
        weights += len(adapters) * 2 * size.lora_params(rank, targets) / tp / GIB
    reserve = (VLLM_BATCHED_TOKENS * size.layer_act + VLLM_SEQS * size.vocab * 4) / tp / GIB
    kv = max(a.vllm.gpu_memory_utilization * gpu_gib - weights - reserve, 0.0)
    label = "weights" + (f" + {len(adapters)} LoRA slots" if adapters else "")
    awake = {label: weights, "activation reserve": reserve, "KV cache": kv}
    # Outside vLLM's share of the GPU: the CUDA context, and its captured CUDA graphs unless --vllm.enforce_eager.
    outside = {"CUDA context": CONTEXT_GIB, **({} if a.vllm.enforce_eager else {"CUDA graphs": GRAPHS_GIB})}
    gpus = a.vllm.num_engines * tp
    if a.vllm.enable_sleep:  # level 1: weights to CPU, KV cache dropped; the sync wakes the weights alone
        engines = Group(name, "vllm", gpus, tp, outside, {"rollout": awake, "sync": {label: weights}},
                        host={label: weights, "process": HOST_PROCESS_GIB})
        engines.notes.append("--vllm.enable_sleep: asleep outside the rollout (its weights in host memory); the sync "
                             "wakes its weights alone")
    else:
        engines = Group(name, "vllm", gpus, tp, {**awake, **outside}, host={"process": HOST_PROCESS_GIB})
    tokens = int(kv * GIB / (2 * size.layers * size.kv_dim * 2 / tp))  # K and V, bf16, per layer
    engines.notes.append(f"KV cache {kv:.1f} GiB = {tokens} tokens = {tokens // s} sequences of {s} per engine")
    if tokens < s:
        engines.problems.append(f"{name}'s vLLM engines: {a.vllm.gpu_memory_utilization:g} x {gpu_gib:g} GiB leaves "
                                f"{kv:.1f} GiB of KV cache, {tokens} tokens, fewer than one --data.max_len "
                                f"sequence ({s}); vLLM would refuse to start")
    return engines


def pool_max_rank(ranks: list) -> int:
    """The max_lora_rank of a pool's engines: the smallest vLLM accepts that holds its largest adapter."""
    return min(r for r in VLLM_LORA_RANKS if r >= max(ranks))


def lora_pools(args, topology) -> dict:
    """LoRA engine pools of the trainees, in the agents' order: pool label (Member.pool) -> its Members."""
    pools = {}
    for m in members(args, topology):
        if m.pool:
            pools.setdefault(m.pool, []).append(m)
    return pools


PLACEMENTS = {
    "none": "each agent's actor, reference and vLLM engines on GPUs of their own",
    "agent": "each agent's actor, reference and vLLM engines share that agent's GPUs (--mappa.colocate agent)",
    "team": "every agent's actor, reference and vLLM engines share the team's GPUs (--mappa.colocate team)",
}


def gpu_set(colocate: str, component: str) -> str:
    """The GPU set of a component (`agent/kind`, as Plan.counts keys them): which components share GPUs. None
    colocated, each its own; per agent, the agent's; for a team, all."""
    return {"none": component, "agent": component.rpartition("/")[0], "team": ""}[colocate]


def set_label(key: str) -> str:
    """A GPU set in words: the team's GPUs, an agent's (colocated), or one component of an agent's."""
    if "/" not in key:
        return f"agent {key!r}'s GPUs" if key else "the team's GPUs"
    owner, kind = key.rsplit("/", 1)
    return f"{owner}'s {'vLLM engines' if kind == 'vllm' else kind}"


def total(gpus):
    return sum(gpus) if isinstance(gpus, list) else gpus


def slot_label(slot: list) -> str:
    """What one GPU holds, in words (`problem_solver: actor, reference, vLLM engine #0` for rank i of each)."""
    agents = list(dict.fromkeys(g.agent for g, _ in slot))
    kinds = list(dict.fromkeys(g.kind for g, _ in slot))
    if len(slot) > 1 and len({i for _, i in slot}) == 1 and len(slot) == len(agents) * len(kinds):
        who = agents[0] if len(agents) == 1 else f"{len(agents)} agents"
        return f"{who}: {', '.join({'vllm': 'vLLM engine'}.get(k, k) for k in kinds)} #{slot[0][1]}"
    return " + ".join(g.label(i) for g, i in slot)


@dataclass
class Plan:
    counts: dict  # "agent/component" -> GPUs
    groups: list  # every agent's (and LoRA pool's) groups in build order, none when the GPU memory is not known
    sizes: dict  # agent -> (model, its ModelSize or why it is not known)
    gpu_gib: float
    colocate: str = "none"
    refused: list = field(default_factory=list)  # what the colocation cannot place (colocation_problems)
    host_gib: object = None  # host memory of a node, or of each (a list, as Ray's nodes report it); None: unchecked
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE  # a node's GPUs where the cluster is a count, or none is given
    tp: int = 1  # an engine's tensor-parallel GPUs, which stay on one node

    @functools.cached_property
    def slots(self) -> list:
        """GPU slots in build order, each the (group, index) pairs it holds. Colocated, rank i of the groups sharing
        GPUs sits on slot i of their set, as the trainer puts them on bundle i of one placement group."""
        sets = {}
        for g in self.groups:
            sets.setdefault(gpu_set(self.colocate, f"{g.agent}/{g.kind}"), []).append(g)
        return [[(g, i) for g in gs if i < g.gpus] for gs in sets.values() for i in range(max(g.gpus for g in gs))]

    def sets(self) -> dict:
        """GPU set (gpu_set) -> its GPUs: the components that share GPUs, as many as the largest of them."""
        sets = {}
        for key, n in self.counts.items():
            k = gpu_set(self.colocate, key)
            sets[k] = max(sets.get(k, 0), n)
        return sets

    @property
    def need(self) -> int:
        return sum(self.sets().values())

    def node_sizes(self, gpus) -> list:
        """GPUs of each node: Ray's nodes as given (a list), else `gpus` in nodes of gpus_per_node; none when no
        cluster is given (place adds nodes of gpus_per_node as the plan needs them)."""
        per = self.gpus_per_node
        if gpus is None or isinstance(gpus, list):
            return list(gpus or [])
        return [per] * (gpus // per) + [gpus % per] * (gpus % per > 0)

    def place(self, gpus=None) -> dict:
        """GPU set -> the node of each of its GPUs (None: beyond the cluster). An agent's sets together where a
        node has room (its weight sync stays inside the node), else each set alone; largest first, each on the
        fullest node with room for it, so that whole nodes stay free for larger ones. A set no node has room for
        spreads over the nodes with the most free GPUs, an engine's tensor-parallel GPUs on one node. The
        launch's placement groups follow it (launch.pinned_groups)."""
        per, free = self.gpus_per_node, self.node_sizes(gpus)
        grow = gpus is None  # no cluster given: as many nodes of `per` as the plan needs

        def one_node(n: int):
            if grow and n <= per and max(free, default=0) < n:
                free.append(per)
            room = [k for k, f in enumerate(free) if f >= n]
            return min(room, key=lambda k: free[k]) if room else None

        def spread_over(n: int, chunk: int) -> list:
            nodes = []
            while len(nodes) < n:
                k = max(range(len(free)), key=lambda k: free[k], default=None)
                if k is None or free[k] < chunk:  # no node has room for one chunk: a new one, or beyond the cluster
                    if not (grow and chunk <= per):
                        return nodes + [None] * (n - len(nodes))
                    free.append(per)
                    k = len(free) - 1
                take = min(free[k] // chunk * chunk, n - len(nodes))
                nodes, free[k] = nodes + [k] * take, free[k] - take
            return nodes

        owners, out = {}, {}
        for key, n in self.sets().items():
            owners.setdefault(key.rpartition("/")[0] if self.colocate == "none" else key, {})[key] = n
        for parts in sorted(owners.values(), key=lambda parts: -sum(parts.values())):
            together = one_node(sum(parts.values()))
            for key, n in sorted(parts.items(), key=lambda kv: -kv[1]):
                k = together if together is not None else one_node(n)
                if k is None:
                    out[key] = spread_over(n, self.tp if self.colocate == "none" and key.endswith("/vllm") else 1)
                else:
                    out[key], free[k] = [k] * n, free[k] - n
        return {key: out[key] for key in self.sets()}  # build order

    def nodes(self, gpus=None) -> list:
        """Per node that holds a GPU slot, in order, and last None for the slots beyond the cluster: (the node, its
        slots' indices, {label: GiB of host memory its processes need})."""
        placed, out = self.place(gpus), {}
        for i, slot in enumerate(self.slots):
            first, index = slot[0]  # a slot's groups share one GPU set, so one node
            node = placed[gpu_set(self.colocate, f"{first.agent}/{first.kind}")][index]
            indices, need = out.setdefault(node, ([], {}))
            indices.append(i)
            for g, _ in slot:
                for label, gib in g.host.items():
                    need[f"{g.kind} {label}"] = need.get(f"{g.kind} {label}", 0.0) + gib
        return [(k, *out[k]) for k in sorted(out, key=lambda k: (k is None, k))]

    def across_nodes(self, gpus=None) -> list:
        """What crosses nodes, in words: a GPU set no node has room for (an actor group or colocated set then
        spans nodes), and an agent whose engines are on other nodes than its actor (its weight sync crosses)."""
        placed, out = self.place(gpus), []
        on = lambda nodes: ", ".join(map(str, sorted(set(nodes) - {None})))
        largest = max(self.node_sizes(gpus) or [self.gpus_per_node])
        for key, nodes in placed.items():
            if len(set(nodes) - {None}) > 1:
                why = f"more than a node's {largest}" if len(nodes) > largest else "no node has room for all"
                out.append(f"{set_label(key)}: {len(nodes)} GPUs on nodes {on(nodes)} ({why})")
        for owner in dict.fromkeys(key.rpartition("/")[0] for key in placed) if self.colocate == "none" else ():
            actor, engines = (placed.get(f"{owner}/{kind}", []) for kind in ("actor", "vllm"))
            if actor and engines and set(actor) != set(engines):
                out.append(f"{owner}: actor on node {on(actor)}, vLLM engines on node {on(engines)}: its weight sync "
                           f"crosses nodes")
        return out

    def host_of(self, node: int):
        return self.host_gib[node] if isinstance(self.host_gib, list) else self.host_gib

    def host_problems(self, gpus=None) -> list:
        return [f"node {k} ({len(slots)} GPUs) needs {sum(need.values()):.0f} GiB of host memory, more than its "
                f"{self.host_of(k):g} GiB: " + ", ".join(f"{label} {gib:.0f}" for label, gib in need.items())
                for k, slots, need in self.nodes(gpus)
                if k is not None and self.host_of(k) and sum(need.values()) > self.host_of(k)]

    def peak(self, slot: list, phase: str) -> float:
        """What the GPU holds plus what the phase adds. Engines generate at once; a GPU's experience forwards
        run one at a time, and a team's agents train and sync in turn."""
        adds = {}
        for g, _ in slot:
            unit = {"rollout": None, "experience": id(g)}.get(phase, g.agent)
            adds[unit] = adds.get(unit, 0.0) + sum(g.adds.get(phase, {}).values())
        return sum(sum(g.held.values()) for g, _ in slot) + max(adds.values(), default=0.0)

    def memory_problems(self) -> list:
        """What does not fit the GPUs' memory: a group's own (a KV cache too small), then each GPU over its memory,
        once per group of alike GPUs (the same groups' ranks)."""
        out, seen = [p for g in self.groups for p in g.problems], set()
        for i, slot in enumerate(self.slots):
            phase = max(PHASES, key=lambda p: self.peak(slot, p))
            key = tuple(id(g) for g, _ in slot)
            if self.peak(slot, phase) > self.gpu_gib and key not in seen:
                seen.add(key)
                out.append(f"GPU {i} ({slot_label(slot)}) needs {self.peak(slot, phase):.1f} GiB in the {phase} "
                           f"phase, more than its {self.gpu_gib:g} GiB")
        return out

    def problems(self, gpus=None) -> list:
        out = list(self.refused)
        if gpus is not None and self.need > total(gpus):
            detail = ", ".join(f"{k}: {n}" for k, n in self.counts.items())
            what = {"none": "the requested actor groups and vLLM engines",
                    "agent": "the agents' actor groups and vLLM engines, each agent on GPUs of its own that they share",
                    "team": "the team's actor groups and vLLM engines, on GPUs they all share"}[self.colocate]
            out.append(f"not enough GPUs: {what} need {self.need} GPUs but the cluster has {total(gpus)} ({detail})")
        elif any(None in nodes for nodes in self.place(gpus).values()):
            sizes = self.node_sizes(gpus) or [self.gpus_per_node]
            out.append(f"the vLLM engines' tensor-parallel groups ({self.tp} GPUs each, on one node) fit no node's "
                       f"free GPUs on nodes of {', '.join(map(str, sizes))} GPUs")
        return out + self.memory_problems() + self.host_problems(gpus)


def make_plan(args, topology, gpu_gib: float = None, sizes: dict = None) -> Plan:
    """The plan for these flags and topology. `sizes` (agent -> ModelSize) skips reading config.json;
    without `gpu_gib` only the GPU counts are planned."""
    counts, groups, known = {}, [], {}
    for m in members(args, topology):
        spec, a = m.spec, m.args
        counts[f"{spec.name}/actor"] = m.actor_gpus
        if m.has_reference:
            counts[f"{spec.name}/reference"] = m.ref_gpus
        if not m.pool:
            counts[f"{spec.name}/vllm"] = a.vllm.num_engines * a.vllm.tensor_parallel_size
        size = (sizes or {}).get(spec.name)
        if size is None and gpu_gib is not None:  # the memory check needs the sizes; the count check does not
            try:
                size = model_size(spec.model)
            except ValueError as e:
                size = f"memory not estimated: {e}"
        known[spec.name] = (spec.model, size)
        if gpu_gib is not None and isinstance(size, ModelSize):
            groups += component_groups(m, size, gpu_gib)
    for pool, team in lora_pools(args, topology).items():  # one engine group per pool, after its actors
        a = team[0].args
        counts[f"{pool}/vllm"] = a.vllm.num_engines * a.vllm.tensor_parallel_size
        size = known[team[0].spec.name][1]
        if gpu_gib is not None and isinstance(size, ModelSize):
            engines = engine_group(a, pool, size, gpu_gib, [m.spec.lora for m in team])
            base = 2 * size.params / team[0].actor_gpus / GIB
            engines.notes += [f"serves {', '.join(m.spec.name for m in team)}: the base model once, each "
                              f"agent's adapter by request (max_loras {len(team)}, max_lora_rank "
                              f"{pool_max_rank([m.spec.lora.rank for m in team])})",
                              f"actors: one group per agent, {len(team)} x {base:.1f} GiB of base weights "
                              f"per actor rank; one group per base model would hold {base:.1f} GiB but train "
                              f"them in turn"]
            groups.append(engines)
    return Plan(counts, groups, known, gpu_gib, args.mappa.colocate, colocation_problems(args, topology),
                args.mappa.host_memory_gib, args.mappa.gpus_per_node or DEFAULT_GPUS_PER_NODE,
                args.vllm.tensor_parallel_size)


# A change is a list of settings (section, key, value), as the flags that make them: `--ds.adam_offload` for
# True, `without --ref.offload` for False, `--vllm.num_engines 1` otherwise.


def flags(args, settings: list) -> str:
    """The flags of the settings that differ from `args`."""
    changed = [(s, k, v) for s, k, v in settings if getattr(getattr(args, s), k) != v]
    return " ".join(f"without --{s}.{k}" if v is False else f"--{s}.{k}" + ("" if v is True else f" {v}")
                    for s, k, v in changed)


def with_changes(args, settings: list):
    a = copy.deepcopy(args)
    for section, key, value in settings:
        setattr(getattr(a, section), key, value)
    return a


def memory_flags(args) -> list:
    """The memory savings OpenRLHF offers and MAPPA honours, not yet on, that cost no GPU, in the order to try them:
    sleep first when colocated (what colocation is for), Adam on CPU and ring attention last. Whether the launcher
    takes one (a ring's ranks must divide the agent's GPUs and batches) is advice's `accepts`."""
    micro = [("train", "micro_batch_size", 1), ("rollout", "micro_batch_size", 1)]
    if args.train.dynamic_batch_enable:  # budgets replace the counts: one --data.max_len action, as a micro-batch of 1
        micro = [(part, "max_tokens_per_gpu", args.data.max_len) for part in ("train", "rollout")
                 if (getattr(args, part).max_tokens_per_gpu or 0) > args.data.max_len]
    out = [("vllm", "enable_sleep", True), ("ds", "enable_sleep", True)] * (args.mappa.colocate != "none")
    # Last, a ring of twice the ranks on the same GPUs (each holds half of a sequence's activations and logits):
    # it needs ring-flash-attn's kernels and halves the data-parallel ranks.
    out += [("actor", "gradient_checkpointing_enable", True), ("ds", "zero_stage", 3), *micro,
            *[("ref", "offload", True)] * (args.algo.kl.init_coef > 0), ("ds", "adam_offload", True),
            ("ds", "ring_attn_size", 2 * args.ds.ring_attn_size)]
    return [(s, k, v) for s, k, v in out if getattr(getattr(args, s), k) != v]


def colocation(args, topology, mode: str) -> list:
    """The settings of a placement: colocated, sleep on; a team's engines, all awake in the rollout, split the
    GPU share the flags give one engine."""
    out = [("mappa", "colocate", mode)] + [(s, "enable_sleep", True) for s in ("vllm", "ds")]
    if mode == "team":
        share = args.vllm.gpu_memory_utilization / len(trainee_specs(args, topology))
        out.append(("vllm", "gpu_memory_utilization", math.floor(share * 100 + 1e-9) / 100))
    return out


def advice(args, topology, plan: Plan, gpus, allowed) -> list:
    """What to change where the plan does not fit, as a numbered list, each change one the launcher accepts
    (`allowed`, its own validation, and the placement's): for too few GPUs, the GPUs it needs or a placement that
    shares them; for GPU memory, the savings not yet on, each applied on top of those above it with the peak it
    leaves, down to the first that fits, else more GPUs; for host memory, the offloads back on the GPUs, or other
    nodes. No layout is searched: how many more GPUs hold a model is no formula (ZeRO divides the states, a ring
    the activations and logits, tensor parallelism an engine's weights), so `mappa plan` checks each count asked."""
    accepts = lambda a: allowed(a) and not colocation_problems(a, topology)
    sizes, out = {name: size for name, (_, size) in plan.sizes.items()}, []

    def then(settings: list, count: bool) -> tuple:
        """The plan with these settings in words (its GPUs where `count`, its largest GPU peak), and whether it
        fits: wholly where `count`, else its GPU memory."""
        changed = make_plan(with_changes(args, settings), topology, plan.gpu_gib, sizes)
        fits = not (changed.problems(gpus) if count else changed.memory_problems())
        most = max((changed.peak(slot, phase) for slot in changed.slots for phase in PHASES), default=0.0)
        said = [f"{changed.need} GPUs"] * count + ([f"at most {most:.1f} GiB a GPU"] if changed.slots else [])
        return ", ".join(said + ["fits"] * fits), fits

    if gpus is not None and plan.need > total(gpus):
        out.append(f"a cluster of {plan.need} GPUs, or fewer GPUs per agent (--actor.num_gpus_per_node, "
                   f"--ref.num_gpus_per_node, --vllm.num_engines)")
        for mode in ("agent", "team")[("none", "agent", "team").index(plan.colocate):]:
            shared = colocation(args, topology, mode)
            if accepts(with_changes(args, shared)):
                out.append(f"or {flags(args, shared)}: {then(shared, count=True)[0]}")
    if plan.memory_problems():
        applied, fits = [], False
        for saving in memory_flags(args):
            if fits or not accepts(with_changes(args, applied + [saving])):
                continue
            said, fits = then(applied + [saving], count=False)
            out.append(f"{'then ' * bool(applied)}{flags(args, [saving])}: {said}")
            applied.append(saving)
        if not fits:
            out.append(f"{'or ' * bool(out)}more GPUs: more actor and reference ranks shard ZeRO's states "
                       f"(--actor.num_gpus_per_node, --ref.num_gpus_per_node), a ring of r ranks holds 1/r of each "
                       f"sequence's activations and logits (--ds.ring_attn_size r), tensor-parallel engines split "
                       f"their weights (--vllm.tensor_parallel_size); `mappa plan` checks each count")
    if plan.host_problems(gpus):
        for s, k in (("ref", "offload"), ("ds", "adam_offload"), ("vllm", "enable_sleep")):
            if getattr(getattr(args, s), k) and accepts(with_changes(args, [(s, k, False)])):
                out.append(f"{'or ' * bool(out)}without --{s}.{k} (host memory back for GPU memory): "
                           f"{then([(s, k, False)], count=True)[0]}")
        most = max(sum(need.values()) for k, _, need in plan.nodes(gpus) if k is not None)
        out.append(f"{'or ' * bool(out)}nodes with at least {math.ceil(most)} GiB of host memory, or fewer GPUs per "
                   f"node (--mappa.gpus_per_node, with more nodes)")
    return ["What to change, in this order:"] * bool(out) + [f"  {i}. {line}" for i, line in enumerate(out, 1)]


def check(args, topology, gpus, gpu_gib: float = None, sizes: dict = None, allowed=lambda a: True) -> Plan:
    """The plan, or ValueError naming what does not fit and what to change (advice). `gpus`: the cluster's count
    (in nodes of --mappa.gpus_per_node), or each node's (Ray's). `allowed`: whether the launcher accepts changed
    flags (train_mappa_ray.accepted), so that no change named is one it would then refuse (sleep for a trained
    coach, colocation under async)."""
    plan = make_plan(args, topology, gpu_gib, sizes)
    problems = plan.problems(gpus)
    if not problems:
        return plan
    cluster = f"{total(gpus) if gpus is not None else 'the'}{f' x {gpu_gib:g} GiB' if gpu_gib else ''} GPUs"
    lines = [f"the plan does not fit {cluster}:"] + [f"  - {p}" for p in problems]
    raise ValueError("\n".join(lines + advice(args, topology, plan, gpus, allowed)))


def format_plan(plan: Plan, gpus=None) -> str:
    """The table (node, GPU, what it holds, GiB per phase) and, per agent, what the numbers are made of."""
    placed, nodes = plan.place(gpus), plan.nodes(gpus)
    out = [f"{'node':>4} {'GPU':>4}  {'holds':<50}" + "".join(f"{p:>11}" for p in PHASES) + "   (GiB, peak per phase)"]
    for node, indices, _ in nodes:
        for local, slot in enumerate(plan.slots[i] for i in indices):
            where = f"{node:>4} {local:>4}" if node is not None else f"{'-':>4} {'-':>4}"
            mark = "  <- beyond the cluster's GPUs" if node is None else ""
            out.append(f"{where}  {slot_label(slot):<50}" + "".join(f"{plan.peak(slot, p):>11.1f}" for p in PHASES)
                       + mark)
    if not plan.slots:  # GPU memory not known: the counts only, and which of them share GPUs
        on = lambda nodes: "beyond the cluster" if None in nodes else (
            f"node{'s' * (len(set(nodes)) > 1)} {', '.join(map(str, sorted(set(nodes))))}")
        out = [f"{n:>4}  GPUs: {label}, on {on(placed[gpu_set(plan.colocate, label)])}"
               for label, n in plan.counts.items()]
        out += [f"placement: {PLACEMENTS[plan.colocate]}"] * (plan.colocate != "none")
    used = len({k for on in placed.values() for k in on if k is not None})
    out.append(f"total: {plan.need} GPUs" + (f" of the cluster's {total(gpus)}" if gpus is not None else "")
               + f" on {used} node{'s' * (used != 1)}")
    out += [f"across nodes: {line}" for line in plan.across_nodes(gpus)]
    if plan.colocate != "none" and plan.slots:
        turns = "the largest agent's (they train and sync in turn)" if plan.colocate == "team" else "its agent's"
        out.append(f"A shared GPU holds what its models keep plus what the phase adds: every engine's in the rollout,\n"
                   f"the largest forward's in the experience phase, {turns} in train and sync")
    for k, slots, need in [node for node in nodes if node[0] is not None]:  # offloads, sleeping engines
        of = f" of its {plan.host_of(k):g}" if plan.host_of(k) else " (not checked: --mappa.host_memory_gib)"
        out.append(f"host memory, node {k} ({len(slots)} GPUs): {sum(need.values()):.1f} GiB{of}: "
                   + ", ".join(f"{label} {gib:.1f}" for label, gib in need.items()))
    # Per agent, then per LoRA engine pool, what each group's GPUs hold in each phase, its host memory and notes;
    # an agent whose lines are another's of the same model says so instead.
    summed = lambda parts: " + ".join(f"{k} {v:.1f}" for k, v in parts.items())
    lines = {}  # owner (an agent, or a LoRA engine pool) -> its groups' lines
    for g in plan.groups:
        own = lines.setdefault(g.agent, [])
        own.append(f"  {g.kind}, {g.gpus} GPU{'s' * (g.gpus > 1)}, each: {summed(g.held)} = {sum(g.held.values()):.1f} "
                   f"GiB held")
        own += [f"    {phase} adds {summed(extra)}" for phase, extra in g.adds.items() if extra]
        own.append(f"    host memory, each: {summed(g.host)} = {sum(g.host.values()):.1f} GiB")
        own += [f"    {note}" for note in g.notes]
    seen = {}  # an agent's model and lines -> the first agent with them
    for name, (model, size) in plan.sizes.items():
        own = lines.pop(name, [])
        if isinstance(size, str):  # why the memory of this agent's components is not estimated
            out.append(f"\n{name}: {model}: {size}")
        elif own and (model, *own) in seen:
            out.append(f"\n{name}: {model}, the same as {seen[model, *own]}")
        elif own:
            seen[model, *own] = name
            out += [f"\n{name}: {model}, {size.params / 1e9:.2f}B parameters ({size.layers} layers, hidden "
                    f"{size.hidden}, vocabulary {size.vocab})"] + own
    for pool, own in lines.items():  # the LoRA engine pools
        out += [f"\n{pool}:"] + own
    return "\n".join(out)


def host_memory_gib(available: bool = False) -> float:
    """This machine's memory, or its container's limit (cgroup v2 memory.max) where lower; `available`: what
    is available now (MemAvailable)."""
    if available:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) * 1024 / GIB
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        total = min(total, int(limit)) if limit.isdigit() else total
    except OSError:
        pass
    return total / GIB


def usable_cores(cgroup: str = "/sys/fs/cgroup") -> int:
    """The cores this process may use: its CPU affinity, within its container's CPU quota, where
    os.cpu_count() counts every core of the host. The quota as Ray's own count reads it: cgroup v2's cpu.max
    ("QUOTA PERIOD" or "max PERIOD"), else cgroup v1's cpu/cpu.cfs_quota_us over cpu/cpu.cfs_period_us (-1:
    none)."""
    cores = len(os.sched_getaffinity(0))
    try:
        with open(os.path.join(cgroup, "cpu.max")) as f:
            quota, period = f.read().split()
    except (OSError, ValueError):  # no cgroup v2 here: v1's files, or the affinity alone
        try:
            with open(os.path.join(cgroup, "cpu", "cpu.cfs_quota_us")) as f:
                quota = f.read().strip()
            with open(os.path.join(cgroup, "cpu", "cpu.cfs_period_us")) as f:
                period = f.read().strip()
        except OSError:
            return cores
    if quota not in ("max", "-1"):
        cores = min(cores, max(1, int(quota) // int(period)))
    return cores


def ring_size(args, topology=None) -> int:
    """The largest ring of ring attention over the agents: the flag, or an agent's topology ring_attn_size."""
    specs = topology.agents if topology else []
    return max([agent_args(args, spec).ds.ring_attn_size for spec in specs] or [args.ds.ring_attn_size])


def needed_modules(args, topology=None) -> dict:
    """{module: (what needs it, the fix)} for the kernels the flags need: flash attention's, ring attention's, QLoRA's.
    OpenRLHF imports without them (patches/flash_attn_stub.py), so a missing one fails only in every actor, minutes
    in: checked on the launcher's machine (cli.check_this_machine) and on every GPU node (launch.check_placement)."""
    attention, out = args.ds.attn_implementation, {}
    kernel = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}.get(attention)
    if kernel:
        out[kernel] = (f"--ds.attn_implementation {attention} needs flash-attn's kernels",
                       "install flash-attn (`pip install flash-attn==2.8.3 --no-build-isolation`, built for the torch "
                       "and CUDA there) or pass --ds.attn_implementation sdpa (more memory at long contexts)")
    ring = ring_size(args, topology)
    if ring > 1:
        out["ring_flash_attn"] = (f"--ds.ring_attn_size {ring} runs ring-flash-attn's kernels",
                                  "`pip install ring_flash_attn` (it needs flash-attn)")
    if args.ds.load_in_4bit:
        out["bitsandbytes"] = ("--ds.load_in_4bit quantizes with bitsandbytes",
                               "`pip install bitsandbytes` (OpenRLHF lists it)")
    return out


def broken_modules(modules) -> dict:
    """{module: why} for each of `modules` this Python cannot import. A found module is imported for real, in a
    subprocess (no kernels loaded here): a flash-attn wheel built for another torch is found, then fails to import."""
    out = {m: "is not installed" for m in modules if importlib.util.find_spec(m) is None}
    for m in [m for m in modules if m not in out]:
        proc = subprocess.run([sys.executable, "-c", f"import {m}"], capture_output=True, text=True, timeout=600)
        if proc.returncode:
            out[m] = f"fails to import ({(proc.stderr.strip().splitlines() or ['no message'])[-1][:300]})"
    return out


def module_refusals(needed: dict, broken: dict, where: str) -> list:
    """The refusal for each of `broken`'s modules (broken_modules) on the machine `where` names."""
    return [f"{needed[m][0]}, and the module {m} {why} {where}: {needed[m][1]}" for m, why in broken.items()]


def node_check(modules) -> tuple:
    """Run on each GPU node (launch.check_placement, one Ray task per node): (its usable cores, {module: why} for
    each of `modules` that fails to import there, its GPUs (node_gpus))."""
    return usable_cores(), broken_modules(modules), node_gpus()


def node_gpus() -> list:
    """[(GiB, compute mode)] of this node's GPUs as nvidia-smi lists them ([] without it). It lists them in a
    task that holds none (Ray hides them from CUDA there): a CPU head without --mappa.gpu_memory_gib still
    plans the GPUs' memory, and a GPU that admits one process (Exclusive_Process) is named before any actor
    starts."""
    query = ["nvidia-smi", "--query-gpu=memory.total,compute_mode", "--format=csv,noheader,nounits"]
    try:
        proc = subprocess.run(query, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):  # no NVIDIA driver here
        return []
    rows = ([line.split(",") for line in proc.stdout.splitlines() if line.strip()]
            if proc.returncode == 0 else [])
    return [(int(mib) / 1024, mode.strip()) for mib, mode in rows]


def detect_gpus():
    """(GPU count, GiB of the first GPU) of this machine's accelerator, or (None, None) without one."""
    import torch

    if not torch.accelerator.is_available():
        return None, None
    # Device properties, not memory info: a query that allocates nothing on a GPU an actor will want.
    props = torch.get_device_module(torch.accelerator.current_accelerator()).get_device_properties(0)
    return torch.accelerator.device_count(), props.total_memory / GIB
