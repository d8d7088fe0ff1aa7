"""`mappa doctor`: the cluster self-check before a long job. With the training command's flags and a small
model (--mappa.model), it builds the launch's placement, engines and actors, runs one step of each and checks
what CPU tests cannot: each agent's weights reach its own engines only, sleep frees GPU memory, a LoRA reload
shows in generation, thread counts, host memory; before them, the plan of the recipe's own models on this
cluster and DeepSpeed's CPU Adam on each GPU node (the coach's one request comes from the cli, before Ray). A
table; exit 1 on any failure.

Each agent trains one step on a text of its own at lr 1e-2 (constant, no warm-up), so its weights are visibly
its own: in bf16, the recipe's 1e-6 would move nothing an engine's log-probs could show.
"""

import copy
import os
import time

import ray
import torch

from openrlhf_mappa import placement, rewards
from openrlhf_mappa.episode import Action

# nats per probe token: the least bound of an engine against its own actor (a median: one token a bf16
# rounding step apart cannot decide it); an actor moved, agents' weights apart. NEARER: how much nearer an
# engine must be to its actor's new log-probs than to its old ones (sync_verdicts).
SAME, APART, NEARER = 0.02, 0.05, 0.25
PROBE = "Probe: 7 + 5 = 12, the answer is 12."


def probe(agents, text: str = PROBE) -> dict:
    """Per agent, the log-probs of `text` under its engines ("engines"; "engine": engine 0's), its actor
    ("actor"; "actor_ranks": per rank) and, for LoRA, its base under the actor ("base") and engine 0
    ("engine_base"). Sleeping engines are woken first."""
    from openrlhf.trainer.ray.vllm_engine import batch_vllm_engine_call
    from vllm import SamplingParams

    from openrlhf_mappa.launch import distinct

    batch_vllm_engine_call(distinct([e for ag in agents for e in ag.engines]), "wake_up")
    ids = agents[0].tokenizer(text)["input_ids"]
    out = {"probe": ids, "engine": {}, "engines": {}, "actor": {}, "actor_ranks": {}}
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    seq = torch.tensor([ids])
    # of each next token
    logprobs = lambda gen: [d[t].logprob for t, d in zip(ids[1:], gen.prompt_logprobs[1:])]
    for ag in agents:
        adapter = ag.trainer.adapter  # a LoRA agent: its pool's engines, with its adapter
        gens = ray.get([e.generate_as.remote(adapter, ids, params) if adapter
                        else e.generate.remote(ids, params) for e in ag.engines])
        out["engines"][ag.spec.name] = list(map(logprobs, gens))
        out["engine"][ag.spec.name] = out["engines"][ag.spec.name][0]
        ranks = len(ag.actor._actor_handlers)  # one copy per data-parallel rank
        forward = dict(method_name="forward", sequences=[seq] * ranks,
                       attention_mask=[torch.ones_like(seq)] * ranks,
                       action_mask=[torch.ones(1, len(ids) - 1, dtype=torch.bool)] * ranks)
        # vLLM's prompt log-probs are the raw model's, while the actor divides its logits by
        # --rollout.temperature: the actor is probed at temperature 1 (else at 0.7 a synced engine would seem
        # to hold other weights)
        temperature = lambda self, t=1.0: (self.actor.temperature, setattr(self.actor, "temperature", t))[0]
        was = ray.get([h.__ray_call__.remote(temperature) for h in ag.actor._actor_handlers])
        per_rank = [r[0].float().tolist() for r in ray.get(ag.actor.async_run_method_batch(**forward))]
        out["actor"][ag.spec.name], out["actor_ranks"][ag.spec.name] = per_rank[0], per_rank
        if adapter:  # and the base it trains on, with the adapter off: its reference (when β > 0)
            base = ray.get(ag.actor.async_run_method_batch(**dict(forward, method_name="forward_base")))[0][0]
            out.setdefault("base", {})[ag.spec.name] = base.float().tolist()
            g = ray.get(ag.engines[0].generate.remote(ids, params))  # alone: no LoRA request batched with it
            out.setdefault("engine_base", {})[ag.spec.name] = logprobs(g)
        ray.get([h.__ray_call__.remote(temperature, t) for h, t in zip(ag.actor._actor_handlers, was)])
    return out


def sync_verdicts(before: dict, after: dict, quantized=()) -> dict:
    """Per agent, (ok, detail) from two probes, before and after the step: every engine of the agent holds its
    actor's weights after the sync, the actor moved (the step trained), and no engine holds another agent's
    actor's weights.

    An engine and its actor differ even on the same weights (vLLM's kernels against transformers', in bf16: up
    to 0.32 nats on one token of Qwen3-1.7B on GPU, vllm#18352), and the doctor's step (lr 1e-2 on every
    weight) inflates the logits and that rounding with them, so a noise floor measured on the untouched model
    does not bound the gap after it. "Holds" is judged within the `after` probe alone, scale-free: each
    engine's gap to its actor's new log-probs is under NEARER times its gap to the old ones (at least SAME),
    both medians over the probe's tokens, and nearer the new than the old in means. The floor before the step
    (median and max) and the max after it are reported, not gated on. "Moved" is a mean (an outlier token only
    adds to what must be large there); "crossed": an engine nearer another agent's actor than its own, or
    within APART of it (medians). A `quantized` agent's actor (QLoRA) runs on a 4-bit base, its engines on the
    bf16 one: 1.5 times the gap of the two bases with the adapters off (after the step) is added to its bound
    (an adapter's effect does not add across bases: a trained one can close the gap, or widen it: 0.1185 nats
    against 0.0975 adapters off, once)."""
    gap = lambda a, b: (torch.tensor(a) - torch.tensor(b)).abs()
    median = lambda a, b: gap(a, b).median().item()
    out = {}
    for name, actor in after["actor"].items():
        engines, old = after["engines"][name], before["actor"][name]
        slack = 1.5 * median(after["base"][name], after["engine_base"][name]) if name in quantized else 0.0
        floors = [(median(e, old), gap(e, old).max().item()) for e in before.get("engines", {}).get(name, [])]
        gaps = [(median(e, actor), max(SAME, NEARER * median(e, old)) + slack) for e in engines]
        arrived, bound = max(gaps)
        nearer = all(gap(e, actor).mean() < gap(e, old).mean() for e in engines)  # what slack cannot hide
        held = all(g < b for g, b in gaps) and nearer
        moved = gap(actor, old).mean().item()  # means: a larger outlier only adds to what must be large
        others = {o: min(median(e, other) for e in engines)
                  for o, other in after["actor"].items() if o != name}
        crossed = [o for o, other in after["actor"].items() if o != name
                   and any(median(e, other) < max(APART, median(e, actor)) for e in engines)]
        why = f"{NEARER:g} x its gap to the old weights"
        why += f" + 1.5 x {slack / 1.5:.4f}: the 4-bit base is {slack / 1.5:.4f} off theirs" if slack else ""
        largest = max(gap(e, actor).max().item() for e in engines)
        floor = (f"; on the same weights before the step {max(f[0] for f in floors):.4f} (median), "
                 f"{max(f[1] for f in floors):.4f} (max)" if floors else "")
        out[name] = (held and moved > APART and not crossed,
                     f"engines vs its actor {arrived:.4f} nats (median; bound {bound:.4f}: {why}; max "
                     f"{largest:.4f}){floor}, actor moved {moved:.3f} (mean)"
                     + ("" if held else "; an engine has not arrived at its actor's new weights")
                     + ("" if nearer else " (it is nearer the old ones)")
                     + (f", other agents' actors {min(others.values()):.3f} away (median)" if others else "")
                     + (f"; holds the weights of {', '.join(crossed)}" if crossed else ""))
    return out


def device_memory_gib():
    """(free, total) GiB of this process's accelerator, as its driver reports them (None without one)."""
    if not torch.accelerator.is_available():
        return None
    free, total = torch.get_device_module(torch.accelerator.current_accelerator()).mem_get_info()
    return free / placement.GIB, total / placement.GIB


def train_one_step(ag, args):
    """One real step of an agent (OpenRLHF's experience maker, whitening, train_step and sync) on
    train.batch_size copies of two replies to a text of its own, one rewarded, one not."""
    tok = ag.tokenizer
    prompt = tok(f"Who are you? {ag.spec.name} or nobody?")["input_ids"]
    actions = []
    for i in range(args.train.batch_size):  # its own name rewarded: each agent's update is its own
        a = Action(f"doctor-{i}", ag.spec.name, 0, prompt,
                   tok([f" {ag.spec.name}.", " nobody."][i % 2])["input_ids"])
        a.reward = float(i % 2 == 0)
        actions.append(a)
    batch = {ag.spec.name: rewards.experiences(ag.trainer.experience_maker, actions)}
    rewards.compute_advantages(batch, args.algo.kl.init_coef, scope="agent")
    return ag.trainer.train_step(batch[ag.spec.name], 1)[0]


def run_checks(args, topology, agents) -> list:
    """(check, agent, ok or None for skipped, detail) for every check."""
    from openrlhf.trainer.ray.vllm_engine import batch_vllm_engine_call
    from vllm import SamplingParams

    from openrlhf_mappa.launch import components, distinct, gpu_nodes, owners

    rows, trainees = [], owners(agents)
    gpus = [n for _, n in gpu_nodes()]
    plan = placement.make_plan(args, topology, args.mappa.gpu_memory_gib)
    nodes = plan.nodes(gpus)
    for k, slots, need in nodes:
        planned, total = sum(need.values()), plan.host_of(k)
        here = placement.host_memory_gib()
        rows.append(("host memory", f"node {k}", planned <= total,
                     f"planned {planned:.1f} of {total:.1f} GiB ({len(slots)} GPUs); this node now uses "
                     f"{here - placement.host_memory_gib(available=True):.1f} of {here:.1f}"))
    if not nodes:
        rows.append(("host memory", "-", None, "skipped: no memory plan without the GPUs' memory (CPU mode)"))
    threads = args.mappa.actor_threads  # as the launch set it (launch.check_placement)
    for name, what, h in components(agents):
        if "vLLM" in what:
            continue
        seen = ray.get(h.__ray_call__.remote(lambda self: (os.environ.get("OMP_NUM_THREADS"),
                                                           torch.get_num_threads())))
        rows.append(("threads", name, seen == (str(threads), threads),
                     f"{what}: OMP_NUM_THREADS={seen[0]}, torch {seen[1]} threads (planned {threads})"))

    before = probe(agents)
    sampling = SamplingParams(max_tokens=8, temperature=1.0)
    for ag in trainees:
        ids, engine = ag.tokenizer("Hello")["input_ids"], ag.engines[0]
        out = ray.get(engine.generate_as.remote(ag.trainer.adapter, ids, sampling) if ag.trainer.adapter else
                      engine.generate.remote(ids, sampling))
        n = len(out.outputs[0].token_ids)
        rows.append(("generate", ag.spec.name, n > 0, f"{n} tokens sampled from engine 0"))
    if args.vllm.enable_sleep:  # the rollout ends with the engines asleep, as the team loop leaves them
        batch_vllm_engine_call(distinct([e for ag in trainees for e in ag.engines]), "sleep")
    for ag in trainees:  # in turn: on shared GPUs they would be, and the timings read per agent
        t0 = time.time()
        status = train_one_step(ag, args)
        rows.append(("train step", ag.spec.name, True, f"{time.time() - t0:.1f} s in all: train "
                     f"{status['timing/ppo_train']:.1f} s, sync {status['timing/broadcast']:.1f} s"))
    after = probe(agents)
    quantized = [ag.spec.name for ag in trainees if ag.trainer.adapter] if args.ds.load_in_4bit else []
    for name, (ok, detail) in sync_verdicts(before, after, quantized).items():
        rows.append(("weights synced", name, ok, detail))
    for ag in trainees:
        if ag.trainer.adapter:  # the adapter after its reload, against the engine's base: generation changed
            n = ag.spec.name
            gap = (torch.tensor(after["engine"][n])
                   - torch.tensor(after["engine_base"][n])).abs().mean().item()
            rows.append(("LoRA reload", n, gap > APART,
                         f"engine with the adapter vs without: {gap:.3f} nats (mean)"))
    rows += sleep_checks(args, trainees)
    return rows


def sleep_checks(args, trainees) -> list:
    """On GPUs: the accelerator's free memory, as its driver reports it, before and after each engine sleeps
    and each actor offloads; each must free at least half of what the plan says it holds. Skipped without one.
    Read inside the engine and the actor: a driver on a CPU-only head node (`ray job submit`) sees no GPU, and
    --mappa.gpu_memory_gib may be unset."""
    from openrlhf.trainer.ray.vllm_engine import batch_vllm_engine_call

    if not (args.vllm.enable_sleep or args.ds.enable_sleep):
        return []
    memory = lambda h: ray.get(h.__ray_call__.remote(lambda self: device_memory_gib()))  # (free, total) GiB
    rows = []
    for ag in trainees:
        engine, actor = ag.engines[0], ag.actor._actor_handlers[0]
        if memory(actor) is None:
            rows.append(("sleep frees memory", ag.spec.name, None,
                         "skipped: no GPU here (on CPU sleep frees nothing)"))
            continue
        if args.vllm.enable_sleep:
            batch_vllm_engine_call([engine], "wake_up")
            awake, total = memory(engine)
            batch_vllm_engine_call([engine], "sleep")
            freed, expect = memory(engine)[0] - awake, 0.5 * args.vllm.gpu_memory_utilization * total
            rows.append(("sleep frees memory", ag.spec.name, freed >= expect,
                         f"engine 0: {freed:.1f} GiB freed (at least {expect:.1f} expected of its "
                         f"{total:.1f} GiB GPU)"))
        if args.ds.enable_sleep and not args.ds.adam_offload:
            # What the optimizer holds, as the plan counts it (placement.component_groups): a LoRA agent's
            # adapter.
            size, lora = placement.model_size(ag.spec.model), ag.spec.lora
            trained = size.lora_params(lora.rank, lora.target_modules) if lora else size.params
            states = 14 * trained / ag.actor_gpus / placement.GIB
            # Every rank: both end in a barrier over the agent's DeepSpeed ranks, where rank 0 alone would
            # wait out the process group's 60-minute timeout (OpenRLHF's deepspeed_utils).
            ray.get(ag.actor.async_run_method("reload_states"))
            loaded = memory(actor)[0]
            ray.get(ag.actor.async_run_method("offload_states"))
            freed = memory(actor)[0] - loaded
            rows.append(("offload frees memory", ag.spec.name, freed >= 0.5 * states,
                         f"actor rank 0: {freed:.1f} GiB freed (gradients and Adam states: {states:.1f})"))
    return rows


def cpu_adam() -> tuple:
    """On one GPU node, with a GPU as an actor has: (ok, detail) for DeepSpeed's CPU Adam (--ds.adam_offload).
    Unless DeepSpeed was installed with it (DS_BUILD_CPU_ADAM=1), DeepSpeed compiles it on first use, in every
    actor, and refuses a system CUDA toolkit whose version differs from torch's (compat.toolkit_problem):
    found here, before any actor, and built once into the extensions cache the actors then load from."""
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder import CPUAdamBuilder

    from openrlhf_mappa.compat import toolkit_problem

    prebuilt = bool(installed_ops.get("cpu_adam"))
    problem = None if prebuilt else toolkit_problem()
    if problem:
        return False, f"{problem}; or drop --ds.adam_offload"
    t0 = time.time()
    try:
        CPUAdamBuilder().load()
    except Exception as e:  # any failure of a C++ build: the compiler's, ninja's, a link error
        return False, (f"DeepSpeed's cpu_adam op did not build or load: {type(e).__name__}: {str(e)[-300:]} "
                       f"(the build's output is in the doctor's log): fix the build, or install DeepSpeed "
                       f"with DS_BUILD_CPU_ADAM=1 (built with it), or drop --ds.adam_offload")
    took = time.time() - t0
    return True, ("prebuilt in DeepSpeed, loads" if prebuilt else
                  f"not prebuilt: compiled on first use, or loaded from torch's extensions cache, in "
                  f"{took:.0f} s; the actors load it from there")


def recipe_plan(args, recipe, allowed) -> tuple:
    """The row for the plan of the recipe's own models (the topology's, where --mappa.model gave every agent
    the small one), checked as the launch would check it against this cluster's nodes
    (launch.check_placement)."""
    from openrlhf_mappa.launch import check_placement

    models = ", ".join(sorted({spec.model for spec in recipe.agents}))
    try:
        plan, nodes = check_placement(copy.deepcopy(args), recipe, allowed)
    except SystemExit as e:
        return ("recipe's plan", "-", False,
                f"{models}: " + str(e.code).removeprefix("[mappa] ").replace("\n", "; "))
    return ("recipe's plan", "-", True,
            f"{models}: fits {plan.need} of the cluster's {sum(n for _, n in nodes)} GPUs")


def format_rows(rows: list) -> str:
    mark = {True: "ok", False: "FAIL", None: "skipped"}
    lines = [f"{'check':<22}{'agent':<18}{'result':<9}detail"]
    lines += [f"{check:<22}{agent:<18}{mark[ok]:<9}{detail}" for check, agent, ok, detail in rows]
    failed = sum(ok is False for *_, ok, _ in rows)
    return "\n".join(lines + [f"\n[mappa] doctor: {len(rows)} checks, {failed} failed"])


def doctor(args, topology, rows=(), recipe=None, allowed=lambda a: True) -> int:
    """Start the team as the launch would, run the checks, print the table; 1 on any failure. `rows`: checks
    made before Ray (the coach's one request); `recipe`: the topology with its own models, planned on this
    cluster (`allowed`: placement.check's for it)."""
    from openrlhf_mappa.console import console
    from openrlhf_mappa.health import StartupWatchdog
    from openrlhf_mappa.launch import build_agents, gpu_nodes, on_each_node, owners

    # One step at a visible learning rate (the module docstring), a trained coach's too (its --mappa.coach.lr,
    # 0: the actors'); nothing is saved.
    args.actor.adam.lr, args.actor.lr_warmup_ratio, args.actor.lr_scheduler = 1e-2, 0.0, "constant"
    args.mappa.coach.lr = 0.0
    args.ckpt.load_enable, args.ckpt.save_steps = False, -1
    if not ray.is_initialized():
        ray.init(runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    rows = list(rows) + ([recipe_plan(args, recipe, allowed)] if recipe else [])
    if args.ds.adam_offload:  # before any actor: each would compile it, or fail to (and with it the doctor)
        verdicts = on_each_node(cpu_adam, gpu_nodes(), gpus=1)
        rows += [("CPU Adam", f"node {k}", ok, detail) for k, (ok, detail) in enumerate(verdicts)]
        if not all(ok for ok, _ in verdicts):
            print(format_rows(rows), file=console.out, flush=True)
            return 1
    startup = StartupWatchdog(args.mappa.startup_warn_s, args.mappa.startup_timeout_s,
                              [a.model for a in topology.agents])
    startup.start()
    try:
        agents = build_agents(args, topology, {m.spec.name: 1 for m in placement.members(args, topology)},
                              startup)
    finally:
        startup.done.set()
    rows.append(("placement", "-", True,
                 f"{len(owners(agents))} agents' engines and actors started, as planned"))
    rows += run_checks(args, topology, agents)
    print(format_rows(rows), file=console.out, flush=True)
    return 1 if any(ok is False for *_, ok, _ in rows) else 0
