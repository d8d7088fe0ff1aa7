"""The `mappa` command: project tools (`mappa check`, `mappa plan`, `mappa doctor`, `mappa eval`, `mappa report`,
`mappa paper-table`, `mappa tiny-model`, `mappa merge-lora`, `mappa coach score`, `mappa sandbox run`,
`mappa dsbench make-pack|import|score`)."""

import json
import os
import sys
from pathlib import Path

from openrlhf_mappa.cli.train_mappa_ray import (COUNT, FRACTION, NONNEGATIVE, NONNEGATIVE_INT, POSITIVE, Parser, ranged,
                                                refusals)

# Every tool checks its input before its heavy imports (torch, transformers, vLLM, Ray) and refuses bad input as
# the launcher does: its message alone, no traceback (MAPPA_TRACEBACK=1 shows one), exit 1 (argparse's: 2).


# `mappa plan` and `mappa doctor` take train_mappa_ray's flags (parse_args): their help, in `mappa --help` and theirs.
PLAN_HELP = ("which GPU holds which agent's actor, reference and engines, and the memory each needs per phase; takes "
             "train_mappa_ray's flags, the cluster as --mappa.gpus N --mappa.gpu_memory_gib G (default: this "
             "machine's GPUs; with no GPU here and no --mappa.gpu_memory_gib: the GPU counts); exit 1 when it does "
             "not fit, with what to change, in order")
DOCTOR_HELP = ("the cluster self-check before a long job: takes the training command's flags, with --mappa.model a "
               "small model; sends the coach one request, plans the recipe's own models on the cluster, starts the "
               "team as planned, runs one step of each component and checks weight syncs, sleep, threads, host memory "
               "and (with --ds.adam_offload) DeepSpeed's CPU Adam on each node; a table of checks, exit 1 on a failure")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"]:  # its flags are train_mappa_ray's, which argparse cannot pass through a subparser
        sys.exit(plan_main(argv[1:]))
    if argv[:1] == ["doctor"]:
        sys.exit(doctor_main(argv[1:]))
    if argv[:1] == ["check"]:
        sys.exit(check_main(argv[1:]))
    parser, eval_parser, score_parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "eval":
        eval_main(eval_parser, args)
    elif args.command == "coach":
        rescore_main(score_parser, args)
    elif args.command == "tiny-model":
        from openrlhf_mappa.tiny_model import build_tiny_model

        with refusals("mappa tiny-model:"):  # build_tiny_model checks its arguments before it imports torch
            not_a_directory(args.out_dir)
            out = build_tiny_model(args.out_dir, args.seed, args.hidden_size, args.layers, args.vocab_size,
                                   args.init_std)
        print(f"tiny model written to {out}")
    elif args.command == "merge-lora":
        merge_lora_main(args)
    elif args.command == "sandbox":
        sandbox_main(args)
    elif args.command == "dsbench":
        sys.exit(dsbench(args))
    elif args.command == "report":
        from openrlhf_mappa.report import write_report

        with refusals("mappa report:"):
            if args.out:
                out_file(args.out, "--out")
            print(write_report(*args.run_dirs, out=args.out))
    elif args.command == "paper-table":
        from openrlhf_mappa import paper_table

        with refusals("mappa paper-table:"):
            if args.out:
                out_file(args.out + ".md", "--out")
            text, paths = paper_table.write(args.run_dirs, args.out)
        print(f"{text}\n{paths[0]}\n{paths[1]}")


def build_parser():
    """The tools' arguments: (the parser, eval's and coach score's, whose errors eval_main and rescore_main report)."""
    parser = Parser(prog="mappa", description="openrlhf_mappa tools")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("plan", help=PLAN_HELP)
    sub.add_parser("doctor", help=DOCTOR_HELP)

    sub.add_parser("check", help="the dry run: every check the launcher runs before Ray starts (topology, flags, "
                   "models, task and eval files, the environment on each task type, resume, this machine's packages, "
                   "the plan where --mappa.gpus/--mappa.gpu_memory_gib are given, the coach scoring one test action), "
                   "as a table; takes train_mappa_ray's flags; exit 1 on a failure; starts no Ray")

    eval_parser = add_eval_parser(sub)

    p = sub.add_parser("tiny-model", help="build a tiny causal LM + byte-level tokenizer offline (for tests/demos)")
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden-size", type=COUNT, default=128, help="a multiple of 32 (head_dim is 32)")
    p.add_argument("--layers", type=COUNT, default=2)
    p.add_argument("--vocab-size", type=COUNT, default=320)
    p.add_argument("--init-std", type=POSITIVE, default=0.02,
                   help="initial weight std; smaller: next-token odds closer to uniform, alike for every seed")

    p = sub.add_parser("merge-lora", help="a LoRA agent's export (its adapter) merged into its base: one HF model")
    p.add_argument("adapter_dir", help="the agent's HF export, PEFT format (DIR/AGENT of --ckpt.output_dir)")
    p.add_argument("out_dir")

    score_parser = add_coach_parser(sub)

    p = sub.add_parser("sandbox", help="run a Python file in the code sandbox agents use")
    sandbox_sub = p.add_subparsers(dest="sandbox_command", required=True)
    p = sandbox_sub.add_parser("run", help="run FILE confined and print the result as JSON")
    p.add_argument("file")
    p.add_argument("--workspace", default=".", help="the directory the code runs in (default: the current one)")
    p.add_argument("--timeout", type=POSITIVE, default=10.0, help="wall-clock seconds")
    p.add_argument("--memory-mb", type=COUNT, default=4096)

    p = sub.add_parser("dsbench", help="DSBench tasks: build the offline pack, import real data, score a submission")
    ds = p.add_subparsers(dest="dsbench_command", required=True)
    q = ds.add_parser("make-pack", help="offline tasks from scikit-learn's bundled datasets (no download)")
    q.add_argument("out_dir")
    q.add_argument("--seed", type=int, default=0)
    q = ds.add_parser("import", help="task directories + tasks.jsonl from the official DSBench data layout")
    q.add_argument("--data-root", required=True, help="the directory holding data_resplit/ and answers/")
    q.add_argument("--metadata", required=True, help="JSON Lines metadata, e.g. dsbench_modeling_train.json")
    q.add_argument("--out", required=True, help="output directory (task directories and tasks.jsonl)")
    q = ds.add_parser("score", help="validate and score a submission; prints the metrics as JSON")
    q.add_argument("--task-dir", required=True)
    q.add_argument("--submission", required=True)

    p = sub.add_parser("report", help="write a self-contained HTML report of training runs (curves, coach, episodes)")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="a run's --mappa.run_dir (metrics.jsonl, episodes.jsonl, eval.jsonl); several: overlaid")
    p.add_argument("--out", help="the HTML file to write (default: RUN_DIR/report.html; several runs: the first's "
                   "compare.html)")
    p = sub.add_parser("paper-table", help="the paper's table from runs' eval.jsonl: each eval set's first (step 0) "
                       "and last evaluation side by side; MathChat's accuracy under both graders, DSBench's success "
                       "rate and metrics; Markdown and JSON")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run's --mappa.run_dir (its eval.jsonl)")
    p.add_argument("--out", help="write OUT.md and OUT.json (default: the first RUN_DIR's paper_table.md, .json)")
    return parser, eval_parser, score_parser


def add_eval_parser(sub):
    """`mappa eval`; its parser is returned for the errors eval_main reports."""
    p = sub.add_parser("eval", help="evaluate a team on task files: pass@1 accuracy or DSBench scores, and behaviour")
    p.add_argument("--topology", required=True, help="topology YAML (agents, env)")
    p.add_argument("--data", required=True, nargs="+", help="task files (JSON list or JSONL), e.g. amc_eval_32.json")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--model", help="one model (HF id or path) for every agent, e.g. the untrained base model")
    g.add_argument("--checkpoint", help="a run's HF exports (--ckpt.output_dir): the model of agent A is DIR/A")
    p.add_argument("--agent-model", action="append", default=[], metavar="AGENT=MODEL", help="one agent's model")
    p.add_argument("--n-samples", type=COUNT, default=4, help="samples per problem; accuracy is their mean (pass@1)")
    p.add_argument("--temperature", type=NONNEGATIVE, default=0.6)
    p.add_argument("--top-p", type=ranged(float, 0, 1, above=True), default=1.0)
    p.add_argument("--max-new-tokens", type=COUNT, default=1024, help="per action, unless the topology sets it")
    p.add_argument("--max-len", type=COUNT, default=8192, help="prompt + response tokens")
    p.add_argument("--limit", type=NONNEGATIVE_INT, default=0, help="only the first N tasks of each file (0: all)")
    p.add_argument("--out", default="eval_results.json", help="results; the episodes go to <out>.episodes.jsonl")
    p.add_argument("--workspace", default=None, help="code workspaces (default: a temporary directory)")
    p.add_argument("--num-engines", type=COUNT, default=1, help="vLLM engines per distinct model")
    p.add_argument("--tensor-parallel-size", type=COUNT, default=1)
    p.add_argument("--gpu-memory-utilization", type=ranged(float, 0, 1, above=True), default=0.9)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--coach-model", help="also grade with this coach (the topology's coach prompt and score key, at "
                   "--coach-base-url): accuracy_coach, the authors' grader (its ANSWER_CORRECT line on the final "
                   "agent's last action, else its score), beside the environment's accuracy")
    p.add_argument("--coach-base-url", help="the coach's OpenAI-compatible endpoint, e.g. http://localhost:8001/v1")
    p.add_argument("--coach-api-key-env", default="OPENAI_API_KEY")
    p.add_argument("--coach-structured", choices=["auto", "json_schema", "off"], default="off",
                   help="off (default): free text, as the authors' coach, so it can write its ANSWER_CORRECT line "
                        "(a JSON schema leaves room for the score alone)")
    p.add_argument("--coach-price-in", type=NONNEGATIVE, default=0.0, help="USD per 1M prompt tokens: coach/cost_usd")
    p.add_argument("--coach-price-out", type=NONNEGATIVE, default=0.0, help="USD per 1M completion tokens")
    return p


def add_coach_parser(sub):
    """`mappa coach score`; its parser is returned for the errors rescore_main reports."""
    p = sub.add_parser("coach", help="coach tools")
    coach_sub = p.add_subparsers(dest="coach_command", required=True)
    p = coach_sub.add_parser("score", help="re-score saved episodes with another coach or template; print the "
                             "agreement")
    p.add_argument("--episodes", required=True, help="episodes.jsonl of a run")
    p.add_argument("--out", required=True, help="one line per action with both verdicts; summary in <out>.summary.json")
    p.add_argument("--kind", choices=["openai", "heuristic"], default="openai")
    p.add_argument("--mode", choices=["per_action", "hindsight", "both"], default="per_action",
                   help="per_action: one request per action; hindsight: one review per episode (its trajectory and "
                        "outcome); both: the two combined as in training (--mappa.coach.mode)")
    p.add_argument("--model", help="coach model at the OpenAI-compatible server")
    p.add_argument("--base-url", help="e.g. http://localhost:8000/v1")
    p.add_argument("--template", help="a text file with the coach prompt template (not needed with --mode hindsight)")
    p.add_argument("--topology", help="take the coach prompt templates and score key from this topology YAML")
    p.add_argument("--review-template", help="a text file with the hindsight prompt template (default: the "
                   "topology's review_template, else the built-in one)")
    p.add_argument("--score-key", help="a text reply states its score on the line `KEY: <n>` "
                   "(default: the topology's score_key, else PROCESS_SCORE)")
    p.add_argument("--api-key-env", default="OPENAI_API_KEY")
    p.add_argument("--cache", default=None, help="SQLite verdict cache to read and extend (default: none)")
    p.add_argument("--timeout", type=POSITIVE, default=60.0)
    p.add_argument("--max-concurrency", type=COUNT, default=32)
    p.add_argument("--max-retries", type=NONNEGATIVE_INT, default=4)
    p.add_argument("--rpm", type=NONNEGATIVE, default=0.0)
    p.add_argument("--structured", choices=["auto", "json_schema", "off"], default="auto")
    p.add_argument("--max-tokens", type=NONNEGATIVE_INT, default=0,
                   help="coach reply token limit (0: the server's default)")
    p.add_argument("--max-failure-fraction", type=FRACTION, default=0.5,
                   help="exit 1 when more than this fraction of the new verdicts failed (the output is still written)")
    return p


def sandbox_main(args):
    """`mappa sandbox run`: FILE (UTF-8 text) in the agents' sandbox, the result as JSON."""
    import dataclasses

    from openrlhf_mappa.sandbox import run_python

    with refusals("mappa sandbox run:"):
        code = Path(args.file).read_bytes()
        try:
            code = code.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{args.file}: not UTF-8 text ({e})") from None
        not_a_directory(args.workspace)
    result = run_python(code, args.workspace, timeout_s=args.timeout, memory_mb=args.memory_mb)
    print(json.dumps(dataclasses.asdict(result), indent=2))


def not_a_directory(path: str) -> None:
    """Refuse an output or working directory that is an existing file."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{path}: exists and is not a directory")


def out_file(path: str, flag: str) -> None:
    """Refuse an output file that could not be written, before the work whose results it would hold."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: there is no directory {parent} to write it in")
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path}: is a directory")


def merge_lora_main(args):
    """`mappa merge-lora`: the adapter, its config and its base model checked before peft and torch load."""
    from openrlhf_mappa.episode import read_record
    from openrlhf_mappa.topology import check_model

    with refusals("mappa merge-lora:"):
        config = os.path.join(args.adapter_dir, "adapter_config.json")
        if not os.path.isfile(config):
            raise ValueError(f"{args.adapter_dir} holds no adapter_config.json (not a LoRA agent's export)")
        base = read_record(config, "the adapter's config").get("base_model_name_or_path")
        if not isinstance(base, str) or not base:
            raise ValueError(f"{config}: no base_model_name_or_path (the model the adapter was trained on)")
        check_model(base, f"{config}: its base model")
        not_a_directory(args.out_dir)
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    model = AutoPeftModelForCausalLM.from_pretrained(args.adapter_dir, dtype="auto").merge_and_unload()
    model.save_pretrained(args.out_dir)
    AutoTokenizer.from_pretrained(args.adapter_dir).save_pretrained(args.out_dir)
    print(f"{args.adapter_dir} merged into {model.config._name_or_path}: {args.out_dir}")


def plan_main(argv) -> int:
    """`mappa plan`: the launch's plan and check without a cluster, on this machine's GPUs unless given; with no
    GPU memory known, the counts are checked (as the launcher does)."""
    from openrlhf_mappa import placement
    from openrlhf_mappa.cli.train_mappa_ray import accepted, parse_args, validate
    from openrlhf_mappa.topology import check_model, load_topology

    args = parse_args(argv, prog="mappa plan", description=PLAN_HELP)
    with refusals("mappa plan:"):
        topology = load_topology(args.mappa.topology, model_override=args.mappa.model)
        validate(args, topology)
        # A hub id resolved as the launcher does: one out of reach is refused at once, not "fits" after minutes of
        # retries. A directory needs only its config.json here (tests/fixtures hold no weights or tokenizer).
        for spec in placement.trainee_specs(args, topology):
            label = "--mappa.model" if args.mappa.model else f"{args.mappa.topology}: agent {spec.name!r}"
            if not os.path.isdir(spec.model):
                check_model(spec.model, label if spec in topology.agents else "--mappa.coach.model")
    gpus, gib = args.mappa.gpus, args.mappa.gpu_memory_gib
    if gpus is None or gib is None:
        found = placement.detect_gpus()
        gpus, gib = gpus if gpus is not None else found[0], gib if gib is not None else found[1]
        if found[0]:  # planning on a node of the cluster: its host memory and GPU count, unless given
            args.mappa.host_memory_gib = args.mappa.host_memory_gib or placement.host_memory_gib()
            args.mappa.gpus_per_node = args.mappa.gpus_per_node or found[0]
    plan = placement.make_plan(args, topology, gib)
    memory = f" of {gib:g} GiB" if gib else ""
    cluster = f"{gpus} GPUs{memory}" if gpus else f"as many GPUs{memory} as it needs"
    print(f"mappa plan: {len(topology.agents)} agents on {cluster}{'' if gib else ' (memory not known)'}; placement: "
          f"{placement.PLACEMENTS[args.mappa.colocate]}\n")
    print(placement.format_plan(plan, gpus))
    try:
        placement.check(args, topology, gpus, gib, allowed=accepted(topology))
    except ValueError as e:
        print(f"\nREFUSED: {e}")
        return 1
    verdict = f"\nfits: {plan.need}" + (f" of {gpus}" if gpus else "") + " GPUs"
    if gib is not None:
        print(verdict)
        return 0
    print(f"{verdict} by count; GPU memory not checked: there is no GPU on this machine and no --mappa.gpu_memory_gib")
    print("Give --mappa.gpu_memory_gib G (one GPU's memory in GiB, as `nvidia-smi --query-gpu=memory.total "
          "--format=csv` reports it; an 80 GB card: 79.6) for each GPU's memory per phase and the memory check")
    return 0


def check_main(argv) -> int:
    """`mappa check`: the launch's checks (Preflight), each whose inputs passed, as a table of what each found or
    why it failed; exit 1 on a failure. No Ray, no model weights: seconds, plus the coach's one reply."""
    import time

    from openrlhf_mappa.cli.train_mappa_ray import Preflight, parse_args

    args = parse_args(argv, prog="mappa check")
    pre, failed, rows = Preflight(args, score_one=True), [], []
    for what, method, needs in Preflight.STEPS:
        blocked = [step for step in needs if step in failed]
        if blocked:
            failed.append(method)
            rows.append(("-", what, f"not run: it needs {', '.join(blocked)}", ""))
            continue
        t0 = time.time()
        try:
            said = getattr(pre, method)() or ""
            rows.append(("ok", what, said, f"{time.time() - t0:.1f} s"))
        except (ValueError, OSError, AssertionError, ImportError, SystemExit) as e:
            failed.append(method)
            rows.append(("FAILED", what, str(e).removeprefix("[mappa] "), f"{time.time() - t0:.1f} s"))
    width = max(len(what) for _, what, _, _ in rows)
    for verdict, what, said, took in rows:
        print(f"{verdict:<6}  {what:<{width}}  {took:>7}  {said}")
    print(f"\nmappa check: {len(rows) - len(failed)} of {len(rows)} checks passed"
          + (f"; fix the failed ones before launching" if failed else "; nothing found that would stop the launch"))
    return 1 if failed else 0


def doctor_main(argv) -> int:
    """`mappa doctor`: the launch's checks, the coach's one request, then the cluster's (doctor.py), with the plan of
    the recipe's own models; Ray's output into <run_dir>/doctor.log."""
    import contextlib

    from openrlhf_mappa.cli.train_mappa_ray import accepted, check_team, check_this_machine, output_to, parse_args

    args = parse_args(argv, prog="mappa doctor", description=DOCTOR_HELP)
    with refusals():
        topology = check_team(args)
        check_this_machine(args, topology)
    rows = [coach_row(args, topology)]
    recipe, skipped = recipe_team(args)
    rows += [("recipe's plan", "-", None, f"skipped: {skipped}")] if skipped else []
    os.makedirs(args.mappa.run_dir, exist_ok=True)
    log = os.path.join(args.mappa.run_dir, "doctor.log")
    if not args.mappa.verbose:
        print(f"[mappa] doctor: Ray's, vLLM's and DeepSpeed's output goes to {os.path.abspath(log)}", flush=True)
    with contextlib.nullcontext() if args.mappa.verbose else output_to(log):
        import ray

        from openrlhf_mappa.doctor import doctor

        failed = doctor(args, topology, rows, recipe, accepted(recipe) if recipe else None)
        ray.shutdown()  # Ray prints its workers' last lines as it shuts down: into the log too
    return failed


def coach_row(args, topology) -> tuple:
    """The doctor's row for the coach: `mappa check`'s request (Preflight.coach), one test action scored."""
    from openrlhf_mappa.cli.train_mappa_ray import Preflight

    pre = Preflight(args, score_one=True)
    pre.topology = topology
    try:
        return "coach", "-", True, pre.coach() or ""
    except (ValueError, OSError, ImportError, SystemExit) as e:  # as `mappa check` reports a failed check
        return "coach", "-", False, str(e).removeprefix("[mappa] ")


def recipe_team(args) -> tuple:
    """(the topology with its own models, why it is not planned): with --mappa.model the doctor's team runs the
    small model, and the recipe's models are planned on the cluster too (doctor.recipe_plan). None without
    --mappa.model: the team's plan is the recipe's."""
    from openrlhf_mappa.topology import check_model, load_topology

    if not args.mappa.model:
        return None, None
    recipe = load_topology(args.mappa.topology)
    try:
        for spec in recipe.agents:
            check_model(spec.model, f"{args.mappa.topology}: agent {spec.name!r}")
    except (ValueError, SystemExit) as e:  # the launch itself refuses it before Ray, in seconds
        return None, str(e).removeprefix("[mappa] ")
    return recipe, None


def eval_inputs(parser, args):
    """`mappa eval`'s every input, checked before vLLM and Ray load: (topology, agent -> model, agent -> its
    adapter's config for a LoRA agent's export, dataset -> tasks)."""
    from openrlhf_mappa.episode import read_record
    from openrlhf_mappa.evaluation import load_eval_sets
    from openrlhf_mappa.topology import check_model, load_topology

    with refusals("mappa eval:"):
        topology = load_topology(args.topology, model_override=args.model)
        models = {spec.name: spec.model for spec in topology.agents}
        if args.checkpoint:
            models = {name: os.path.join(args.checkpoint, name) for name in models}
        for item in args.agent_model:
            name, _, model = item.partition("=")
            if name not in models or not model:
                parser.error(f"--agent-model {item!r}: expected AGENT=MODEL with AGENT one of {', '.join(models)}")
            models[name] = model
        for name, model in models.items():
            if args.checkpoint and not os.path.isdir(model):
                parser.error(f"--checkpoint: no model for agent {name!r} at {model} (expected one HF export per agent)")
        for spec in topology.agents:
            if (spec.max_new_tokens or args.max_new_tokens) >= args.max_len:
                where = (f"agent {spec.name!r}'s max_new_tokens in the topology" if spec.max_new_tokens
                         else "--max-new-tokens")
                parser.error(f"{where} ({spec.max_new_tokens or args.max_new_tokens}) must be below --max-len "
                             f"({args.max_len}), which holds the prompt and the reply together")
        # A LoRA agent's export is its adapter in PEFT format: its base model's engines serve it by the agent's name.
        adapters = {}
        for name, model in models.items():
            if os.path.isfile(os.path.join(model, "adapter_config.json")):
                adapters[name] = read_record(os.path.join(model, "adapter_config.json"), "the adapter's config")
                adapters[name]["dir"], models[name] = model, adapters[name].get("base_model_name_or_path") or ""
        for name, model in models.items():
            base = f" (the base of its adapter {adapters[name]['dir']})" if name in adapters else ""
            check_model(model, f"agent {name!r}{base}")
        from openrlhf_mappa.cli.train_mappa_ray import lora_engines_tp

        if adapters and (why := lora_engines_tp(args.tensor_parallel_size, "--tensor-parallel-size")):
            parser.error(f"LoRA adapters ({', '.join(adapters)}): {why}")
        datasets = load_eval_sets(args.data, args.limit)
        topology.check_env([t for tasks in datasets.values() for t in tasks], args.topology)
        out_file(args.out, "--out")
        if args.workspace:
            not_a_directory(args.workspace)
        coach = eval_coach(parser, args, topology)
    return topology, models, adapters, datasets, coach


def eval_coach(parser, args, topology):
    """`mappa eval`'s grading coach (--coach-model), probed before any engine starts; None without one."""
    import asyncio

    from openrlhf_mappa.coach import build_coach

    if bool(args.coach_model) != bool(args.coach_base_url):
        parser.error("--coach-model and --coach-base-url go together (the coach that grades the episodes)")
    if not args.coach_model:
        return None
    topology.check_coach_template(args.topology, "openai", "per_action")
    make = lambda: build_coach("openai", template=topology.coach_template, model=args.coach_model,
                               base_url=args.coach_base_url, api_key_env=args.coach_api_key_env,
                               structured=args.coach_structured, score_key=topology.score_key)
    asyncio.run(make().probe())  # by a coach of its own: an HTTP session belongs to the event loop it ran on
    return make()


def eval_main(parser, args):
    """Team evaluation on vLLM engines (one group per distinct model, so agents sharing a base model share
    engines), through the training rollout minus the coach; see evaluation.py."""
    topology, models, adapters, datasets, coach = eval_inputs(parser, args)

    import asyncio
    import tempfile

    import ray
    from openrlhf.trainer.ray import create_vllm_engines
    from transformers import AutoTokenizer

    from openrlhf_mappa.evaluation import coach_cost, evaluate, format_table, summarize
    from openrlhf_mappa.rollout import AgentPolicy

    if not ray.is_initialized():
        ray.init(runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    engines, tokenizers = {}, {}
    group = lambda name: (models[name], name in adapters)  # a base's adapters get engines of their own, with LoRA
    for model, lora in dict.fromkeys(map(group, models)):
        if lora:
            served = {n: a for n, a in adapters.items() if group(n) == (model, True)}
            engines[model, lora] = pool_engines(args, model, served)
        else:
            engines[model, lora] = create_vllm_engines(
                args.num_engines, args.tensor_parallel_size, model, args.seed, False, False, args.enforce_eager,
                args.max_len, None, args.gpu_memory_utilization, False)
        tokenizers[model] = AutoTokenizer.from_pretrained(model, trust_remote_code=True)
    policies = {spec.name: AgentPolicy(engines=engines[group(spec.name)], tokenizer=tokenizers[models[spec.name]],
                                       max_new_tokens=spec.max_new_tokens or args.max_new_tokens, max_len=args.max_len,
                                       sampling=dict(temperature=args.temperature, top_p=args.top_p),
                                       adapter=spec.name if spec.name in adapters else None)
                for spec in topology.agents}
    workspace = args.workspace or tempfile.mkdtemp(prefix="mappa-eval-")

    async def every_dataset():  # one event loop: the coach's HTTP session belongs to the loop it first ran on
        played = {dataset: await evaluate(topology, tasks, policies, args.n_samples, os.path.join(workspace, dataset),
                                          coach=coach) for dataset, tasks in datasets.items()}
        if coach:
            await coach.aclose()
        return played

    results, summaries = {}, {}
    with open(args.out + ".episodes.jsonl", "w", encoding="utf-8") as f:
        for dataset, episodes in asyncio.run(every_dataset()).items():
            f.writelines(ep.to_json() + "\n" for ep in episodes)
            summary, problems = summarize(episodes, list(models), datasets[dataset])
            summary.update(coach_cost(episodes, args.coach_price_in, args.coach_price_out))
            results[dataset], summaries[dataset] = {"summary": summary, "problems": problems}, summary
    settings = {k: getattr(args, k) for k in ("n_samples", "temperature", "top_p", "max_new_tokens", "max_len", "seed",
                                              "coach_model", "coach_structured")}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"models": models, "adapters": {n: a["dir"] for n, a in adapters.items()}, "settings": settings,
                   "datasets": results}, f, indent=1)
    print(format_table(summaries))
    print(f"\nresults: {args.out}\nepisodes: {args.out}.episodes.jsonl")


def pool_engines(args, model: str, adapters: dict) -> list:
    """`mappa eval`'s engines for LoRA agents on one base: vLLM with LoRA, each agent's adapter (its export's
    files, under its name) loaded, as the training run's pool serves them."""
    import glob

    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from openrlhf_mappa.agent_trainer import PoolEngine
    from openrlhf_mappa.placement import pool_max_rank

    pg = placement_group([{"GPU": 1, "CPU": 1}] * args.num_engines, strategy="PACK")
    engines = [
        PoolEngine.options(num_cpus=1, num_gpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i)).remote(
            model=model, enforce_eager=args.enforce_eager, tensor_parallel_size=1, seed=args.seed + i,
            max_model_len=args.max_len, dtype="bfloat16", trust_remote_code=True, num_gpus=1,
            gpu_memory_utilization=args.gpu_memory_utilization, distributed_executor_backend="uni",
            enable_lora=True, max_loras=len(adapters), max_lora_rank=pool_max_rank([a["r"] for a in adapters.values()]),
        )
        for i in range(args.num_engines)
    ]
    for name, adapter in adapters.items():
        paths = glob.glob(os.path.join(adapter["dir"], "adapter_*"))
        files = {os.path.basename(f): open(f, "rb").read() for f in paths}
        ray.get([e.load_adapter.remote(name, files) for e in engines])
    return engines


def rescore_main(parser, args):
    from openrlhf_mappa.coach import DEFAULT_SCORE_KEY, build_coach
    from openrlhf_mappa.coach import rescore
    from openrlhf_mappa.coach.audit import FAILED_STATUSES

    if not (args.template or args.topology) and args.kind == "openai" and args.mode != "hindsight":
        parser.error(f"coach score --mode {args.mode}: give the coach prompt with --template FILE or --topology YAML")
    with refusals("mappa coach score:"):
        topology = None
        if args.topology:
            from openrlhf_mappa.topology import load_topology

            topology = load_topology(args.topology)
            if not args.template:
                topology.check_coach_template(args.topology, args.kind, args.mode)
        template = topology.coach_template if topology else None
        review_template = topology.review_template if topology else None
        if args.template:
            template = Path(args.template).read_text(encoding="utf-8")
        if args.review_template:
            review_template = Path(args.review_template).read_text(encoding="utf-8")
        options = {}
        if args.kind == "openai":
            options = dict(api_key_env=args.api_key_env, timeout_s=args.timeout, max_concurrency=args.max_concurrency,
                           max_retries=args.max_retries, rpm=args.rpm, structured=args.structured,
                           max_tokens=args.max_tokens, review_template=review_template,
                           score_key=args.score_key or (topology.score_key if topology else DEFAULT_SCORE_KEY))
        coach = build_coach(args.kind, template=template, model=args.model, base_url=args.base_url,
                            cache_path=args.cache, **options)
        actions = rescore.read_actions(args.episodes)
        if not actions:
            raise ValueError(f"{args.episodes}: no actions to re-score")
        out_file(args.out, "--out")
        rows, summary = rescore.run(actions, args.out, coach, args.mode)
    before = next((a["verdict"]["coach"] for _, a in actions if a.get("verdict")), "?")
    rescore.print_summary(summary, before, coach.name)
    print(f"\nboth verdicts per action: {args.out}\nsummary: {args.out}.summary.json")
    # As in training (--mappa.coach.max_failure_fraction): a re-score made mostly of failed verdicts says
    # nothing about the coach's agreement, and a script or CI job must see it as a failure, not read the table.
    failed = [r["after"] for r in rows if r["after"]["status"] in FAILED_STATUSES]
    if len(failed) / len(rows) > args.max_failure_fraction:
        first = failed[0]
        sys.exit(f"mappa coach score: {len(failed)} of {len(rows)} verdicts failed (more than "
                 f"--max-failure-fraction {args.max_failure_fraction}). First failure: {first['status']}: "
                 f"{first['rationale'][:500]}")


def dsbench(args) -> int:
    """Exit status: 0 done (a valid submission), 1 an invalid submission or nothing imported, 2 bad input."""
    from openrlhf_mappa.envs import dsbench_tasks  # pandas and scikit-learn load only where needed

    try:
        if args.dsbench_command == "score":
            from openrlhf_mappa.envs.dsbench import score_submission

            result = score_submission(args.task_dir, args.submission)
            print(json.dumps(result))
            return 0 if result["valid"] else 1
        if args.dsbench_command == "make-pack":
            tasks, skipped = dsbench_tasks.make_pack(args.out_dir, args.seed)
            out = args.out_dir
        else:
            tasks, skipped = dsbench_tasks.import_tasks(args.data_root, args.metadata, args.out)
            out = args.out
    except (OSError, ValueError) as e:
        print(f"mappa dsbench {args.dsbench_command}: {e}", file=sys.stderr)
        return 2
    for reason in skipped:
        print(f"skipped {reason}", file=sys.stderr)
    if not tasks:
        print(f"no task imported ({len(skipped)} skipped)", file=sys.stderr)
        return 1
    print(f"{len(tasks)} task(s) in {out}/tasks.jsonl ({len(skipped)} skipped)")
    return 0


if __name__ == "__main__":
    main()
