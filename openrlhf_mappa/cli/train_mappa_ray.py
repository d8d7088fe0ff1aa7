"""Train a MAPPA team: `python -m openrlhf_mappa.cli.train_mappa_ray` with OpenRLHF's flags plus `--mappa.*`.

OpenRLHF's own flags and validation live inline under `if __name__ == "__main__"` in
`openrlhf.cli.train_ppo_ray`; instead of copying ~400 lines we run that block, minus its final
`train(args)` call, with MAPPA's flags added to the same parser. So every OpenRLHF flag means here what
it means there.

Every input is checked before the heavy imports (torch, DeepSpeed, vLLM) and before Ray starts, so a bad
flag, topology, model or dataset is refused in about a second with its message alone (exit 1; argparse's
own errors exit 2). MAPPA_TRACEBACK=1 adds the traceback.
"""

import ast
import asyncio
import builtins
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import sys

OPENRLHF_FITS = ("0.11.2",)


def add_mappa_args(parser):
    g = parser.add_argument_group("MAPPA")
    g.add_argument("--mappa.topology", required=True, help="topology YAML (agents, env, coach prompt)")
    g.add_argument("--mappa.model", default=None, help="use this model for every agent (overrides the YAML)")
    g.add_argument("--mappa.reward", choices=["process", "outcome"], default="process",
                   help="process: each action's coach score (MAPPA); outcome: the episode's outcome for every action "
                        "(baseline: 10 if solved, else 0, times the topology's reward_scale; no coach calls)")
    g.add_argument("--mappa.norm_scope", choices=["agent", "global", "group"], default="agent",
                   help="whiten advantages over each agent's batch (the authors' choice) or over all agents; "
                        "group: GRPO-style, normalize rewards over the samples of each prompt (baseline)")
    g.add_argument("--mappa.shared_policy", action="store_true",
                   help="baseline: one policy (the first agent's model) plays and trains every role")
    g.add_argument("--mappa.train_truncated", action="store_true",
                   help="also train actions cut off at the token limit (default: left out, as the authors' "
                        "mask_truncated_completions; counted in agent/<name>/truncated_left_out)")
    g.add_argument("--mappa.run_dir", default="./runs/mappa", help="metrics.jsonl, episodes.jsonl and code workspaces")
    g.add_argument("--mappa.coach.kind", choices=["heuristic", "openai"], default="heuristic",
                   help="heuristic: offline rule-based coach (demo/tests); openai: any OpenAI-compatible server")
    g.add_argument("--mappa.coach.mode", choices=["per_action", "hindsight", "both"], default="per_action",
                   help="per_action: one coach request per action, as the episode runs (the paper); hindsight: one "
                        "request per finished episode, scoring every action and naming the one responsible for the "
                        "outcome; both: the mean of the two scores (the one that exists when the other failed)")
    g.add_argument("--mappa.coach.model", default=None, help="coach model name at the OpenAI-compatible server")
    g.add_argument("--mappa.coach.base_url", default=None, help="e.g. https://api.openai.com/v1 or http://localhost:8000/v1")
    g.add_argument("--mappa.coach.api_key_env", default="OPENAI_API_KEY", help="environment variable holding the key")
    g.add_argument("--mappa.coach.timeout", type=float, default=60.0, help="seconds per coach request")
    g.add_argument("--mappa.coach.max_concurrency", type=int, default=32, help="coach verdicts in progress: requests in flight or waiting to retry")
    g.add_argument("--mappa.coach.max_retries", type=int, default=4,
                   help="retries of a request after 429 (honouring Retry-After), 5xx, timeouts or dropped connections")
    g.add_argument("--mappa.coach.rpm", type=float, default=0.0, help="requests-per-minute limit (0: none)")
    g.add_argument("--mappa.coach.structured", choices=["auto", "json_schema", "off"], default="auto",
                   help="ask for a JSON-schema verdict {rationale, score}; auto: fall back to text if the server refuses")
    g.add_argument("--mappa.coach.max_tokens", type=int, default=0, help="coach reply token limit (0: the server's default)")
    g.add_argument("--mappa.coach.format_retries", type=int, default=2, help="re-prompts after a reply with no valid score")
    g.add_argument("--mappa.coach.cache", default=None,
                   help="SQLite verdict cache (default: <run_dir>/coach_cache.sqlite; 'none': memory only)")
    g.add_argument("--mappa.coach.on_failure", choices=["skip", "outcome", "neutral"], default="skip",
                   help="actions without a valid score: skip (left out), outcome (episode outcome), neutral (neutral_score)")
    g.add_argument("--mappa.coach.neutral_score", type=float, default=5.0,
                   help="score (0-10, times the topology's reward_scale) paid for on_failure=neutral")
    g.add_argument("--mappa.coach.max_failure_fraction", type=float, default=0.5,
                   help="stop the run when more than this fraction of a step's verdicts failed")
    g.add_argument("--mappa.coach.bias_threshold", type=float, default=1.0,
                   help="warn when an agent's mean coach score differs between task types by more than this")
    g.add_argument("--mappa.coach.bias_window", type=int, default=5, help="steps pooled by the coach-bias audit")
    g.add_argument("--mappa.coach.standardize_task_type", action="store_true",
                   help="standardize coach scores per agent x task type (bias mitigation)")
    g.add_argument("--mappa.coach.price_in", type=float, default=0.0, help="USD per 1M prompt tokens (cost metrics)")
    g.add_argument("--mappa.coach.price_out", type=float, default=0.0, help="USD per 1M completion tokens")
    g.add_argument("--mappa.coach.score_outcome_runs", action="store_true",
                   help="with --mappa.reward outcome: still ask the coach about every action, for comparison "
                        "(logged, never trained on; default: no coach calls)")
    g.add_argument("--mappa.startup_warn_s", type=float, default=300.0,
                   help="while engines and actors start: name those not up yet, and what they wait for, every this many seconds")
    g.add_argument("--mappa.startup_timeout_s", type=float, default=1800.0,
                   help="stop a start-up not done after this many seconds, with that message")
    # MAPPA's estimator is REINFORCE++ (return-to-go + global whitening), computed in rewards.py.
    parser.set_defaults(**{"algo.advantage.estimator": "reinforce"})


@contextlib.contextmanager
def refusals():
    """Bad input found before Ray starts ends the run with its message alone: the loaders' ValueError and
    OSError and upstream's assertions say what to fix, and a traceback in front of them only hides that."""
    try:
        yield
    except (ValueError, OSError, AssertionError) as e:
        if os.environ.get("MAPPA_TRACEBACK", "0") not in ("", "0"):
            raise
        raise SystemExit(f"[mappa] {e or type(e).__name__}") from None


# Statements of upstream's main block that MAPPA changes; parse_args fails loudly when one is missing.
UPSTREAM_PARSE = "args = parser.parse_args()"  # MAPPA's flags are added just before it
UPSTREAM_HIERARCHIZE = "from openrlhf.utils.config import hierarchize"  # its package imports DeepSpeed
UPSTREAM_EVAL_CHECK = "args.eval.dataset"  # demands a reward model for --eval.dataset; MAPPA's env grades it
UPSTREAM_TRAIN = "train(args)"  # where parsing ends


def parse_args(argv=None):
    """OpenRLHF's parser + validation from train_ppo_ray's main block, with MAPPA's flags added.

    The block is read from the source file, not imported: importing train_ppo_ray loads torch, DeepSpeed
    and vLLM, 10-40 s before a typo could be reported. So the block may take only standard-library names
    from its module; `hierarchize` comes from its own small file."""
    installed = importlib.metadata.version("openrlhf")
    if installed not in OPENRLHF_FITS:
        raise SystemExit(f"[mappa] openrlhf_mappa's CLI reads openrlhf {', '.join(OPENRLHF_FITS)}'s train_ppo_ray; "
                         f"found openrlhf {installed}. Install openrlhf=={OPENRLHF_FITS[-1]}.")
    path = importlib.util.find_spec("openrlhf.cli.train_ppo_ray").origin  # imports only the empty packages
    with open(path, encoding="utf-8") as f:
        module = ast.parse(f.read(), path)
    main = next(n for n in module.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test))
    body, seen = [], set()
    for stmt in main.body:
        text = ast.unparse(stmt.test if isinstance(stmt, ast.If) else stmt)
        seen.add(text)
        if text == UPSTREAM_TRAIN:
            break
        if text in (UPSTREAM_EVAL_CHECK, UPSTREAM_HIERARCHIZE):
            continue
        if text == UPSTREAM_PARSE:
            body.append(ast.parse("__add_mappa_args__(parser)").body[0])
        body.append(stmt)
    block = ast.Module(body=body, type_ignores=[])

    spec = importlib.util.spec_from_file_location("_openrlhf_config", os.path.join(os.path.dirname(path), "..", "utils", "config.py"))
    config = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(config)
    namespace = {"__add_mappa_args__": add_mappa_args, "hierarchize": config.hierarchize}
    for stmt in module.body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)) and ast.unparse(stmt).split()[1].split(".")[0] in sys.stdlib_module_names:
            exec(compile(ast.Module(body=[stmt], type_ignores=[]), path, "exec"), namespace)
    nodes = list(ast.walk(block))
    bound = {n.id for n in nodes if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
    bound |= {(a.asname or a.name).split(".")[0] for n in nodes if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    unbound = {n.id for n in nodes if isinstance(n, ast.Name)} - bound - set(namespace) - set(dir(builtins))
    missing = [s for s in (UPSTREAM_PARSE, UPSTREAM_HIERARCHIZE, UPSTREAM_EVAL_CHECK, UPSTREAM_TRAIN) if s not in seen]
    if missing or unbound:
        raise RuntimeError(f"openrlhf {installed} changed the main block of {path}: statements MAPPA rewrites not "
                           f"found: {missing}; names it reads that are not standard library: {sorted(unbound)}. "
                           f"Update openrlhf_mappa/cli/train_mappa_ray.py parse_args.")

    saved, sys.argv = sys.argv, [sys.argv[0]] + list(sys.argv[1:] if argv is None else argv)
    try:
        with refusals():  # upstream validates with assert
            exec(compile(block, path, "exec"), namespace)
    finally:
        sys.argv = saved
    return namespace["args"]


def validate(args, topology):
    if args.train.colocate_all or args.train.colocate_actor_ref or args.train.async_enable:
        raise SystemExit("MAPPA runs each agent on its own GPUs: --train.colocate_* and --train.async_enable are not supported yet")
    if not args.vllm.num_engines:
        raise SystemExit("MAPPA generates with vLLM: set --vllm.num_engines (per agent; a topology may override it)")
    if not args.data.prompt_dataset:
        raise SystemExit("--data.prompt_dataset: the task file (JSON list or JSONL with prompt/answer) is required")
    # Each agent's train batch is split over its data-parallel ranks, in --rollout.micro_batch_size pieces
    # (experiences) and --train.micro_batch_size pieces (DeepSpeed's gradient accumulation). A topology may
    # give an agent its own GPU count; under --mappa.shared_policy only the first agent trains (trainee_specs).
    for spec in topology.agents[:1] if args.mappa.shared_policy else topology.agents:
        gpus = args.actor.num_nodes * (spec.num_gpus_per_node or args.actor.num_gpus_per_node)
        ranks = gpus // (args.ds.ring_attn_size * args.ds.tensor_parallel_size)
        for flag, micro in (("train.micro_batch_size", args.train.micro_batch_size),
                            ("rollout.micro_batch_size", args.rollout.micro_batch_size)):
            if args.train.batch_size % (micro * ranks):
                where = ("num_gpus_per_node in the topology" if spec.num_gpus_per_node
                         else "--actor.num_nodes x --actor.num_gpus_per_node")
                raise SystemExit(f"agent {spec.name!r}: --train.batch_size ({args.train.batch_size}) must be a multiple of "
                                 f"--{flag} ({micro}) x its {ranks} data-parallel actor ranks ({where}) = {micro * ranks}, "
                                 f"so that every rank gets whole micro-batches")
    if args.algo.advantage.estimator != "reinforce":
        raise SystemExit("MAPPA's advantages are REINFORCE++ (rewards.py); --algo.advantage.estimator must be reinforce")
    if not 0.0 <= args.mappa.coach.max_failure_fraction <= 1.0:
        raise SystemExit(f"--mappa.coach.max_failure_fraction must be in [0, 1], got {args.mappa.coach.max_failure_fraction}")
    if args.mappa.norm_scope == "group" and args.rollout.n_samples_per_prompt < 2:
        raise SystemExit("--mappa.norm_scope group compares the samples of each prompt: set --rollout.n_samples_per_prompt >= 2")
    if not 0 < args.mappa.startup_warn_s <= args.mappa.startup_timeout_s:
        raise SystemExit("--mappa.startup_warn_s must be > 0 and at most --mappa.startup_timeout_s")
    if args.algo.kl.use_loss:
        raise SystemExit("MAPPA puts KL in the reward (r_t = score - beta*KL); --algo.kl.use_loss is not supported")
    if args.mappa.coach.mode != "per_action" and args.mappa.reward == "outcome" and not args.mappa.coach.score_outcome_runs:
        raise SystemExit(f"--mappa.coach.mode {args.mappa.coach.mode}: an outcome run asks no coach; add "
                         "--mappa.coach.score_outcome_runs to log the coach's verdicts anyway")
    if args.mappa.coach.score_outcome_runs and args.mappa.reward != "outcome":
        raise SystemExit("--mappa.coach.score_outcome_runs is for --mappa.reward outcome (process runs always ask the coach)")


def choose_train_tasks(tasks: list, max_samples: int, seed: int) -> list:
    """`max_samples` tasks drawn at random with `seed`, in file order; all of them if there are no more.

    The first N rows would be a biased subset (AIME_1983_2024's first 512 are 1983-2010). numpy's legacy
    RandomState, sorted, is the authors' `random_sample_train`: same file and seed, same problems as theirs."""
    import numpy as np

    if len(tasks) <= max_samples:
        return list(tasks)
    picked = np.random.RandomState(seed).choice(len(tasks), size=max_samples, replace=False)
    return [tasks[i] for i in sorted(picked.tolist())]


def coach_cache_path(args):
    cache = args.mappa.coach.cache
    if cache is None:
        return os.path.join(args.mappa.run_dir, "coach_cache.sqlite")
    return None if cache == "none" else cache


def train(args):
    """Build every agent on the Ray cluster, train, export; returns the agents (their handles stay up)."""
    from openrlhf_mappa.coach import build_coach
    from openrlhf_mappa.envs.base import load_tasks
    from openrlhf_mappa.evaluation import load_eval_sets
    from openrlhf_mappa.topology import check_model, load_topology

    with refusals():  # every input, before the heavy imports and before Ray
        topology = load_topology(args.mappa.topology, model_override=args.mappa.model)
        validate(args, topology)
        for spec in topology.agents:
            check_model(spec.model, "--mappa.model" if args.mappa.model else f"{args.mappa.topology}: agent {spec.name!r}")
        all_tasks = load_tasks(args.data.prompt_dataset)
        tasks = choose_train_tasks(all_tasks, args.data.max_samples, args.train.seed)
        # The chosen ids go into the run directory; a resumed run must train on the same tasks, or the steps after
        # its checkpoint would quietly continue on another data set.
        chosen = {"source": os.path.abspath(args.data.prompt_dataset), "seed": args.train.seed, "total": len(all_tasks),
                  "max_samples": args.data.max_samples, "ids": [t["id"] for t in tasks]}
        chosen_path = os.path.join(args.mappa.run_dir, "train_tasks.json")
        resuming = False
        if args.ckpt.load_enable:  # the trainer module loads torch and Ray: only a resume pays for it here
            from openrlhf_mappa.trainer import CHECKPOINT_MARKER

            resuming = os.path.exists(os.path.join(args.ckpt.path, CHECKPOINT_MARKER))
        if resuming and os.path.exists(chosen_path) and json.load(open(chosen_path))["ids"] != chosen["ids"]:
            raise SystemExit(f"resume: {chosen_path} lists other training tasks than --data.prompt_dataset, --train.seed "
                             "and --data.max_samples pick now; resume with the settings of the first run")
        os.makedirs(args.mappa.run_dir, exist_ok=True)
        with open(chosen_path, "w", encoding="utf-8") as f:
            json.dump(chosen, f, indent=1)
        # --eval.dataset: comma-separated task files, each evaluated before training, every --eval.steps and at the end.
        eval_sets = load_eval_sets([p for p in (args.eval.dataset or "").split(",") if p])
        if len(tasks) < args.rollout.batch_size:
            raise SystemExit(f"{args.data.prompt_dataset}: {len(tasks)} tasks, fewer than --rollout.batch_size {args.rollout.batch_size}")
        c = args.mappa.coach
        coach = build_coach(
            c.kind, template=topology.coach_template, model=c.model, base_url=c.base_url, cache_path=coach_cache_path(args),
            api_key_env=c.api_key_env, timeout_s=c.timeout, max_concurrency=c.max_concurrency, max_retries=c.max_retries,
            rpm=c.rpm, structured=c.structured, format_retries=c.format_retries, max_tokens=c.max_tokens,
            score_key=topology.score_key, review_template=topology.review_template,
        )
        if c.mode == "both":  # the combining rule, stated where the run's log begins (coach.combine)
            print("[mappa] coach mode both: an action's score is the mean of its per-action and hindsight scores; the "
                  "one that exists when the other failed (counted as coach/both_one_source); none when both failed")
        # An unreachable coach or a rejected key would otherwise surface only after the first rollout.
        if args.mappa.reward == "process" or c.score_outcome_runs:
            asyncio.run(coach.probe())

    import ray

    from openrlhf_mappa.trainer import (MappaTrainer, StartupWatchdog, Watchdog, build_agents, components, find_dead,
                                        prepare_resume)

    start = prepare_resume(args, topology)  # before Ray: it refuses a resume that would silently start over
    if not ray.is_initialized():
        ray.init(runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    steps = (len(tasks) // args.rollout.batch_size) * args.train.num_episodes
    per_episode = [a.max_actions for a in topology.agents]  # the actions one actor trains on per episode, at most
    actions_per_step = args.rollout.batch_size * args.rollout.n_samples_per_prompt * (
        sum(per_episode) if args.mappa.shared_policy else max(per_episode))
    max_steps = steps * max(1, actions_per_step // args.train.batch_size)
    if start:
        print(f"[mappa] resuming after step {start} (checkpoints in {os.path.abspath(args.ckpt.path)})")
    startup = StartupWatchdog(args.mappa.startup_warn_s, args.mappa.startup_timeout_s, [a.model for a in topology.agents])
    startup.start()
    try:
        agents = build_agents(args, topology, max_steps, startup)
    except KeyboardInterrupt:
        if not startup.reason:
            raise
        raise SystemExit(f"[mappa] run stopped at start-up: {startup.reason}") from None
    finally:
        startup.done.set()
    trainer = MappaTrainer(args, topology, agents, coach, tasks, args.mappa.run_dir, eval_sets)
    with open(os.path.join(args.mappa.run_dir, "processes.json"), "w") as f:  # which process is whose
        json.dump({f"{name}/{what}": ray.get(h.__ray_call__.remote(lambda self: os.getpid()))
                   for name, what, h in components(agents)}, f, indent=1)
    watchdog = Watchdog(agents)
    watchdog.start()
    try:
        trainer.resume(start)
        trainer.fit(start)
    except (KeyboardInterrupt, ray.exceptions.RayActorError) as e:
        dead = watchdog.dead or find_dead(agents)
        if not dead:
            raise
        raise SystemExit(f"[mappa] run stopped: {'; '.join(dead)} died ({type(e).__name__}). Completed steps are "
                         f"in {args.mappa.run_dir}; resume from the last checkpoint with --ckpt.load_enable.") from None
    finally:
        watchdog.done.set()
    print(f"[mappa] metrics:     {os.path.abspath(os.path.join(args.mappa.run_dir, 'metrics.jsonl'))}")
    print(f"[mappa] episodes:    {os.path.abspath(os.path.join(args.mappa.run_dir, 'episodes.jsonl'))}")
    if eval_sets:
        print(f"[mappa] evaluation:  {os.path.abspath(os.path.join(args.mappa.run_dir, 'eval.jsonl'))} (per problem: eval/)")
    print(f"[mappa] checkpoints: {os.path.abspath(args.ckpt.path)}/<agent>/ ; HF exports: {os.path.abspath(args.ckpt.output_dir)}/<agent>/")
    if args.logger.tensorboard_dir:
        print(f"[mappa] tensorboard: {os.path.abspath(args.logger.tensorboard_dir)}")
    return agents


if __name__ == "__main__":
    train(parse_args())
