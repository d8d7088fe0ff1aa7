"""Train a MAPPA team: `python -m openrlhf_mappa.cli.train_mappa_ray` with OpenRLHF's flags plus `--mappa.*`.

OpenRLHF's flags and checks are train_ppo_ray's own main block, run minus its `train(args)` with MAPPA's flags
added to the same parser (flags.py), so every OpenRLHF flag means here what it means there. Every input is
checked before the heavy imports, before Ray starts and before anything is written: a bad one is refused with
its message alone (exit 1; argparse's errors exit 2), the run directory left as it was. MAPPA_TRACEBACK=1 adds
the traceback.
"""

import argparse
import asyncio
import contextlib
import functools
import json
import os
import sys
import tempfile

from openrlhf_mappa.cli.flags import add_coach_args, add_trained_coach_args, parse_args, refusals


def refuse(problems: list, error: type = SystemExit) -> None:
    """One refusal naming every problem found (a '' is none; a repeat, such as a run-wide flag's for each
    agent, once), each on its own line with its fix: a launch with several mistakes names them all at once,
    not one per launch. `error`: a `mappa` tool's ValueError (refusals)."""
    problems = list(dict.fromkeys(why for why in problems if why))
    if len(problems) > 1:
        problems = [f"{len(problems)} problems:", *(f"- {why}" for why in problems)]
    if problems:
        raise error("\n".join(problems))


def validate(args, topology) -> None:
    """The flags against each other and the topology, before Ray: every problem of the tables below in one
    refusal. A rule reading a value an earlier rule refuses (no token limit, a ring that does not divide the
    GPUs) waits for it. The coach template's check and OpenRLHF's PolicyLoss (its own ValueError; it loads
    torch) run once all passed."""
    from openrlhf_mappa.placement import members, scored

    trainees = members(args, topology)[: len(topology.agents)]  # a trained coach's: trained_coach_problems
    coach, advantage = args.mappa.coach, args.algo.advantage
    trained = trained_coach_problems(args, topology) if coach.kind == "trained" else []
    refuse(run_problems(args, topology, trainees) + parallel_problems(args, trainees)
           + token_limit_problems(args, topology) + algo_problems(args) + coach_kind_problems(coach)
           + trained)
    topology.check_coach_template(args.mappa.topology, coach.kind, coach.mode, scored(args))
    if advantage.is_correction_level != "off":
        # its own checks of the correction's settings, before any actor
        from openrlhf.models.loss import PolicyLoss

        PolicyLoss(policy_loss_type=args.actor.policy_loss_type,
                   is_correction_level=advantage.is_correction_level,
                   is_correction_mode=advantage.is_correction_mode,
                   is_correction_gating=advantage.is_correction_gating,
                   is_correction_threshold=advantage.is_correction_threshold)


def run_problems(args, topology, trainees: list) -> list:
    """The engines, the tasks, each step's batches, the start-up's clocks, LoRA's settings and the coach's
    against --mappa.reward."""
    d, m, ds, c = args.data, args.mappa, args.ds, args.mappa.coach
    # --data.prompt_probs as OpenRLHF's blend (interleave_datasets) takes it: one weight per dataset, summing
    # to 1.
    datasets, probs = (d.prompt_dataset or "").split(","), d.prompt_probs
    try:
        weights = list(map(float, probs.split(","))) if probs else []
    except ValueError:
        weights = []
    blended = not probs or (len(weights) == len(datasets) and min(weights) >= 0
                            and abs(sum(weights) - 1) <= 1e-6)
    lora = ", ".join(spec.name for spec in topology.agents if spec.lora is not None)
    rules = [
        (not args.vllm.num_engines,
         "MAPPA generates with vLLM: set --vllm.num_engines (per agent; a topology may override it)"),
        (not d.prompt_dataset, "--data.prompt_dataset: the tasks (a file, a dataset folder or a Hub name; "
                               "several comma-separated) are required"),
        (d.prompt_dataset and not blended,
         f"--data.prompt_probs {probs}: give one probability per dataset of --data.prompt_dataset "
         f"({len(datasets)}: {', '.join(datasets)}), each at least 0, summing to 1"),
        (m.startup_warn_s > m.startup_timeout_s, f"--mappa.startup_warn_s ({m.startup_warn_s:g}) must be at "
                                                 f"most --mappa.startup_timeout_s ({m.startup_timeout_s:g})"),
        # QLoRA: LoRA agents' bases in 4 bits (agent_args); 4-bit weights cannot train, so full-weight agents
        # stay bf16.
        (ds.load_in_4bit and not any(m.spec.lora is not None for m in trainees),
         "--ds.load_in_4bit trains LoRA adapters on a 4-bit base (QLoRA), and no agent declares lora in the "
         "topology: its full weights cannot train in 4 bits"),
        (ds.load_in_4bit and ds.param_dtype != "bf16", "--ds.load_in_4bit computes in bf16 (OpenRLHF's "
                                                       "bitsandbytes config): use --ds.param_dtype bf16, not "
                                                       f"{ds.param_dtype}"),
        (lora and args.vllm.tensor_parallel_size > 1, f"agents {lora} declare lora: {LORA_ENGINES_TP}"),
        # Under async a pool's engines keep serving while an adapter reloads: vLLM's prefix-cache reset then
        # does nothing (other requests hold blocks), and the cache is keyed by the adapter's name, which a
        # reload keeps.
        (lora and args.train.async_enable and args.vllm.enable_prefix_caching,
         f"agents {lora} declare lora: with --train.async_enable their pool's engines keep generating while "
         "an adapter reloads, so --vllm.enable_prefix_caching could serve an agent KV cache computed with "
         "its old adapter (vLLM keys it by adapter name): drop --vllm.enable_prefix_caching, or train "
         "synchronously (no --train.async_enable)"),
        (c.mode != "per_action" and m.reward == "outcome" and not c.score_outcome_runs,
         f"--mappa.coach.mode {c.mode}: an outcome run asks no coach; add --mappa.coach.score_outcome_runs "
         "to log the coach's verdicts anyway"),
        (c.score_outcome_runs and m.reward != "outcome",
         "--mappa.coach.score_outcome_runs is for --mappa.reward outcome "
         "(process runs always ask the coach)"),
    ]
    problems = [why for bad, why in rules if bad]
    # A step trains whole --train.batch_size batches (rewards.batch_rule): an agent with fewer actions a step
    # would never train. Under --mappa.shared_policy the one trainee trains on every role's actions.
    for member in trainees:
        most = args.rollout.batch_size * args.rollout.n_samples_per_prompt * member.most_actions(topology)
        if most < args.train.batch_size:
            problems.append(f"agent {member.spec.name!r} takes at most {most} actions a step "
                            "(--rollout.batch_size x --rollout.n_samples_per_prompt x its actions per "
                            f"episode), fewer than --train.batch_size ({args.train.batch_size}): it would "
                            "never train (a step trains whole batches)")
    return problems


def token_limit_problems(args, topology) -> list:
    """A prompt gets --data.max_len minus its agent's token limit: with no room left, every action is skipped
    (train and `mappa eval`)."""
    problems = []
    for spec in topology.agents:
        limit = spec.max_new_tokens or args.rollout.max_new_tokens
        where = (f"agent {spec.name!r}: its max_new_tokens in the topology" if spec.max_new_tokens
                 else "--rollout.max_new_tokens")
        if limit is None:
            problems.append(f"--rollout.max_new_tokens is required (agent {spec.name!r} sets no "
                            "max_new_tokens in the topology): the token limit of one action; its prompt gets "
                            "--data.max_len minus it")
        elif limit >= args.data.max_len:
            problems.append(f"{where} ({limit}) must be below --data.max_len ({args.data.max_len}), which "
                            "holds the prompt and the reply together: no prompt would fit, and every action "
                            "would be skipped")
    return problems


# LoRA engines take one GPU each: the rule for the topology's LoRA agents (validate) and exported adapters
# (`mappa eval`), refused where --vllm.tensor_parallel_size is above 1.
LORA_ENGINES_TP = ("their pool's engines take one GPU each (--vllm.tensor_parallel_size 1; tensor-parallel "
                   "LoRA engines are not built)")


# The coach flags an LLM coach reads (openai, and trained: its own model and its reference judge's server).
# Given to a kind that does not read them, a flag changes nothing, silently: a coach URL without
# --mappa.coach.kind openai would train on the offline heuristic coach, the default.
LLM_COACH_FLAGS = ("model", "base_url", "api_key_env", "timeout", "max_concurrency", "max_retries", "rpm",
                   "structured", "max_tokens", "format_retries", "price_in", "price_out")


@functools.cache
def coach_flags() -> tuple:
    """({every --mappa.coach.* flag's last name: its default}, the trained coach's flags' names), read once
    from their arguments (coach_kind_problems; tests build coaches from the defaults)."""
    coach, trained = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_coach_args(coach)
    add_trained_coach_args(trained)
    defaults = {a.dest.rpartition(".")[2]: a.default for p in (coach, trained) for a in p._actions
                if a.dest != "help"}
    return defaults, tuple(a.dest.rpartition(".")[2] for a in trained._actions if a.dest != "help")


def coach_kind_problems(c) -> list:
    """A coach flag (of `c`, args.mappa.coach), off its default, that --mappa.coach.kind does not read, naming
    the kind that does."""
    defaults, trained = coach_flags()
    readers = {**{key: ("openai", "trained") for key in LLM_COACH_FLAGS},
               **{key: ("trained",) for key in trained}}
    given = [key for key, kinds in readers.items()
             if c.kind not in kinds and getattr(c, key) != defaults[key]]
    if not given:
        return []
    # a kind reading them all
    kinds = [k for k in ("openai", "trained") if all(k in readers[key] for key in given)]
    what = {"heuristic": "the default: the offline rule-based demo coach",
            "openai": "an OpenAI-compatible server", "trained": "a coach model trained with the team"}
    fix = " or ".join(f"--mappa.coach.kind {k} ({what[k]})" for k in kinds)
    them = "them" if len(given) > 1 else "it"
    return [f"{', '.join('--mappa.coach.' + key for key in given)}: read by the {' and '.join(kinds)} "
            f"coach{'es' * (len(kinds) > 1)} only, and --mappa.coach.kind is {c.kind} ({what[c.kind]}), "
            f"which would score every action while ignoring {them}: use {fix}, or drop {them}"]


def trained_coach_problems(args, topology) -> list:
    """--mappa.coach.kind trained: one more trainee (placement.trainee_specs), judging each action as it
    comes."""
    from openrlhf_mappa.coach.trained import TERMS
    from openrlhf_mappa.episode import COACH_NAME

    c, m = args.mappa.coach, args.mappa
    rules = [
        (not c.model, "give the coach's model: --mappa.coach.model (an HF hub id or a local directory)"),
        (c.mode != "per_action", "it judges each action as it comes (mode per_action); hindsight reviews by "
                                 f"a trained coach are not built, so not --mappa.coach.mode {c.mode}"),
        (m.reward != "process", "it trains on the verdicts of process runs only (--mappa.reward process)"),
        (m.shared_policy, "with --mappa.shared_policy is not built (the baseline's one policy plays every "
                          "role)"),
        (args.vllm.enable_sleep, "with --vllm.enable_sleep is not built: its engines judge the last actions "
                                 "after the agents are done, when the team's engines go to sleep"),
        (COACH_NAME in [spec.name for spec in topology.agents], "the topology has an agent named "
                                                                f"{COACH_NAME!r}, the trained coach's name: "
                                                                "rename that agent"),
        (bool(set(c.terms.split(",")) - set(TERMS)), f"--mappa.coach.terms {c.terms}: each of "
                                                     f"{', '.join(TERMS)}"),
        (c.reference_kind == "openai" and not (c.reference_model and c.base_url),
         "an openai reference judge needs --mappa.coach.reference_model and --mappa.coach.base_url"),
        # (no token limit, None, is token_limit_problems' refusal)
        ((c.max_tokens or args.rollout.max_new_tokens or 0) >= args.data.max_len,
         "its reply limit (--mappa.coach.max_tokens, else --rollout.max_new_tokens) must be below "
         f"--data.max_len ({args.data.max_len})"),
        (c.reply == "digit" and args.algo.advantage.is_correction_level != "off",
         "with --mappa.coach.reply digit, vLLM's sampling log-probs are over the ten digits and the actor's "
         "over the vocabulary, so no importance-sampling correction can apply to it: "
         "--algo.advantage.is_correction_level off"),
    ]
    return [f"--mappa.coach.kind trained: {why}" for bad, why in rules if bad]


def parallel_problems(args, trainees: list) -> list:
    """Each agent's train batch is split over its data-parallel ranks (a topology may give an agent its own
    GPU count) in micro-batches. The ranks of one ring or tensor-parallel group share theirs (upstream's
    duplicate_actors): an agent's GPUs hold whole groups, and its data-parallel ranks are its GPUs / group
    size."""
    from openrlhf_mappa.compat import cpu_mode

    problems, packing = [], []
    for m in trainees:
        spec, a = m.spec, m.args
        ring, tp = a.ds.ring_attn_size, a.ds.tensor_parallel_size
        gpus = {"actor": m.actor_gpus}
        if m.has_reference:
            gpus["reference"] = m.ref_gpus
        rules = [
            (tp > 1 and a.ds.zero_stage == 3, f"tensor parallelism ({tp}) is DeepSpeed's AutoTP, which "
                                              "trains with ZeRO stages 0-2 only (under ZeRO-3 transformers "
                                              "refuses to load the model): pass --ds.zero_stage 2"),
            (tp > 1 and args.ds.param_dtype != "bf16", f"tensor parallelism ({tp}) trains in bf16 "
                                                       "(OpenRLHF's AutoTP): use --ds.param_dtype bf16, not "
                                                       f"{args.ds.param_dtype}"),
            (tp > 1 and spec.lora is not None, f"tensor parallelism ({tp}) with LoRA is not built: AutoTP "
                                               "would split the base under peft's adapter layers, and the "
                                               "adapter syncs from one rank; give it tensor_parallel_size 1"),
        ]
        for kind, n in gpus.items():
            rules.append((n % (ring * tp), f"its {n} {kind} GPUs must be a multiple of its ring-attention "
                                           f"size ({ring}) x its tensor-parallel size ({tp}): the ranks of a "
                                           "ring or tensor-parallel group share each micro-batch"))
        ranks = gpus["actor"] // (ring * tp)
        where = ("num_gpus_per_node in the topology" if spec.num_gpus_per_node
                 else "--actor.num_nodes x --actor.num_gpus_per_node")
        where += f" / its ring x tensor-parallel size {ring * tp}" if ring * tp > 1 else ""
        for flag, micro in (("train.micro_batch_size", args.train.micro_batch_size),
                            ("rollout.micro_batch_size", args.rollout.micro_batch_size)):
            rules.append((gpus["actor"] % (ring * tp) == 0 and args.train.batch_size % (micro * ranks),
                          f"--train.batch_size ({args.train.batch_size}) must be a multiple of --{flag} "
                          f"({micro}) x its {ranks} data-parallel actor ranks ({where}) = {micro * ranks}, "
                          "so that every rank gets whole micro-batches"))
        r = args.rollout
        samples = r.batch_size * r.n_samples_per_prompt
        fits = max(1, samples // max(1, ranks))  # a micro-batch size that gives every rank one
        rules.append((gpus["actor"] % (ring * tp) == 0 and samples // r.micro_batch_size < ranks,
                      f"a step's {samples} samples (--rollout.batch_size {r.batch_size} x "
                      f"--rollout.n_samples_per_prompt {r.n_samples_per_prompt}) make "
                      f"{samples // r.micro_batch_size} micro-batches of --rollout.micro_batch_size "
                      f"{r.micro_batch_size}, fewer than its {ranks} data-parallel actor ranks ({where}): "
                      f"lower --rollout.micro_batch_size to {fits} or raise --rollout.batch_size"))
        problems += [f"agent {spec.name!r}: {why}" for bad, why in rules if bad]
        # The run's flags, named at the first agent they fail. A CPU's tiny models train with padded budgets
        # under sdpa (no flash-attn on CPUs).
        if not packing and not cpu_mode():
            packing = packing_problems(a, spec)
    return problems + packing


def packing_problems(a, spec) -> list:
    """On GPUs, token budgets need packing, and packing flash attention (agent `spec`'s args `a`). OpenRLHF's
    budget split balances the sum of lengths: padded, a micro-batch costs its count x its longest action,
    several times the budget with long and short actions mixed. Under sdpa or eager, transformers masks a
    packed row with a dense tokens x tokens mask. The plan (placement.py) counts neither."""
    attention, budget = a.ds.attn_implementation, a.train.max_tokens_per_gpu
    rules = [
        (a.train.dynamic_batch_enable and not a.ds.packing_samples,
         f"--train.dynamic_batch_enable without --ds.packing_samples (agent {spec.name!r}): on GPUs a padded "
         "micro-batch costs its count x its longest action, which the budget (--train.max_tokens_per_gpu "
         f"{budget}) does not bound: pass --ds.packing_samples, with --ds.attn_implementation "
         "flash_attention_2"),
        # (with a ring: check_this_machine's, later)
        (a.ds.packing_samples and "flash_attention" not in attention and a.ds.ring_attn_size == 1,
         f"--ds.packing_samples under --ds.attn_implementation {attention} (agent {spec.name!r}): "
         "transformers masks each packed micro-batch with a dense tokens x tokens mask on GPUs (1 GiB at 32K "
         "tokens), which the plan does not count: pass --ds.attn_implementation flash_attention_2 "
         "(flash-attn installed), or drop --ds.packing_samples (and token budgets, which need it)"),
    ]
    return [why for bad, why in rules if bad]


def algo_problems(args) -> list:
    """OpenRLHF's algorithm and async flags, where MAPPA would otherwise do nothing with them, silently, or
    cannot."""
    algo, m, samples = args.algo, args.mappa, args.rollout.n_samples_per_prompt
    low, high = algo.dynamic_filtering_range
    no_kl = ("needs --algo.kl.init_coef > 0: with 0 no agent has a reference model, so there is no KL to "
             "adapt or to put in the loss")
    rules = [
        (m.norm_scope == "group" and samples < 2,
         "--mappa.norm_scope group compares the samples of each prompt: set --rollout.n_samples_per_prompt "
         ">= 2"),
        (algo.dynamic_filtering_enable and not low < high,
         f"--algo.dynamic_filtering_range {low:g} {high:g}: the low end must be below the high end"),
        (algo.dynamic_filtering_enable and samples < 2,
         "--algo.dynamic_filtering_enable compares the samples of each task: set "
         "--rollout.n_samples_per_prompt >= 2"),
        (algo.kl.target and not algo.kl.init_coef, f"--algo.kl.target {no_kl}"),
        (algo.kl.use_loss and not algo.kl.init_coef, f"--algo.kl.use_loss {no_kl}"),
        (algo.kl.unbiased_gradient and not algo.kl.use_loss, "--algo.kl.unbiased_gradient changes the "
                                                             "gradient of the KL loss: it needs "
                                                             "--algo.kl.use_loss (MAPPA's default puts KL in "
                                                             "the reward)"),
        # Colocated, an agent's engines and actor share GPUs in turns (OpenRLHF's hybrid engine): nothing
        # could generate while the actors train. Upstream refuses async with vLLM sleep for the same reason.
        (args.train.async_enable and m.colocate != "none",
         "--train.async_enable generates the next steps while the agents train, on engines of their own: use "
         f"--mappa.colocate none (not {m.colocate})"),
        (m.max_staleness is not None and not args.train.async_enable,
         "--mappa.max_staleness applies to --train.async_enable: synchronous training is on-policy"),
    ]
    return [why for bad, why in rules if bad]


def check_this_machine(args, topology=None) -> None:
    """What the flags need of the machines the run starts on, not of the plan (`mappa plan` may run
    elsewhere)."""
    from openrlhf_mappa import placement
    from openrlhf_mappa.compat import cpu_mode

    needed = placement.needed_modules(args, topology)
    attention, ring, colocate = (args.ds.attn_implementation, placement.ring_size(args, topology),
                                 args.mappa.colocate)
    rules = [
        # ring_flash_attn replaces flash attention's forward: under sdpa each rank would attend to its own
        # slice.
        (ring > 1 and "flash_attention" not in attention and not cpu_mode(),
         f"--ds.ring_attn_size {ring} replaces flash attention's kernel, which --ds.attn_implementation "
         f"{attention} does not use: pass --ds.attn_implementation flash_attention_2"),
        # With gloo, OpenRLHF builds a PyNccl group between an actor rank and the engine on its own GPU, which
        # NCCL refuses (ppo_actor.py, distributed_util.py); nccl passes a colocated actor's weights by CUDA
        # IPC.
        (colocate != "none" and args.vllm.sync_backend == "gloo" and not cpu_mode(),
         f"--vllm.sync_backend gloo with --mappa.colocate {colocate} cannot sync weights on GPUs: drop "
         "--vllm.sync_backend gloo (nccl, the default, passes them by CUDA IPC); gloo is for CPU-only "
         "machines"),
    ]
    missing = placement.module_refusals(needed, placement.broken_modules(needed), "here")
    if missing and not cpu_mode() and placement.detect_gpus()[0] is None:
        # A head or login node without GPUs may run another image than the GPU nodes, whose own check at
        # launch (launch.check_placement) decides: said here, not refused.
        print("[mappa] warning: " + "\n[mappa] warning: ".join(missing) + "\n(this machine has no GPU: each "
              "GPU node is checked for them when the run starts)", file=sys.stderr)
        missing = []
    refuse(missing + [why for bad, why in rules if bad])


def choose_train_tasks(tasks: list, max_samples: int, seed: int) -> list:
    """`max_samples` tasks drawn at random with `seed`, in file order (all if there are no more). The first N
    rows would be biased (by year, in AIME); numpy's legacy RandomState, sorted, is the authors'
    random_sample_train."""
    import numpy as np

    if len(tasks) <= max_samples:
        return list(tasks)
    picked = np.random.RandomState(seed).choice(len(tasks), size=max_samples, replace=False)
    return [tasks[i] for i in sorted(picked.tolist())]


def check_eval_overlap(args, tasks: list, eval_sets: dict) -> None:
    """Refuse (or, with --mappa.allow_eval_overlap, warn about) eval sets that hold training problems: a
    trained team's score on problems it trained on is no held-out result, and nothing in eval.jsonl would show
    it."""
    from openrlhf_mappa.evaluation import train_overlap

    shared = {name: train_overlap(tasks, eval_tasks) for name, eval_tasks in eval_sets.items()}
    said = [f"{name}: {len(ids)} of its {len(eval_sets[name])} problems (ids {', '.join(map(str, ids[:8]))}"
            f"{', ...' if len(ids) > 8 else ''})" for name, ids in shared.items() if ids]
    if not said:
        return
    what = (f"--eval.dataset shares problems with the {len(tasks)} training tasks of "
            f"{args.data.prompt_dataset} (--data.max_samples {args.data.max_samples}, --train.seed "
            f"{args.train.seed}), by problem text or AIME year/part/number: " + "; ".join(said))
    if not args.mappa.allow_eval_overlap:
        raise ValueError(f"{what}. Evaluate on held-out problems (the paper's aime_2025.json, "
                         "amc_eval_32.json), or pass --mappa.allow_eval_overlap to measure them anyway "
                         "(counted as train_overlap)")
    print(f"[mappa] WARNING: {what}; their scores are not held-out results (train_overlap in eval.jsonl)",
          file=sys.stderr, flush=True)


@contextlib.contextmanager
def output_to(log_path: str):
    """This process's stdout and stderr into `log_path` at the file-descriptor level, where Ray's, vLLM's and
    DeepSpeed's output goes too (their handlers hold the original streams); console.console keeps the
    terminal. The terminal is restored first on the way out, so an error that ends the run is shown there."""
    from openrlhf_mappa.console import console

    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    console.out, console.err = (open(os.dup(fd), "w", buffering=1, encoding=s.encoding, errors=s.errors)
                                for fd, s in zip(saved, (sys.stdout, sys.stderr)))
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    try:
        yield
    except BaseException:
        print("[mappa] the run stopped; Ray's, vLLM's and DeepSpeed's output is in "
              f"{os.path.abspath(log_path)}",
              file=console.err, flush=True)
        raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        console.out.close()
        console.err.close()
        console.out, console.err = sys.stdout, sys.stderr
        for fd, saved_fd in ((1, saved[0]), (2, saved[1])):
            os.dup2(saved_fd, fd)
            os.close(saved_fd)


def unwritable_dir(path: str, flag: str = "") -> str:
    """Why the directory `path` (given as `flag`) could not be created or written, or '' where it can: named
    before the work that writes there (the launcher's run, checkpoint and log directories, the tools'
    outputs)."""
    given = f"{flag} {path}".lstrip()
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{given}: exists and is not a directory"
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{given}: cannot be created: {existing} is a file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{given}: cannot be written: {existing} is not writable by this user"
    # Access bits are not all: a read-only file system, or one that holds no new directories (/sys, /proc),
    # refuses even root. A scratch directory made and removed there says so now, not a traceback once the
    # launch writes.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".mappa-check-", dir=existing))
    except OSError as e:
        return f"{given}: cannot be created in {existing}: {e.strerror}"
    return ""


def coach_cache_path(args):
    cache = args.mappa.coach.cache
    if cache is None:
        return os.path.join(args.mappa.run_dir, "coach_cache.sqlite")
    return None if cache == "none" else cache


def check_team(args, plan: bool = True, models: bool = True):
    """The team's checks before Ray (train, `mappa doctor`): the topology, the flags against it, every agent's
    model and LoRA settings (unless `models` is False: Preflight's step of its own), and the plan where the
    cluster is given (unless `plan` is False)."""
    from openrlhf_mappa import placement
    from openrlhf_mappa.team import load_topology

    topology = load_topology(args.mappa.topology, model_override=args.mappa.model)
    validate(args, topology)
    if models:
        check_models(args, topology)
    # the cluster as given: the plan, before Ray starts
    if plan and (args.mappa.gpus or args.mappa.gpu_memory_gib):
        placement.check(args, topology, args.mappa.gpus, args.mappa.gpu_memory_gib,
                        allowed=accepted(topology))
    return topology


def check_models(args, topology, config_only: bool = False) -> None:
    """Each trainee's model (every agent's, a trained coach's) found as the launch loads it, and a LoRA
    agent's targets in it (train, `mappa doctor` and its recipe's models, `mappa plan`). `config_only` (`mappa
    plan`): a local directory needs only the config.json the plan reads, so a hub id out of reach is what it
    refuses."""
    from openrlhf_mappa.placement import trainee_specs
    from openrlhf_mappa.team import check_lora, check_model

    for spec in trainee_specs(args, topology):
        if spec not in topology.agents:
            label = "--mappa.coach.model"
        elif spec.model == args.mappa.model:
            label = "--mappa.model"
        else:
            label = f"{args.mappa.topology}: agent {spec.name!r}"
        if config_only and os.path.isdir(spec.model):
            continue
        check_model(spec.model, label)
        check_lora(spec, label)


def accepted(topology):
    """Whether validate accepts changed flags: the plan names only changes the same command would then take
    (placement.check's `allowed`)."""

    def allowed(args) -> bool:
        try:
            validate(args, topology)
        except (SystemExit, ValueError):
            return False
        return True

    return allowed


@contextlib.contextmanager
def missing_file_named(flag: str, value: str):
    """A task file that does not exist, named with the flag that gave it and where a relative path was looked
    for (load_tasks' FileNotFoundError says only the path)."""
    try:
        yield
    except FileNotFoundError as e:
        where = "" if os.path.isabs(e.filename or "") else f" (relative to {os.getcwd()})"
        raise ValueError(f"{flag} {value}: {e}{where}: give the path of a task file (.json, .jsonl, .csv, "
                         f".parquet, .arrow) or folder, or a Hugging Face dataset name") from e


SCRIPTED_REPLY = "A scripted reply of `mappa check`: 42."


def play_scripted(topology, tasks: list, args) -> None:
    """Play the first task of each type with scripted replies, whole and then cut off at
    --rollout.max_new_tokens (team.play, no model): a hook that raises, or returns what the rollout may not
    take (a judge's bare number), is refused now, naming the hook, not found as a failed episode (or a wrong
    reward) once the run is up."""
    from openrlhf_mappa.team import play

    first = {}
    for task in tasks:
        first.setdefault(task.get("type", ""), task)
    for task in first.values():
        for truncated_at in (None, args.rollout.max_new_tokens):
            cut = f", cut off at {truncated_at} tokens" if truncated_at else ""
            with tempfile.TemporaryDirectory(prefix="mappa-env-check-") as workspace:
                try:
                    play(topology, task, lambda name, turn: SCRIPTED_REPLY, workspace, truncated_at)
                except Exception as e:  # the environment's own code: its message says what to fix
                    raise ValueError(f"{args.mappa.topology}: env {topology.env!r} on task {task['id']!r}, "
                                     f"every agent replying {SCRIPTED_REPLY!r}{cut}: {type(e).__name__}: "
                                     f"{e}") from e


class Preflight:
    """Every check a launch runs before Ray starts, in order. `train` runs them all and stops at the first
    refusal; `mappa check` (the dry run) runs each whose inputs passed and prints a table. A step reads what
    the earlier ones found, and may return a line saying what it found."""

    STEPS = (  # (what it checks, its method, the steps whose results it reads)
        ("topology, flags", "team", ()),
        # Apart: a model the plan can read (a config-only directory, `mappa plan`'s) but no actor could load
        # (no tokenizer) stops the launch, and `mappa check` still runs every other check.
        ("models", "models", ("team",)),
        ("training tasks", "training_tasks", ("team",)),
        ("eval sets", "eval_files", ("team",)),
        ("environment on each task type", "environment", ("team", "training_tasks", "eval_files")),
        ("run directory, resume", "run_dir", ("team", "training_tasks")),
        ("this machine's packages", "machine", ("team",)),
        ("GPU and memory plan", "plan", ("team",)),
        ("coach", "coach", ("team",)),
    )

    def __init__(self, args, score_one: bool = False):
        # score_one: the coach also scores one action (the dry run)
        self.args, self.score_one = args, score_one

    def run(self) -> None:
        for _, method, _ in self.STEPS:
            getattr(self, method)()

    def team(self):
        self.topology = check_team(self.args, plan=False, models=False)
        return f"{len(self.topology.agents)} agents: " + ", ".join(a.name for a in self.topology.agents)

    def models(self):
        check_models(self.args, self.topology)
        return ", ".join(dict.fromkeys(a.model for a in self.topology.agents))

    def training_tasks(self):
        from openrlhf_mappa.envs.base import load_tasks

        args, d = self.args, self.args.data
        with missing_file_named("--data.prompt_dataset", d.prompt_dataset):
            self.all_tasks = load_tasks(d.prompt_dataset, d.prompt_probs, d.prompt_split,
                                        input_key=d.input_key, label_key=d.label_key,
                                        needs_answer=self.topology.env_cls.needs_answer, seed=args.train.seed)
        self.tasks = choose_train_tasks(self.all_tasks, args.data.max_samples, args.train.seed)
        if len(self.tasks) < args.rollout.batch_size:
            raise SystemExit(f"{args.data.prompt_dataset}: {len(self.tasks)} tasks, fewer than "
                             f"--rollout.batch_size {args.rollout.batch_size}")
        strata = self.topology.batch_strata
        lacking = [t for t in self.tasks if t.get(strata) in (None, "")] if strata else []
        if lacking:  # a misspelt column would make one stratum of every task: no stratification, silently
            columns = ", ".join(sorted(lacking[0]))
            raise SystemExit(f"{args.mappa.topology}: batch_strata {strata!r}, but {len(lacking)} of the "
                             f"{len(self.tasks)} training tasks in {args.data.prompt_dataset} have no such "
                             f"column (task {lacking[0].get('id')!r} has: {columns}); name one of those, or "
                             "leave batch_strata out for one shuffle per pass")
        return f"{len(self.tasks)} of the {len(self.all_tasks)} in {args.data.prompt_dataset}"

    def eval_files(self):
        from openrlhf_mappa.evaluation import load_eval_sets

        with missing_file_named("--eval.dataset", self.args.eval.dataset):
            self.eval_sets = load_eval_sets(self.args, self.topology.env_cls.needs_answer)
        return ", ".join(f"{name}: "
                         f"{len(ts)}" for name, ts in self.eval_sets.items()) or "none (no --eval.dataset)"

    def environment(self):
        every_task = self.tasks + [t for ts in self.eval_sets.values() for t in ts]
        self.topology.check_env(every_task, self.args.mappa.topology)
        play_scripted(self.topology, every_task, self.args)
        check_eval_overlap(self.args, self.tasks, self.eval_sets)
        return f"env {self.topology.env!r} built on the first task of each type; no eval problem in training"

    def run_dir(self):
        from openrlhf_mappa import resume

        args = self.args
        # The directories the launch writes: one it cannot write is named now, not by a traceback once Ray is
        # up.
        written = {"--mappa.run_dir": args.mappa.run_dir, "--ckpt.path": args.ckpt.path,
                   "--ckpt.output_dir": args.ckpt.output_dir,
                   "--logger.tensorboard_dir": args.logger.tensorboard_dir}
        # no tensorboard
        refuse([unwritable_dir(path, flag) for flag, path in written.items() if path], ValueError)
        # A resumed run must train on the same tasks (resume.check_resume), so the chosen ids go into the run
        # dir, with the whole source they came from (local paths made absolute, a Hub name as given).
        d = args.data
        datasets = [os.path.abspath(e.strip()) if os.path.exists(e.strip()) else e.strip()
                    for e in d.prompt_dataset.split(",")]
        source = {"datasets": ",".join(datasets), "probs": d.prompt_probs, "split": d.prompt_split,
                  "input_key": d.input_key, "label_key": d.label_key}
        self.chosen = {"source": source, "seed": args.train.seed,
                       "total": len(self.all_tasks), "max_samples": args.data.max_samples,
                       "ids": [t["id"] for t in self.tasks]}
        self.start, self.resume_fixes = resume.check_resume(args, self.topology, self.chosen["ids"])
        return f"resumes at step {self.start}" if self.start else "starts at step 0"

    def machine(self):
        from openrlhf_mappa.coach.cache import check_cache_file

        self.cache_path = coach_cache_path(self.args)
        if self.cache_path:
            check_cache_file(self.cache_path)
        check_this_machine(self.args, self.topology)

    def plan(self):
        from openrlhf_mappa import placement

        gpus, gib = self.args.mappa.gpus, self.args.mappa.gpu_memory_gib
        if not (gpus or gib):  # the launcher checks the Ray cluster's own nodes once it is up
            return "not checked here: give --mappa.gpus N --mappa.gpu_memory_gib G (`mappa plan` prints it)"
        placement.check(self.args, self.topology, gpus, gib, allowed=accepted(self.topology))
        return (f"fits: {placement.make_plan(self.args, self.topology, gib).need} GPUs"
                + (f" of {gpus}" if gpus else ""))

    def coach(self):
        """An unreachable coach or a rejected key, found now rather than after the first rollout, by a coach
        of its own (the run's opens its verdict cache, which writes); the dry run also has it score one
        action."""
        from openrlhf_mappa.coach import CoachRequest
        from openrlhf_mappa.placement import scored

        c = self.args.mappa.coach
        probe = run_coach(self.args, self.topology)
        if not scored(self.args):
            return "not asked (--mappa.reward outcome)"
        asyncio.run(probe.probe())
        if not self.score_one:
            return None
        first = self.topology.agents[0]
        request = CoachRequest(episode_id="dry-run", agent=first.name, turn=0, role=first.role,
                               task="What is 2 + 2?", task_type="", agent_input="What is 2 + 2?",
                               agent_output="2 + 2 = 4.", feedback="")

        async def score_and_close():
            # Its HTTP session closed in the event loop it opened in: else aiohttp warns of an "Unclosed
            # client session" above the table.
            try:
                return await probe.score(request)
            finally:
                await probe.aclose()

        verdict = asyncio.run(score_and_close())
        if verdict.score is None:
            # A 404 from a server that answered the probe is most often a base URL without the API's version
            # path.
            url = (c.base_url or "").rstrip("/")
            hint = ("; an OpenAI-compatible API is served under a version path: did you mean "
                    f"--mappa.coach.base_url {url}/v1?"
                    if "HTTP 404" in verdict.rationale and c.base_url and not url.endswith("/v1") else "")
            raise ValueError(f"coach {c.kind} {c.model or ''} answered a test action without a score "
                             f"({verdict.status}): {verdict.rationale[:300]!r}{hint}")
        return (f"{c.kind} {c.model or ''}: scored a test action {verdict.score:g} in "
                f"{verdict.latency_s:.1f} s")


def run_coach(args, topology, cache_path: str = None):
    """The run's coach: its flags (--mappa.coach.*), the topology's prompts and score key, the run's seed."""
    from openrlhf_mappa.coach import build_coach

    return build_coach(args.mappa.coach, template=topology.coach_template, score_key=topology.score_key,
                       review_template=topology.review_template, cache_path=cache_path, seed=args.train.seed)


def train(args):
    """Build every agent on the Ray cluster, train, export; returns the agents (their handles stay up)."""
    from openrlhf_mappa import resume

    # Every check comes first: a refused launch leaves the run directory and the checkpoints as they were.
    c, pre = args.mappa.coach, Preflight(args)
    with refusals():
        pre.run()
    topology, tasks, eval_sets, chosen, start, cache_path = (pre.topology, pre.tasks, pre.eval_sets,
                                                             pre.chosen, pre.start, pre.cache_path)

    # Every check passed: from here on, the launch writes.
    os.makedirs(args.mappa.run_dir, exist_ok=True)
    with open(os.path.join(args.mappa.run_dir, "train_tasks.json"), "w", encoding="utf-8") as f:
        json.dump(chosen, f, indent=1)
    with open(os.path.join(args.mappa.run_dir, resume.SETTINGS_RECORD), "w", encoding="utf-8") as f:
        json.dump(resume.run_settings(args, topology), f, indent=1)
    resume.apply(pre.resume_fixes)
    coach = run_coach(args, topology, cache_path)
    if c.mode == "both":  # the combining rule, stated where the run's log begins (coach.combine)
        print("[mappa] coach mode both: an action's score is the mean of its per-action and hindsight "
              "scores; the one that exists when the other failed (counted as coach/both_one_source); none "
              "when both failed")

    log = os.path.join(args.mappa.run_dir, "train.log")
    if not args.mappa.verbose:
        # Ray's deduplication prints held-back lines at shutdown, after the terminal is restored (output_to);
        # a log file needs none. Read when Ray is first imported (launch).
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        print(f"[mappa] Ray's, vLLM's and DeepSpeed's output goes to {os.path.abspath(log)} "
              "(--mappa.verbose: here)",
              flush=True)
    from openrlhf_mappa.console import run_summary

    with contextlib.nullcontext() if args.mappa.verbose else output_to(log):
        agents = launch(args, topology, coach, tasks, eval_sets, start)
    for line in run_summary(args.mappa.run_dir):
        print(line)
    run_dir = os.path.abspath(args.mappa.run_dir)
    # at least one step: `mappa report`'s page of it, by that command (the core imports no tool:
    # tests/test_imports)
    if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        import subprocess

        page = subprocess.run([sys.executable, "-m", "openrlhf_mappa.tools.mappa", "report", run_dir],
                              stdout=subprocess.PIPE, text=True, check=True).stdout.strip()
        print(f"[mappa] report:      {page}")
    print(f"[mappa] metrics:     {os.path.join(run_dir, 'metrics.jsonl')}")
    print(f"[mappa] episodes:    {os.path.join(run_dir, 'episodes.jsonl')}")
    if eval_sets:
        print(f"[mappa] evaluation:  {os.path.join(run_dir, 'eval.jsonl')} (per problem: eval/)")
    print(f"[mappa] checkpoints: {os.path.abspath(args.ckpt.path)}/<agent>/ ; "
          f"HF exports: {os.path.abspath(args.ckpt.output_dir)}/<agent>/")
    if args.logger.tensorboard_dir:
        print(f"[mappa] tensorboard: {os.path.abspath(args.logger.tensorboard_dir)}")
    if not args.mappa.verbose:
        print(f"[mappa] log:         {os.path.abspath(log)}")
    return agents


def schedule_steps(args, topology, num_tasks: int) -> dict:
    """Each trainee's learning-rate schedule length in optimizer steps (Member.schedule_steps)."""
    from openrlhf_mappa.placement import members

    return {m.spec.name: m.schedule_steps(topology, num_tasks) for m in members(args, topology)}


def launch(args, topology, coach, tasks: list, eval_sets: dict, start: int) -> list:
    """Start Ray and every agent's engines and actors, then train from step `start`."""
    import ray

    from openrlhf_mappa.coach.audit import CoachFailure
    from openrlhf_mappa.console import console
    from openrlhf_mappa.health import RunStopped, StartupWatchdog, Watchdog, find_dead
    from openrlhf_mappa.launch import build_agents, components
    from openrlhf_mappa.trainer import MappaTrainer

    if not ray.is_initialized():
        ray.init(runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    max_steps = schedule_steps(args, topology, len(tasks))
    if start:
        print(f"[mappa] resuming after step {start} (checkpoints in {os.path.abspath(args.ckpt.path)})",
              file=console.out, flush=True)
    models = [a.model for a in topology.agents]
    startup = StartupWatchdog(args.mappa.startup_warn_s, args.mappa.startup_timeout_s, models)
    startup.start()
    try:
        agents = build_agents(args, topology, max_steps, startup, accepted(topology))
    except KeyboardInterrupt:
        if not startup.reason:
            raise
        raise SystemExit(f"[mappa] run stopped at start-up: {startup.reason}") from None
    finally:
        startup.done.set()
    team = agents
    if args.mappa.coach.kind == "trained":  # the last trainee is the coach's own weights, not a team member
        coach.agent, agents = agents[-1], agents[:-1]
    trainer = MappaTrainer(args, topology, agents, coach, tasks, args.mappa.run_dir, eval_sets)
    with open(os.path.join(args.mappa.run_dir, "processes.json"), "w") as f:  # which process is whose
        json.dump({f"{name}/{what}": ray.get(h.__ray_call__.remote(lambda self: os.getpid()))
                   for name, what, h in components(team)}, f, indent=1)
    watchdog = Watchdog(team)
    watchdog.start()
    try:
        trainer.resume(start)
        trainer.fit(start)
    except (KeyboardInterrupt, ray.exceptions.RayActorError) as e:
        dead = watchdog.dead or find_dead(team)
        if not dead:
            raise
        raise SystemExit(f"[mappa] run stopped: {'; '.join(dead)} died ({type(e).__name__}). Completed steps "
                         f"are in {args.mappa.run_dir}; resume from the last checkpoint with "
                         "--ckpt.load_enable.") from None
    # the run's own verdict on itself: its message says what to change
    except (CoachFailure, RunStopped) as e:
        raise SystemExit(f"[mappa] run stopped: {e}") from None
    finally:
        watchdog.done.set()
    return team


if __name__ == "__main__":
    args = parse_args()
    train(args)
    import ray

    # Ray's engines and actors print as they shut down: into the run's log too, not under the summary.
    with (contextlib.nullcontext() if args.mappa.verbose
          else output_to(os.path.join(args.mappa.run_dir, "train.log"))):
        ray.shutdown()
