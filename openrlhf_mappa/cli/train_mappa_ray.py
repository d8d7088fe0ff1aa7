"""Train a MAPPA team: `python -m openrlhf_mappa.cli.train_mappa_ray` with OpenRLHF's flags plus `--mappa.*`.

OpenRLHF's own flags and validation live inline under `if __name__ == "__main__"` in
`openrlhf.cli.train_ppo_ray`; instead of copying ~400 lines we run that block, minus its final
`train(args)` call, with MAPPA's flags added to the same parser. So every OpenRLHF flag means here what
it means there.
"""

import ast
import importlib.metadata
import inspect
import json
import os
import sys

OPENRLHF_FITS = ("0.11.2",)


def add_mappa_args(parser):
    g = parser.add_argument_group("MAPPA")
    g.add_argument("--mappa.topology", required=True, help="topology YAML (agents, env, coach prompt)")
    g.add_argument("--mappa.model", default=None, help="use this model for every agent (overrides the YAML)")
    g.add_argument("--mappa.reward", choices=["process", "outcome"], default="process",
                   help="process: each action's coach score (MAPPA); outcome: the episode's outcome for every action (baseline)")
    g.add_argument("--mappa.norm_scope", choices=["agent", "global", "group"], default="agent",
                   help="whiten advantages over each agent's batch (the authors' choice) or over all agents; "
                        "group: GRPO-style, normalize rewards over the samples of each prompt (baseline)")
    g.add_argument("--mappa.shared_policy", action="store_true",
                   help="baseline: one policy (the first agent's model) plays and trains every role")
    g.add_argument("--mappa.run_dir", default="./runs/mappa", help="metrics.jsonl, episodes.jsonl and code workspaces")
    g.add_argument("--mappa.coach.kind", choices=["heuristic", "openai"], default="heuristic",
                   help="heuristic: offline rule-based coach (demo/tests); openai: any OpenAI-compatible server")
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
    g.add_argument("--mappa.coach.neutral_score", type=float, default=5.0, help="reward for on_failure=neutral")
    g.add_argument("--mappa.coach.max_failure_fraction", type=float, default=0.5,
                   help="stop the run when more than this fraction of a step's verdicts failed")
    g.add_argument("--mappa.coach.bias_threshold", type=float, default=1.0,
                   help="warn when an agent's mean coach score differs between task types by more than this")
    g.add_argument("--mappa.coach.bias_window", type=int, default=5, help="steps pooled by the coach-bias audit")
    g.add_argument("--mappa.coach.standardize_task_type", action="store_true",
                   help="standardize coach scores per agent x task type (bias mitigation)")
    g.add_argument("--mappa.coach.price_in", type=float, default=0.0, help="USD per 1M prompt tokens (cost metrics)")
    g.add_argument("--mappa.coach.price_out", type=float, default=0.0, help="USD per 1M completion tokens")
    g.add_argument("--mappa.startup_warn_s", type=float, default=300.0,
                   help="while engines and actors start: name those not up yet, and what they wait for, every this many seconds")
    g.add_argument("--mappa.startup_timeout_s", type=float, default=1800.0,
                   help="stop a start-up not done after this many seconds, with that message")
    # MAPPA's estimator is REINFORCE++ (return-to-go + global whitening), computed in rewards.py.
    parser.set_defaults(**{"algo.advantage.estimator": "reinforce"})


def parse_args(argv=None):
    """OpenRLHF's parser + validation from train_ppo_ray's main block, with MAPPA's flags added."""
    import openrlhf.cli.train_ppo_ray as upstream

    installed = importlib.metadata.version("openrlhf")
    if installed not in OPENRLHF_FITS:
        raise RuntimeError(f"openrlhf_mappa's CLI reads openrlhf {', '.join(OPENRLHF_FITS)}'s train_ppo_ray; found {installed}")
    tree = ast.parse(inspect.getsource(upstream))
    main = next(n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test))
    body = []
    for stmt in main.body:
        if isinstance(stmt, ast.Expr) and ast.unparse(stmt) == "train(args)":
            break
        if isinstance(stmt, ast.If) and ast.unparse(stmt.test) == "args.eval.dataset":
            continue  # upstream demands a reward model to grade --eval.dataset; MAPPA's environment grades it
        if ast.unparse(stmt) == "args = parser.parse_args()":
            body.append(ast.parse("__add_mappa_args__(parser)").body[0])
        body.append(stmt)
    code = compile(ast.Module(body=body, type_ignores=[]), upstream.__file__, "exec")
    namespace = dict(vars(upstream), __add_mappa_args__=add_mappa_args)
    saved, sys.argv = sys.argv, [sys.argv[0]] + list(sys.argv[1:] if argv is None else argv)
    try:
        exec(code, namespace)
    finally:
        sys.argv = saved
    return namespace["args"]


def validate(args):
    if args.train.colocate_all or args.train.colocate_actor_ref or args.train.async_enable:
        raise SystemExit("MAPPA runs each agent on its own GPUs: --train.colocate_* and --train.async_enable are not supported yet")
    if not args.vllm.num_engines:
        raise SystemExit("MAPPA generates with vLLM: set --vllm.num_engines (per agent; a topology may override it)")
    if not args.data.prompt_dataset:
        raise SystemExit("--data.prompt_dataset: the task file (JSON list or JSONL with prompt/answer) is required")
    unit = args.rollout.micro_batch_size * args.actor.num_nodes * args.actor.num_gpus_per_node
    if args.train.batch_size % unit:
        raise SystemExit(f"--train.batch_size ({args.train.batch_size}) must be a multiple of --rollout.micro_batch_size "
                         f"x actor GPUs ({unit}) so that every data-parallel rank gets whole micro-batches")
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


def coach_cache_path(args):
    cache = args.mappa.coach.cache
    if cache is None:
        return os.path.join(args.mappa.run_dir, "coach_cache.sqlite")
    return None if cache == "none" else cache


def train(args):
    """Build every agent on the Ray cluster, train, export; returns the agents (their handles stay up)."""
    import ray

    from openrlhf_mappa.coach import build_coach
    from openrlhf_mappa.envs.base import load_tasks
    from openrlhf_mappa.evaluation import load_eval_sets
    from openrlhf_mappa.topology import load_topology
    from openrlhf_mappa.trainer import (MappaTrainer, StartupWatchdog, Watchdog, build_agents, components, find_dead,
                                        prepare_resume)

    topology = load_topology(args.mappa.topology, model_override=args.mappa.model)
    validate(args)
    tasks = load_tasks(args.data.prompt_dataset)[: args.data.max_samples]
    # --eval.dataset: comma-separated task files, each evaluated before training, every --eval.steps and at the end.
    eval_sets = load_eval_sets([p for p in (args.eval.dataset or "").split(",") if p])
    if len(tasks) < args.rollout.batch_size:
        raise SystemExit(f"{args.data.prompt_dataset}: {len(tasks)} tasks, fewer than --rollout.batch_size {args.rollout.batch_size}")
    c = args.mappa.coach
    coach = build_coach(
        c.kind, template=topology.coach_template, model=c.model, base_url=c.base_url, cache_path=coach_cache_path(args),
        api_key_env=c.api_key_env, timeout_s=c.timeout, max_concurrency=c.max_concurrency, max_retries=c.max_retries,
        rpm=c.rpm, structured=c.structured, format_retries=c.format_retries, max_tokens=c.max_tokens,
    )

    if not ray.is_initialized():
        ray.init(runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    steps = (len(tasks) // args.rollout.batch_size) * args.train.num_episodes
    per_episode = [a.max_actions for a in topology.agents]  # the actions one actor trains on per episode, at most
    actions_per_step = args.rollout.batch_size * args.rollout.n_samples_per_prompt * (
        sum(per_episode) if args.mappa.shared_policy else max(per_episode))
    max_steps = steps * max(1, actions_per_step // args.train.batch_size)
    start = prepare_resume(args, topology)
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
