"""The `mappa` command: project tools (`mappa tiny-model OUT_DIR`, `mappa sandbox run FILE`, ...)."""

import argparse


def main(argv=None):
    parser = argparse.ArgumentParser(prog="mappa", description="openrlhf_mappa tools")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("tiny-model", help="build a tiny causal LM + byte-level tokenizer offline (for tests/demos)")
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden-size", type=int, default=128, help="a multiple of 32 (head_dim is 32)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=320)

    p = sub.add_parser("sandbox", help="run a Python file in the code sandbox agents use")
    sandbox_sub = p.add_subparsers(dest="sandbox_command", required=True)
    p = sandbox_sub.add_parser("run", help="run FILE confined and print the result as JSON")
    p.add_argument("file")
    p.add_argument("--workspace", default=".", help="the directory the code runs in (default: the current one)")
    p.add_argument("--timeout", type=float, default=10.0, help="wall-clock seconds")
    p.add_argument("--memory-mb", type=int, default=4096)

    args = parser.parse_args(argv)
    if args.command == "tiny-model":
        from openrlhf_mappa.tiny_model import build_tiny_model

        out = build_tiny_model(args.out_dir, args.seed, args.hidden_size, args.layers, args.vocab_size)
        print(f"tiny model written to {out}")
    elif args.command == "sandbox":
        import dataclasses
        import json

        from openrlhf_mappa.sandbox import run_python

        with open(args.file, encoding="utf-8") as f:
            code = f.read()
        result = run_python(code, args.workspace, timeout_s=args.timeout, memory_mb=args.memory_mb)
        print(json.dumps(dataclasses.asdict(result), indent=2))


if __name__ == "__main__":
    main()
