"""The `mappa` command: project tools (`mappa tiny-model OUT_DIR`, ...)."""

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

    args = parser.parse_args(argv)
    if args.command == "tiny-model":
        from openrlhf_mappa.tiny_model import build_tiny_model

        out = build_tiny_model(args.out_dir, args.seed, args.hidden_size, args.layers, args.vocab_size)
        print(f"tiny model written to {out}")


if __name__ == "__main__":
    main()
