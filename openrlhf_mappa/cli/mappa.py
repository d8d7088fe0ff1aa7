"""The `mappa` command: project tools (`mappa tiny-model`, `mappa coach score`, `mappa sandbox run`,
`mappa dsbench make-pack|import|score`, `mappa report`)."""

import argparse
import json
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(prog="mappa", description="openrlhf_mappa tools")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("tiny-model", help="build a tiny causal LM + byte-level tokenizer offline (for tests/demos)")
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden-size", type=int, default=128, help="a multiple of 32 (head_dim is 32)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=320)

    p = sub.add_parser("coach", help="coach tools")
    coach_sub = p.add_subparsers(dest="coach_command", required=True)
    p = coach_sub.add_parser("score", help="re-score saved episodes with another coach or template; print the agreement")
    p.add_argument("--episodes", required=True, help="episodes.jsonl of a run")
    p.add_argument("--out", required=True, help="one line per action with both verdicts; summary in <out>.summary.json")
    p.add_argument("--kind", choices=["openai", "heuristic"], default="openai")
    p.add_argument("--model", help="coach model at the OpenAI-compatible server")
    p.add_argument("--base-url", help="e.g. http://localhost:8000/v1")
    p.add_argument("--template", help="a text file with the coach prompt template")
    p.add_argument("--topology", help="take the coach prompt template from this topology YAML")
    p.add_argument("--api-key-env", default="OPENAI_API_KEY")
    p.add_argument("--cache", default=None, help="SQLite verdict cache to read and extend (default: none)")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--max-retries", type=int, default=4)
    p.add_argument("--rpm", type=float, default=0.0)
    p.add_argument("--structured", choices=["auto", "json_schema", "off"], default="auto")
    p.add_argument("--max-tokens", type=int, default=0, help="coach reply token limit (0: the server's default)")

    p = sub.add_parser("sandbox", help="run a Python file in the code sandbox agents use")
    sandbox_sub = p.add_subparsers(dest="sandbox_command", required=True)
    p = sandbox_sub.add_parser("run", help="run FILE confined and print the result as JSON")
    p.add_argument("file")
    p.add_argument("--workspace", default=".", help="the directory the code runs in (default: the current one)")
    p.add_argument("--timeout", type=float, default=10.0, help="wall-clock seconds")
    p.add_argument("--memory-mb", type=int, default=4096)

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

    p = sub.add_parser("report", help="write a self-contained HTML report of a training run (curves, coach, episodes)")
    p.add_argument("run_dir", help="the run's --mappa.run_dir (metrics.jsonl, episodes.jsonl, eval.jsonl)")
    p.add_argument("--out", help="the HTML file to write (default: RUN_DIR/report.html)")

    args = parser.parse_args(argv)
    if args.command == "coach":
        rescore_main(parser, args)
    elif args.command == "tiny-model":
        from openrlhf_mappa.tiny_model import build_tiny_model

        out = build_tiny_model(args.out_dir, args.seed, args.hidden_size, args.layers, args.vocab_size)
        print(f"tiny model written to {out}")
    elif args.command == "sandbox":
        import dataclasses

        from openrlhf_mappa.sandbox import run_python

        with open(args.file, encoding="utf-8") as f:
            code = f.read()
        result = run_python(code, args.workspace, timeout_s=args.timeout, memory_mb=args.memory_mb)
        print(json.dumps(dataclasses.asdict(result), indent=2))

    elif args.command == "dsbench":
        sys.exit(dsbench(args))
    elif args.command == "report":
        from openrlhf_mappa.report import write_report

        try:
            print(write_report(args.run_dir, args.out))
        except (OSError, ValueError) as e:
            raise SystemExit(f"mappa report: {e}")


def rescore_main(parser, args):
    from openrlhf_mappa.coach import build_coach
    from openrlhf_mappa.coach import rescore

    template = None
    if args.template:
        with open(args.template, encoding="utf-8") as f:
            template = f.read()
    elif args.topology:
        from openrlhf_mappa.topology import load_topology

        template = load_topology(args.topology).coach_template
    elif args.kind == "openai":
        parser.error("coach score: give the coach prompt with --template FILE or --topology YAML")
    options = {}
    if args.kind == "openai":
        options = dict(api_key_env=args.api_key_env, timeout_s=args.timeout, max_concurrency=args.max_concurrency,
                       max_retries=args.max_retries, rpm=args.rpm, structured=args.structured,
                       max_tokens=args.max_tokens)
    try:
        coach = build_coach(args.kind, template=template, model=args.model, base_url=args.base_url,
                            cache_path=args.cache, **options)
        actions = rescore.read_actions(args.episodes)
        if not actions:
            raise ValueError(f"{args.episodes}: no actions to re-score")
        summary = rescore.run(actions, args.out, coach)
    except ValueError as e:
        raise SystemExit(f"mappa coach score: {e}")
    before = next((a["verdict"]["coach"] for _, a in actions if a.get("verdict")), "?")
    rescore.print_summary(summary, before, coach.name)
    print(f"\nboth verdicts per action: {args.out}\nsummary: {args.out}.summary.json")


def dsbench(args) -> int:
    """Exit status: 0 done (a valid submission), 1 an invalid submission or nothing imported, 2 bad input."""
    from openrlhf_mappa.envs import dsbench_tasks
    from openrlhf_mappa.envs.dsbench import score_submission

    try:
        if args.dsbench_command == "score":
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
