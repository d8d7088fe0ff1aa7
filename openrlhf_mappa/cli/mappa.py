"""The `mappa` command: project tools (`mappa tiny-model OUT_DIR`, `mappa dsbench make-pack OUT_DIR`, ...)."""

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

    args = parser.parse_args(argv)
    if args.command == "tiny-model":
        from openrlhf_mappa.tiny_model import build_tiny_model

        out = build_tiny_model(args.out_dir, args.seed, args.hidden_size, args.layers, args.vocab_size)
        print(f"tiny model written to {out}")
    elif args.command == "dsbench":
        sys.exit(dsbench(args))


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
