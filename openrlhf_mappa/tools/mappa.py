"""The `mappa` command: project tools (`mappa check`, `mappa plan`, `mappa doctor`, `mappa eval`, `mappa
report`, `mappa paper-table`, `mappa tiny-model`, `mappa merge-lora`, `mappa coach score|distill`, `mappa
sandbox run`, `mappa dsbench make-pack|import|score`)."""

import json
import os
import sys
from pathlib import Path

from openrlhf_mappa.cli.flags import (COUNT, FRACTION, NONNEGATIVE_INT, POSITIVE, Parser, add_coach_args,
                                      refusals)
from openrlhf_mappa.cli.train_mappa_ray import refuse, unwritable_dir

# Every tool checks its input before its heavy imports (torch, transformers, vLLM, Ray) and refuses bad input
# as the launcher does: its message alone, no traceback (MAPPA_TRACEBACK=1 shows one), exit 1 (argparse's: 2).


# `mappa plan` and `mappa doctor` take train_mappa_ray's flags (parse_args): their help, in `mappa --help` and
# theirs.
PLAN_HELP = ("which GPU holds which agent's actor, reference and engines, and the memory each needs per "
             "phase; takes train_mappa_ray's flags, the cluster as --mappa.gpus N --mappa.gpu_memory_gib G "
             "(default: this machine's GPUs; with no GPU here and no --mappa.gpu_memory_gib: the GPU "
             "counts); exit 1 when it does not fit, with what to change, in order")
EVAL_HELP = ("evaluate a team on task files: pass@1 accuracy or DSBench scores, and behaviour; takes "
             "train_mappa_ray's flags: --mappa.topology, the task files as --eval.dataset F[,F...], "
             "--eval.n_samples_per_prompt and --eval.temperature, --rollout.max_new_tokens and "
             "--rollout.top_p, --data.max_len, --vllm.* (engines per distinct model), --train.seed, a "
             "grading coach as --mappa.coach.kind openai --mappa.coach.model M --mappa.coach.base_url U; the "
             "models as --mappa.model, --checkpoint DIR or --agent-model AGENT=MODEL")
DOCTOR_HELP = ("the cluster self-check before a long job: takes the training command's flags, with "
               "--mappa.model a small model; sends the coach one request, plans the recipe's own models on "
               "the cluster, starts the team as planned, runs one step of each component and checks weight "
               "syncs, sleep, threads, host memory and (with --ds.adam_offload) DeepSpeed's CPU Adam on each "
               "node; a table of checks, exit 1 on a failure")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    # plan's flags are train_mappa_ray's, which argparse cannot pass through a subparser
    if argv[:1] == ["plan"]:
        sys.exit(plan_main(argv[1:]))
    if argv[:1] == ["doctor"]:
        sys.exit(doctor_main(argv[1:]))
    if argv[:1] == ["check"]:
        sys.exit(check_main(argv[1:]))
    if argv[:1] == ["eval"]:
        sys.exit(eval_main(argv[1:]))
    if argv[:2] == ["coach", "distill"]:  # its other flags are train_sft's, passed through
        parser = distill_parser()
        args, extra = parser.parse_known_args(argv[2:])
        ours = [a for a in extra if a.startswith("--mappa.")]  # train_sft has none: a typo of ours
        if ours:
            parser.error(f"unrecognized arguments: {' '.join(ours)}")
        distill_main(args, extra)
        return
    parser, score_parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "coach":
        rescore_main(score_parser, args)
    elif args.command == "tiny-model":
        from openrlhf_mappa.tools.tiny_model import build_tiny_model

        with refusals("mappa tiny-model:"):  # build_tiny_model checks its arguments before it imports torch
            refuse([unwritable_dir(args.out_dir)], ValueError)
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
        from openrlhf_mappa.tools.report import write_report

        with refusals("mappa report:"):
            if args.out:
                refuse([out_file(args.out, "--out")], ValueError)
            print(write_report(*args.run_dirs, out=args.out))
    elif args.command == "paper-table":
        from openrlhf_mappa.tools import paper_table

        with refusals("mappa paper-table:"):
            if args.out:
                refuse([out_file(args.out + ".md", "--out")], ValueError)
            text, paths = paper_table.write(args.run_dirs, args.out)
        print(f"{text}\n{paths[0]}\n{paths[1]}")


def build_parser():
    """The tools' arguments: (the parser, coach score's, whose errors rescore_main reports)."""
    parser = Parser(prog="mappa", description="openrlhf_mappa tools")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("plan", help=PLAN_HELP)
    sub.add_parser("doctor", help=DOCTOR_HELP)

    sub.add_parser("check",
                   help="the dry run: every check the launcher runs before Ray starts (topology, flags, "
                   "models, task and eval files, the environment on each task type, resume, this machine's "
                   "packages, the plan where --mappa.gpus/--mappa.gpu_memory_gib are given, the coach "
                   "scoring one test action), as a table; takes train_mappa_ray's flags; exit 1 on a "
                   "failure; starts no Ray")

    sub.add_parser("eval", help=EVAL_HELP)

    p = sub.add_parser("tiny-model",
                       help="build a tiny causal LM + byte-level tokenizer offline (for tests/demos)")
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden-size", type=COUNT, default=128, help="a multiple of 32 (head_dim is 32)")
    p.add_argument("--layers", type=COUNT, default=2)
    p.add_argument("--vocab-size", type=COUNT, default=320)
    p.add_argument("--init-std", type=POSITIVE, default=0.02,
                   help="initial weight std; smaller: next-token odds closer to uniform, alike for every "
                        "seed")

    p = sub.add_parser("merge-lora",
                       help="a LoRA agent's export (its adapter) merged into its base: one HF model")
    p.add_argument("adapter_dir", help="the agent's HF export, PEFT format (DIR/AGENT of --ckpt.output_dir)")
    p.add_argument("out_dir")

    score_parser = add_coach_parser(sub)

    p = sub.add_parser("sandbox", help="run a Python file in the code sandbox agents use")
    sandbox_sub = p.add_subparsers(dest="sandbox_command", required=True)
    p = sandbox_sub.add_parser("run", help="run FILE confined and print the result as JSON")
    p.add_argument("file")
    p.add_argument("--workspace", default=".",
                   help="the directory the code runs in (default: the current one)")
    p.add_argument("--timeout", type=POSITIVE, default=10.0, help="wall-clock seconds")
    p.add_argument("--memory-mb", type=COUNT, default=4096)

    p = sub.add_parser("dsbench",
                       help="DSBench tasks: build the offline pack, import real data, score a submission")
    ds = p.add_subparsers(dest="dsbench_command", required=True)
    q = ds.add_parser("make-pack", help="offline tasks from scikit-learn's bundled datasets (no download)")
    q.add_argument("out_dir")
    q.add_argument("--seed", type=int, default=0)
    q = ds.add_parser("import", help="task directories + tasks.jsonl from the official DSBench data layout")
    q.add_argument("--data-root", required=True, help="the directory holding data_resplit/ and answers/")
    q.add_argument("--metadata", required=True, help="JSON Lines metadata, e.g. dsbench_modeling_train.json")
    q.add_argument("--out", required=True, help="output directory (task directories and tasks.jsonl)")
    q.add_argument("--task-text", choices=["cleaned", "raw"], default="cleaned",
                   help="what the agents' {task} shows: the authors' cleaned text (default; the coach keeps "
                        "DSBench's text, as theirs did) or DSBench's raw Kaggle text for both")
    q.add_argument("--cleaned-prompts", metavar="PATH",
                   help="the authors' dsbench_modeling_cleaned_prompts.json (default: beside --metadata)")
    q = ds.add_parser("score", help="validate and score a submission; prints the metrics as JSON")
    q.add_argument("--task-dir", required=True)
    q.add_argument("--submission", required=True)

    p = sub.add_parser("report",
                       help="write a self-contained HTML report of training runs (curves, coach, episodes)")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="a run's --mappa.run_dir (metrics.jsonl, episodes.jsonl, eval.jsonl); several: "
                        "overlaid")
    p.add_argument("--out",
                   help="the HTML file to write (default: RUN_DIR/report.html; several runs: the first's "
                        "compare.html)")
    p = sub.add_parser("paper-table", help="the paper's table from runs' eval.jsonl: each eval set's first "
                       "(step 0), last and best evaluation side by side; accuracy under the environment's "
                       "grader and the coach's, DSBench by our definitions and the authors'; Markdown and "
                       "JSON")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run's --mappa.run_dir (its eval.jsonl)")
    p.add_argument("--out",
                   help="write OUT.md and OUT.json (default: the first RUN_DIR's paper_table.md, .json)")
    return parser, score_parser


def add_eval_args(parser):
    """`mappa eval`'s own flags beside train_mappa_ray's, and its defaults where the training run's have
    none."""
    g = parser.add_argument_group("mappa eval")
    g.add_argument("--checkpoint",
                   help="a run's HF exports (--ckpt.output_dir): the model of agent A is DIR/A (not with "
                   "--mappa.model)")
    g.add_argument("--agent-model", action="append", default=[], metavar="AGENT=MODEL",
                   help="one agent's model")
    g.add_argument("--limit", type=NONNEGATIVE_INT, default=0,
                   help="only the first N tasks of each file (0: all)")
    g.add_argument("--out", default="eval_results.json",
                   help="results; the episodes go to <out>.episodes.jsonl")
    g.add_argument("--workspace", default=None, help="code workspaces (default: a temporary directory)")
    parser.set_defaults(**{"rollout.max_new_tokens": 1024, "data.max_len": 8192, "vllm.num_engines": 1,
                           "vllm.gpu_memory_utilization": 0.9})


def add_coach_parser(sub):
    """`mappa coach score`; its parser is returned for the errors rescore_main reports."""
    p = sub.add_parser("coach", help="coach tools")
    coach_sub = p.add_subparsers(dest="coach_command", required=True)
    p = coach_sub.add_parser("score",
                             help="re-score saved episodes with another coach or template; print the "
                             "agreement. Takes the training run's coach flags (--mappa.coach.*; kind default "
                             "openai here, cache default none; those about rewards and the bias audit do "
                             "nothing here)")
    p.add_argument("--episodes", required=True, help="episodes.jsonl of a run")
    p.add_argument("--out", required=True,
                   help="one line per action with both verdicts; summary in <out>.summary.json")
    p.add_argument("--mappa.topology",
                   help="take the coach prompt templates and score key from this topology YAML")
    p.add_argument("--template",
                   help="a text file with the coach prompt template (not needed with --mappa.coach.mode "
                        "hindsight)")
    p.add_argument("--review-template", help="a text file with the hindsight prompt template (default: the "
                   "topology's review_template, else the built-in one)")
    p.add_argument("--score-key", help="a text reply states its score on the line `KEY: <n>` "
                   "(default: the topology's score_key, else PROCESS_SCORE)")
    add_coach_args(p)
    p.set_defaults(**{"mappa.coach.kind": "openai"})
    # listed here, parsed by distill_parser
    coach_sub.add_parser("distill", help=DISTILL_HELP, add_help=False)
    return p


DISTILL_HELP = ("fine-tune a coach model on a reference coach's recorded verdicts with OpenRLHF's train_sft; "
                "report its agreement with the reference on held-out episodes. Other flags go to train_sft")


def distill_parser():
    """`mappa coach distill`'s own flags (the launcher's spellings); parse_known_args leaves train_sft's."""
    # the rest go to train_sft
    p = Parser(prog="mappa coach distill", description=DISTILL_HELP, allow_abbrev=False)
    p.add_argument("--episodes", required=True, help="the runs' episodes.jsonl, comma-separated")
    p.add_argument("--mappa.topology", required=True,
                   help="the topology YAML whose coach_template and score_key the reference coach was run "
                        "with")
    p.add_argument("--model.model_name_or_path", required=True, help="the base model to fine-tune")
    p.add_argument("--ckpt.output_dir", required=True,
                   help="where the coach model goes (a new or empty directory); the data in OUT/distill, the "
                   "report in OUT/distill.json")
    p.add_argument("--cache",
                   help="the runs' verdict caches (coach_cache.sqlite), comma-separated: an LLM coach's "
                        "replies where its verdicts were served from the cache")
    p.add_argument("--mappa.coach.reply", choices=("text", "digit"), default="text",
                   help="the target reply: the reference's own reply text (default; JSON for a coach without "
                   "one), or its score as one digit 0-9 (10 -> 9)")
    p.add_argument("--mappa.coach.held_out_fraction", type=FRACTION, default=0.2,
                   help="the share of episodes held out for the report (default 0.2)")
    p.add_argument("--train.seed", type=int, default=0,
                   help="the held-out draw's seed (and train_sft's; default 0)")
    p.add_argument("--rollout.max_new_tokens", type=COUNT, help="the report's reply length (default 1 with "
                   "--mappa.coach.reply digit, else 512)")
    p.add_argument("--nproc_per_node", type=COUNT,
                   help="train_sft's processes (default: the visible GPUs, else 1)")
    return p


def sft_flags(extra: list):
    """The passed-through train_sft flags that size its launch, at train_sft's own defaults."""
    p = Parser(prog="mappa coach distill", add_help=False, allow_abbrev=False)
    p.add_argument("--train.batch_size", type=int, default=128)
    p.add_argument("--train.micro_batch_size", type=int, default=8)
    p.add_argument("--data.max_len", type=int)
    p.add_argument("--ds.ring_attn_size", type=int, default=1)
    p.add_argument("--ds.tensor_parallel_size", type=int, default=1)
    p.add_argument("--ds.attn_implementation", default="flash_attention_2")
    p.add_argument("--ds.load_in_4bit", action="store_true")
    return p.parse_known_args(extra)[0]


def accumulation_refusal(sft, nproc: int) -> str:
    """Why train_sft cannot split --train.batch_size over `nproc` processes ('' where it can): its gradient
    accumulation is batch // micro // data-parallel ranks (DeepspeedStrategy), 0 a ZeroDivisionError and a
    remainder DeepSpeed's batch assertion, both after every rank has loaded the model."""
    batch, micro = getattr(sft, "train.batch_size"), getattr(sft, "train.micro_batch_size")
    group = getattr(sft, "ds.ring_attn_size") * getattr(sft, "ds.tensor_parallel_size")
    if nproc % group:
        return (f"--nproc_per_node {nproc}: not a multiple of --ds.ring_attn_size x "
                f"--ds.tensor_parallel_size ({group}); give a multiple of {group}")
    ranks = nproc // group
    if batch % (micro * ranks) == 0:
        return ""
    counts = [n for n in range(group, nproc + 1, group) if batch % (micro * (n // group)) == 0]
    fix = f"--nproc_per_node {counts[-1]}" if counts else f"a --train.micro_batch_size that divides {batch}"
    return (f"--train.batch_size {batch} is not a multiple of --train.micro_batch_size {micro} x {ranks} "
            f"data-parallel process(es) ({micro * ranks}): train_sft accumulates batch // (micro x "
            f"processes) micro-batches; give {fix}, or a --train.batch_size that is a multiple of "
            f"{micro * ranks}")


def distill_inputs(args, extra: list) -> tuple:
    """Everything a user can get wrong, refused before torch loads: (the topology, the caches opened)."""
    from openrlhf_mappa.coach.cache import VerdictCache
    from openrlhf_mappa.team import check_model, load_topology
    from openrlhf_mappa.tools.distill import OWN_SFT_FLAGS

    repeated = [f for f in OWN_SFT_FLAGS if any(a == f or a.startswith(f + "=") for a in extra)]
    out, paths = getattr(args, "ckpt.output_dir"), [path for path in (args.cache or "").split(",") if path]
    rules = [
        (repeated, f"{', '.join(repeated)}: mappa coach distill sets these to the data it writes "
                   "(OUT/distill/train.jsonl, each prompt rendered with the base model's chat template); "
                   f"leave them out"),
        (os.path.isdir(out) and os.listdir(out),
         f"--ckpt.output_dir {out}: exists and is not an empty directory; remove it or give another path"),
    ]
    for path in paths:
        rules.append((not os.path.isfile(path), f"--cache {path}: no such file (a run's coach_cache.sqlite)"))
    # The launcher's check of the same flag: a file, a path under one, a directory this user cannot write.
    refuse([why for bad, why in rules if bad] + [unwritable_dir(out, "--ckpt.output_dir")], ValueError)
    topology_path = getattr(args, "mappa.topology")
    topology = load_topology(topology_path)
    topology.check_coach_template(topology_path, "openai", "per_action")
    check_model(getattr(args, "model.model_name_or_path"), "--model.model_name_or_path")
    caches = list(map(VerdictCache, paths))
    return topology, caches


def distill_processes(args, extra: list):
    """train_sft's launch checked where torch is needed, before any model loads: its process count (the flag,
    else the GPUs here, else 1) against its batch, and flash attention's kernels where there are GPUs
    (train_sft's default, which fails in every rank's from_pretrained after the data step). The train_sft
    flags read."""
    from types import SimpleNamespace

    from openrlhf_mappa.placement import broken_modules, detect_gpus, module_refusals, needed_modules

    sft, gpus = sft_flags(extra), detect_gpus()[0]
    args.nproc_per_node = args.nproc_per_node or gpus or 1
    problems = [accumulation_refusal(sft, args.nproc_per_node)]
    if gpus:
        kernels = SimpleNamespace(ds=SimpleNamespace(
            attn_implementation=getattr(sft, "ds.attn_implementation"),
            ring_attn_size=getattr(sft, "ds.ring_attn_size"),
            load_in_4bit=getattr(sft, "ds.load_in_4bit")))
        needed = needed_modules(kernels)
        problems += module_refusals(needed, broken_modules(needed), "here")
    refuse(problems, ValueError)
    return sft


def distill_rows(args, topology, caches: list) -> tuple:
    """build_rows with the flags, refusing data that cannot train or be measured: (train, held-out,
    skipped)."""
    from openrlhf_mappa.tools.distill import build_rows

    paths = args.episodes.split(",")
    fraction = getattr(args, "mappa.coach.held_out_fraction")
    train, held, skipped = build_rows(paths, topology.coach_template, topology.score_key,
                                      getattr(args, "mappa.coach.reply"), fraction,
                                      getattr(args, "train.seed"), caches)
    why = ", ".join(f"{n} {reason}" for reason, n in skipped.items()) or "no actions"
    usable = len(train) + len(held)
    rules = [(not usable, f"{args.episodes}: no usable reference verdict ({why})")]
    for side, rows in (("training", train), ("held-out", held)):
        rules.append((usable and not rows, f"{args.episodes}: no {side} verdicts ({usable} verdicts usable, "
                                           f"--mappa.coach.held_out_fraction {fraction}); give more episodes "
                                           f"or another fraction"))
    refuse([why for bad, why in rules if bad], ValueError)
    return train, held, skipped


def distill_sizes(args, sft, train: list, held: list, skipped: dict) -> tuple:
    """The rows rendered as train_sft gets them (distill.render) and its --data.max_len: the flag, else the
    longest training row's need, so that no row is dropped or cut unseen. A row over a given max_len is left
    out here, counted among the skips and named: (the training rows kept, max_len, the rows left out)."""
    from transformers import AutoTokenizer

    from openrlhf_mappa.tools.distill import needed_len, render

    tokenizer = AutoTokenizer.from_pretrained(getattr(args, "model.model_name_or_path"),
                                              trust_remote_code=True)
    render(train + held, tokenizer)
    needs = [needed_len(row, tokenizer) for row in train]
    max_len = getattr(sft, "data.max_len") or max(needs)
    kept = [row for row, need in zip(train, needs) if need <= max_len]
    left_out = [{"episode_id": row["episode_id"], "agent": row["agent"], "tokens": need}
                for row, need in zip(train, needs) if need > max_len]
    if left_out:
        skipped[f"over --data.max_len {max_len}"] = len(left_out)
        named = ", ".join(f"{r['episode_id']}/{r['agent']} ({r['tokens']} tokens)" for r in left_out[:5])
        print(f"{len(left_out)} training verdicts need more than --data.max_len {max_len} tokens and are "
              f"left out (all in distill.json's left_out): {named}{', ...' if len(left_out) > 5 else ''}")
    if not kept:
        raise ValueError(f"{args.episodes}: no training verdict fits --data.max_len {max_len} tokens (the "
                         f"shortest needs {min(needs)}); give a larger --data.max_len")
    return kept, max_len, left_out


def distill_data(args, extra: list) -> tuple:
    """`mappa coach distill` up to train_sft: the flags and data checked, the rows sized and written to
    OUT/distill: (the topology, the training rows, the held-out rows, the skips by reason, the rows left out,
    train_sft's command)."""
    from openrlhf_mappa.tools.distill import sft_command, write_jsonl

    with refusals("mappa coach distill:"):
        topology, caches = distill_inputs(args, extra)
        try:
            train, held, skipped = distill_rows(args, topology, caches)
        finally:
            for cache in caches:
                cache.close()
        sft = distill_processes(args, extra)
        train, max_len, left_out = distill_sizes(args, sft, train, held, skipped)
    out, model = getattr(args, "ckpt.output_dir"), getattr(args, "model.model_name_or_path")
    os.makedirs(os.path.join(out, "distill"), exist_ok=True)
    write_jsonl(os.path.join(out, "distill", "train.jsonl"), train)
    write_jsonl(os.path.join(out, "distill", "heldout.jsonl"), held)
    print(f"{len(train)} training and {len(held)} held-out verdicts in {out}/distill, --data.max_len "
          f"{max_len}; skipped: {skipped or 'none'}")
    command = sft_command(model, out, args.nproc_per_node, getattr(args, "train.seed"), max_len, extra)
    return topology, train, held, skipped, left_out, command


def distill_main(args, extra: list) -> dict:
    """`mappa coach distill` after its flags are parsed: data, train_sft, the held-out report
    (OUT/distill.json)."""
    from openrlhf_mappa.team import check_model
    from openrlhf_mappa.tools.distill import fine_tune, generate, print_report, report

    topology, train, held, skipped, left_out, command = distill_data(args, extra)
    out = getattr(args, "ckpt.output_dir")
    fine_tune(command, os.path.join(out, "distill", "sft.log"))
    with refusals("mappa coach distill:"):  # what vllm serve and the trained coach load
        check_model(out, "train_sft's output")
    max_new_tokens = getattr(args, "rollout.max_new_tokens") or (
        1 if getattr(args, "mappa.coach.reply") == "digit" else 512)
    replies = generate(out, [row["sft_prompt"] for row in held], max_new_tokens)
    metrics = report(held, replies, topology.score_key)
    print_report(metrics, f"distilled coach {out}")
    summary = {"rows": {"train": len(train), "heldout": len(held)}, "skipped": skipped, "left_out": left_out,
               **metrics, "replies": replies, "max_new_tokens": max_new_tokens, "command": command}
    with open(os.path.join(out, "distill.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, ensure_ascii=False)
    print(f"\nthe distilled coach: {out}\nits report: {os.path.join(out, 'distill.json')}")
    return summary


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
        refuse([unwritable_dir(args.workspace, "--workspace")], ValueError)
    result = run_python(code, args.workspace, timeout_s=args.timeout, memory_mb=args.memory_mb)
    print(json.dumps(dataclasses.asdict(result), indent=2))


def out_file(path: str, flag: str) -> str:
    """Why an output file could not be written ('' where it can), named before the work whose results it
    holds."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"{flag} {path}: there is no directory {parent} to write it in"
    return f"{flag} {path}: is a directory" if os.path.isdir(path) else ""


def merge_lora_main(args):
    """`mappa merge-lora`: the adapter, its config and its base model checked before peft and torch load."""
    from openrlhf_mappa.episode import read_record
    from openrlhf_mappa.team import check_model

    with refusals("mappa merge-lora:"):
        config = os.path.join(args.adapter_dir, "adapter_config.json")
        if not os.path.isfile(config):
            raise ValueError(f"{args.adapter_dir} holds no adapter_config.json (not a LoRA agent's export)")
        base = read_record(config, "the adapter's config").get("base_model_name_or_path")
        if not isinstance(base, str) or not base:
            raise ValueError(f"{config}: no base_model_name_or_path (the model the adapter was trained on)")
        check_model(base, f"{config}: its base model")
        refuse([unwritable_dir(args.out_dir)], ValueError)
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    model = AutoPeftModelForCausalLM.from_pretrained(args.adapter_dir, dtype="auto").merge_and_unload()
    model.save_pretrained(args.out_dir)
    AutoTokenizer.from_pretrained(args.adapter_dir).save_pretrained(args.out_dir)
    print(f"{args.adapter_dir} merged into {model.config._name_or_path}: {args.out_dir}")


def plan_main(argv) -> int:
    """`mappa plan`: the launch's plan and check without a cluster, on this machine's GPUs unless given; with
    no GPU memory known, the counts are checked (as the launcher does)."""
    from openrlhf_mappa import placement
    from openrlhf_mappa.cli.train_mappa_ray import accepted, check_models, parse_args, validate
    from openrlhf_mappa.team import load_topology

    args = parse_args(argv, prog="mappa plan", description=PLAN_HELP)
    with refusals("mappa plan:"):
        topology = load_topology(args.mappa.topology, model_override=args.mappa.model)
        validate(args, topology)
        # A hub id resolved as the launcher does: one out of reach is refused at once, not "fits" after
        # minutes of retries. A directory needs only its config.json here (tests/fixtures hold no weights or
        # tokenizer).
        check_models(args, topology, config_only=True)
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
    print(f"mappa plan: {len(topology.agents)} agents on {cluster}{'' if gib else ' (memory not known)'}; "
          f"placement: {placement.PLACEMENTS[args.mappa.colocate]}\n")
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
    print(f"{verdict} by count; GPU memory not checked: there is no GPU on this machine and no "
          "--mappa.gpu_memory_gib")
    print("Give --mappa.gpu_memory_gib G (one GPU's memory in GiB, as `nvidia-smi --query-gpu=memory.total "
          "--format=csv` reports it; an 80 GB card: 79.6) for each GPU's memory per phase and the memory "
          "check")
    return 0


def check_main(argv) -> int:
    """`mappa check`: the launch's checks (Preflight), each whose inputs passed, as a table of what each found
    or why it failed; exit 1 on a failure. No Ray, no model weights: seconds, plus the coach's one reply."""
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
    row = "{:<6}  {:<%d}  {:>7}  {}" % width  # verdict, check, time, what it said
    below = "\n" + " " * len(row.format("", "", "", ""))  # a refusal's further lines under its first
    for verdict, what, said, took in rows:
        print(row.format(verdict, what, took, said.replace("\n", below)))
    print(f"\nmappa check: {len(rows) - len(failed)} of {len(rows)} checks passed"
          + (f"; fix the failed ones before launching" if failed
             else "; nothing found that would stop the launch"))
    return 1 if failed else 0


def doctor_main(argv) -> int:
    """`mappa doctor`: the launch's checks, the coach's one request, then the cluster's (doctor.py), with the
    plan of the recipe's own models; Ray's output into <run_dir>/doctor.log."""
    import contextlib

    from openrlhf_mappa.cli.train_mappa_ray import (accepted, check_team, check_this_machine, output_to,
                                                    parse_args)

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
        print(f"[mappa] doctor: Ray's, vLLM's and DeepSpeed's output goes to {os.path.abspath(log)}",
              flush=True)
    with contextlib.nullcontext() if args.mappa.verbose else output_to(log):
        import ray

        from openrlhf_mappa.tools.doctor import doctor

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
    """(the topology with its own models, why it is not planned): with --mappa.model the doctor's team runs
    the small model, and the recipe's models are planned on the cluster too (doctor.recipe_plan). None without
    --mappa.model: the team's plan is the recipe's."""
    from openrlhf_mappa.cli.train_mappa_ray import check_models
    from openrlhf_mappa.team import load_topology

    if not args.mappa.model:
        return None, None
    recipe = load_topology(args.mappa.topology)
    try:
        check_models(args, recipe)
    except (ValueError, SystemExit) as e:  # the launch itself refuses it before Ray, in seconds
        return None, str(e).removeprefix("[mappa] ")
    return recipe, None


def eval_inputs(args):
    """`mappa eval`'s every input, checked before vLLM and Ray load: (topology, agent -> model, agent -> its
    adapter's config for a LoRA agent's export, dataset -> tasks, the grading coach or None)."""
    from openrlhf_mappa.cli.train_mappa_ray import LORA_ENGINES_TP, coach_kind_problems, token_limit_problems
    from openrlhf_mappa.episode import read_record
    from openrlhf_mappa.evaluation import load_eval_sets
    from openrlhf_mappa.team import check_model, load_topology

    topology = load_topology(args.mappa.topology, model_override=args.mappa.model)
    models = {spec.name: spec.model for spec in topology.agents}
    exports = args.checkpoint and not args.mappa.model  # both: refused below, and no export is looked for
    if exports:
        models = {name: os.path.join(args.checkpoint, name) for name in models}
    rules = [
        (args.mappa.model and args.checkpoint,
         "--mappa.model (one model for every agent) or --checkpoint (a run's exports), not both"),
        (not args.eval.dataset,
         "give the tasks: --eval.dataset DATASET[,DATASET...] (a file, a dataset folder or a Hub name)"),
        (args.mappa.coach.kind == "trained",
         "--mappa.coach.kind trained judges inside its run only; grade with --mappa.coach.kind openai"),
    ]
    problems = [why for bad, why in rules if bad]
    for item in args.agent_model:
        name, _, model = item.partition("=")
        if name in models and model:
            models[name] = model
        else:
            problems.append(f"--agent-model {item!r}: expected AGENT=MODEL with AGENT one of "
                            f"{', '.join(models)}")
    for name, model in models.items():
        if exports and not os.path.isdir(model):
            problems.append(f"--checkpoint: no model for agent {name!r} at {model} (expected one HF export "
                            "per agent)")
    problems += token_limit_problems(args, topology) + coach_kind_problems(args.mappa.coach)
    refuse(problems + [out_file(args.out, "--out"),
                       args.workspace and unwritable_dir(args.workspace, "--workspace")], ValueError)
    # A LoRA agent's export is its adapter in PEFT format: its base model's engines serve it by the agent's
    # name.
    adapters = {}
    for name, model in models.items():
        if os.path.isfile(os.path.join(model, "adapter_config.json")):
            adapters[name] = read_record(os.path.join(model, "adapter_config.json"), "the adapter's config")
            adapters[name]["dir"], models[name] = model, adapters[name].get("base_model_name_or_path") or ""
    for name, model in models.items():
        base = f" (the base of its adapter {adapters[name]['dir']})" if name in adapters else ""
        check_model(model, f"agent {name!r}{base}")
    if adapters and args.vllm.tensor_parallel_size > 1:
        raise ValueError(f"LoRA adapters ({', '.join(adapters)}): {LORA_ENGINES_TP}")
    datasets = load_eval_sets(args, topology.env_cls.needs_answer, args.limit)
    topology.check_env([t for tasks in datasets.values() for t in tasks], args.mappa.topology)
    return topology, models, adapters, datasets, eval_coach(args, topology)


def eval_coach(args, topology):
    """`mappa eval`'s grading coach (--mappa.coach.kind openai), probed before any engine starts; None without
    one."""
    import asyncio

    from openrlhf_mappa.cli.train_mappa_ray import run_coach

    c = args.mappa.coach
    if c.kind != "openai":
        return None
    topology.check_coach_template(args.mappa.topology, "openai", "per_action")
    cache = None if c.cache in (None, "none") else c.cache
    # by a coach of its own: its HTTP session belongs to that loop
    asyncio.run(run_coach(args, topology).probe())
    return run_coach(args, topology, cache)


def eval_main(argv) -> int:
    """Team evaluation on vLLM engines (one group per distinct model, so agents sharing a base model share
    engines), through the training rollout minus the coach; see evaluation.py."""
    from openrlhf_mappa.cli.train_mappa_ray import output_to, parse_args
    from openrlhf_mappa.evaluation import format_table

    args = parse_args(argv, prog="mappa eval", description=EVAL_HELP, add_tool_args=add_eval_args)
    with refusals("mappa eval:"):
        topology, models, adapters, datasets, coach = eval_inputs(args)

    import contextlib

    # As the launcher's train.log: Ray's and vLLM's output (~100 lines) in a file, the results on the
    # terminal.
    log = args.out + ".log"
    if not args.mappa.verbose:
        # read as Ray is imported: nothing held back for the exit
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        print(f"[mappa] eval: Ray's and vLLM's output goes to {os.path.abspath(log)} (--mappa.verbose: here)",
              flush=True)
    with contextlib.nullcontext() if args.mappa.verbose else output_to(log):
        summaries = evaluate_datasets(args, topology, models, adapters, datasets, coach)
    print(format_table(summaries))
    print(f"\nresults: {args.out}\nepisodes: {args.out}.episodes.jsonl")
    return 0


def evaluate_datasets(args, topology, models: dict, adapters: dict, datasets: dict, coach) -> dict:
    """`mappa eval`'s work on the cluster: every dataset played, its episodes and results written; its
    summaries."""
    import asyncio
    import tempfile

    import ray

    from openrlhf_mappa.evaluation import asks_answer, coach_cost, evaluate, summarize

    started = not ray.is_initialized()
    if started:
        ray.init(runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    policies = eval_policies(args, topology, models, adapters)
    workspace = args.workspace or tempfile.mkdtemp(prefix="mappa-eval-")
    samples = args.eval.n_samples_per_prompt

    async def every_dataset():  # one event loop: the coach's HTTP session belongs to the loop it first ran on
        played = {dataset: await evaluate(topology, tasks, policies, samples,
                                          os.path.join(workspace, dataset), coach=coach)
                  for dataset, tasks in datasets.items()}
        if coach:
            await coach.aclose()
        return played

    results, summaries, c = {}, {}, args.mappa.coach
    with open(args.out + ".episodes.jsonl", "w", encoding="utf-8") as f:
        for dataset, episodes in asyncio.run(every_dataset()).items():
            f.writelines(ep.to_json() + "\n" for ep in episodes)
            summary, problems = summarize(episodes, list(models), datasets[dataset], asks_answer(coach))
            summary.update(coach_cost(episodes, c.price_in, c.price_out))
            results[dataset], summaries[dataset] = {"summary": summary, "problems": problems}, summary
    settings = {"n_samples": samples, "temperature": args.eval.temperature, "top_p": args.rollout.top_p,
                "max_new_tokens": args.rollout.max_new_tokens, "max_len": args.data.max_len,
                "seed": args.train.seed,
                "coach_model": c.model if coach else None, "coach_structured": c.structured}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"models": models, "adapters": {n: a["dir"] for n, a in adapters.items()},
                   "settings": settings, "datasets": results}, f, indent=1)
    if started:
        ray.shutdown()  # Ray prints its workers' last lines as it shuts down: into the log too
    return summaries


def eval_policies(args, topology, models: dict, adapters: dict) -> dict:
    """Each agent's AgentPolicy on engines of its model, created as a run creates them (launch.new_engines,
    AgentPolicy.of): a full model's on GPUs of their own, the LoRA agents of one base on one pool (a GPU each)
    serving each agent's adapter (its export's files) under its name."""
    import glob

    import ray
    from ray.util.placement_group import placement_group
    from transformers import AutoTokenizer

    from openrlhf_mappa.launch import new_engines
    from openrlhf_mappa.rollout import AgentPolicy

    v, engines, tokenizers = args.vllm, {}, {}
    # a base's adapters get engines of their own, with LoRA
    group = lambda name: (models[name], name in adapters)
    for model, lora in dict.fromkeys(map(group, models)):
        if lora:
            served = {n: a for n, a in adapters.items() if group(n) == (model, True)}
            pg = placement_group([{"GPU": 1, "CPU": 1}] * v.num_engines, strategy="PACK")
            engines[model, lora] = new_engines(args, model, pg, 1, [a["r"] for a in served.values()])
            for name, adapter in served.items():
                paths = glob.glob(os.path.join(adapter["dir"], "adapter_*"))
                files = {os.path.basename(f): open(f, "rb").read() for f in paths}
                ray.get([e.load_adapter.remote(name, files) for e in engines[model, lora]])
        else:
            engines[model, lora] = new_engines(args, model, None, 1)
        tokenizers[model] = AutoTokenizer.from_pretrained(model, trust_remote_code=True)
    return {spec.name: AgentPolicy.of(args, spec, engines[group(spec.name)], tokenizers[models[spec.name]],
                                      args.eval.temperature,
                                      adapter=spec.name if spec.name in adapters else None, logprobs=False)
            for spec in topology.agents}  # nothing reads an evaluation's log-probs


def rescore_main(parser, args):
    from types import SimpleNamespace

    from openrlhf_mappa.cli.train_mappa_ray import coach_flags, coach_kind_problems
    from openrlhf_mappa.coach import DEFAULT_SCORE_KEY, build_coach
    from openrlhf_mappa.coach.audit import FAILED_STATUSES
    from openrlhf_mappa.tools import rescore
    from openrlhf_mappa.topology import PROMPT_FIELDS, REVIEW_FIELDS, check_template

    # The --mappa.coach.* flags as train_mappa_ray's args.mappa.coach (the trained coach's at their defaults).
    given = {k.removeprefix("mappa.coach."): v for k, v in vars(args).items() if k.startswith("mappa.coach.")}
    c = SimpleNamespace(**{**coach_flags()[0], **given})
    topology_path = getattr(args, "mappa.topology")
    if c.kind == "trained":
        parser.error("--mappa.coach.kind trained: a trained coach judges inside its run only; re-score with "
                     "openai or heuristic")
    if not (args.template or topology_path) and c.kind == "openai" and c.mode != "hindsight":
        parser.error(f"coach score --mappa.coach.mode {c.mode}: give the coach prompt with --template FILE "
                     f"or --mappa.topology YAML")
    with refusals("mappa coach score:"):
        refuse(coach_kind_problems(c) + [out_file(args.out, "--out")], ValueError)
        topology = None
        if topology_path:
            from openrlhf_mappa.team import load_topology

            topology = load_topology(topology_path)
            if not args.template:
                topology.check_coach_template(topology_path, c.kind, c.mode)
        template = topology.coach_template if topology else None
        review_template = topology.review_template if topology else None
        if args.template:
            template = Path(args.template).read_text(encoding="utf-8")
            check_template(template, PROMPT_FIELDS, args.template)
        if args.review_template:
            review_template = Path(args.review_template).read_text(encoding="utf-8")
            check_template(review_template, REVIEW_FIELDS, args.review_template)
        score_key = args.score_key or (topology.score_key if topology else DEFAULT_SCORE_KEY)
        coach = build_coach(c, template=template, score_key=score_key, review_template=review_template,
                            cache_path=None if c.cache in (None, "none") else c.cache)
        actions = rescore.read_actions(args.episodes)
        if not actions:
            raise ValueError(f"{args.episodes}: no actions to re-score")
        rows, summary = rescore.run(actions, args.out, coach, c.mode)
    before = next((a["verdict"]["coach"] for _, a in actions if a.get("verdict")), "?")
    rescore.print_summary(summary, before, coach.name)
    print(f"\nboth verdicts per action: {args.out}\nsummary: {args.out}.summary.json")
    # As in training (--mappa.coach.max_failure_fraction): a re-score made mostly of failed verdicts says
    # nothing about the coach's agreement, and a script or CI job must see it as a failure, not read the
    # table.
    failed = [r["after"] for r in rows if r["after"]["status"] in FAILED_STATUSES]
    if len(failed) / len(rows) > c.max_failure_fraction:
        first = failed[0]
        sys.exit(f"mappa coach score: {len(failed)} of {len(rows)} verdicts failed (more than "
                 f"--mappa.coach.max_failure_fraction {c.max_failure_fraction}). First failure: "
                 f"{first['status']}: {first['rationale'][:500]}")


def dsbench(args) -> int:
    """Exit status: 0 done (a valid submission), 1 an invalid submission or nothing imported, 2 bad input."""
    from openrlhf_mappa.tools import dsbench_tasks  # pandas and scikit-learn load only where needed

    cleaned = None  # the authors' cleaned task texts, for import
    try:
        if args.dsbench_command == "score":
            from openrlhf_mappa.envs.dsbench import score_submission

            if os.path.isdir(args.submission):  # else scored as a submission never written ("missing_file")
                inside = os.path.join(args.submission, "submission.csv")
                hint = f" ({inside} is there)" if os.path.isfile(inside) else ""
                raise ValueError(f"--submission {args.submission}: a directory; give the submission's CSV "
                                 f"file{hint}")
            result = score_submission(args.task_dir, args.submission)
            print(json.dumps(result))
            return 0 if result["valid"] else 1
        if args.dsbench_command == "make-pack":
            tasks, skipped = dsbench_tasks.make_pack(args.out_dir, args.seed)
            out = args.out_dir
        else:
            if args.task_text == "raw" and args.cleaned_prompts:
                raise ValueError("--cleaned-prompts goes with --task-text cleaned (the default), not raw")
            if args.task_text == "cleaned":
                path = args.cleaned_prompts or os.path.join(os.path.dirname(args.metadata),
                                                            dsbench_tasks.CLEANED_PROMPTS)
                how = "--cleaned-prompts" if args.cleaned_prompts else "looked for beside --metadata"
                cleaned = dsbench_tasks.load_cleaned_prompts(path, how)
            tasks, skipped = dsbench_tasks.import_tasks(args.data_root, args.metadata, args.out, cleaned)
            out = args.out
    except (OSError, ValueError) as e:
        print(f"mappa dsbench {args.dsbench_command}: {e}", file=sys.stderr)
        return 2
    for reason in skipped:
        print(f"skipped {reason}", file=sys.stderr)
    # A task the cleaned file lacks keeps DSBench's text, as in the authors' workflow
    # (liverpool-ion-switching).
    raw = [t["id"] for t in tasks if "agent_prompt" not in t]
    if cleaned is not None and raw:
        print(f"not in the cleaned prompts, the agents see DSBench's text: {', '.join(raw)}", file=sys.stderr)
    if not tasks:
        print(f"no task imported ({len(skipped)} skipped)", file=sys.stderr)
        return 1
    print(f"{len(tasks)} task(s) in {out}/tasks.jsonl ({len(skipped)} skipped)")
    return 0


if __name__ == "__main__":
    main()
