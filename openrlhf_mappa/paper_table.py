"""`mappa paper-table RUN_DIR [RUN_DIR ...]`: the paper's results table from runs' eval.jsonl, as Markdown and JSON.

Per run and eval set, the first evaluation (step 0: the untrained team) beside the last (the trained team) and
their difference. A MathChat set gives its accuracy under both graders: math-verify (`accuracy`, the
environment's) and the coach's ANSWER_CORRECT (`accuracy_coach`, the authors'), in % with the difference in
percentage points. A DSBench set (its records have `relative_score`) gives the success rate and every quality
metric. An eval set that shares problems with the training tasks is marked (`train_overlap`).
"""

import json
import os

from openrlhf_mappa.report import records

MATH_ROWS = (("accuracy", "math-verify"), ("accuracy_coach", "coach ANSWER_CORRECT"))


def dsbench_rows(record: dict) -> list:
    """(key, label) of a DSBench record's table rows: success rate, then relative score, per-metric means, the
    success rate per task type, and the authors' in-loop coach score where a coach graded."""
    rows = [("accuracy", "success rate"), ("relative_score", "relative score")]
    rows += [(k, k.split("/", 1)[1] + " (valid submissions)") for k in sorted(record) if k.startswith("metric/")]
    rows += [(k, k.replace("/success_rate", " success rate")) for k in sorted(record) if k.endswith("/success_rate")]
    return rows + [("accuracy_coach", "coach score of the last action (authors' in-loop eval)")]


def table(run_dirs: list) -> dict:
    """{"mathchat": rows, "dsbench": rows}; a row: run, dataset, metric, key, before, after (their steps), delta,
    unit, samples, and a note (graders' fallbacks, training overlap)."""
    out = {"mathchat": [], "dsbench": []}
    for run_dir in run_dirs:
        evals = records(os.path.join(run_dir, "eval.jsonl"))
        if not evals:
            raise ValueError(f"{run_dir}: no eval.jsonl records (pass --eval.dataset to the run)")
        for dataset in dict.fromkeys(r["dataset"] for r in evals):
            steps = sorted((r for r in evals if r["dataset"] == dataset), key=lambda r: r["step"])
            before = steps[0] if steps[0]["step"] == 0 else {}  # none: the run has no untrained evaluation
            after = steps[-1] if steps[-1]["step"] > 0 else {}
            kind = "dsbench" if any("relative_score" in r for r in steps) else "mathchat"
            keys = dsbench_rows(steps[-1]) if kind == "dsbench" else MATH_ROWS
            for key, label in keys:
                # Rates in %; DSBench's coach score stays on its 0-10 scale, its metrics on theirs.
                percent = kind == "mathchat" or key == "accuracy" or key.endswith("/success_rate")
                if key in before or key in after:
                    out[kind].append(row(run_dir, dataset, key, label, before, after, percent))
    return out


def row(run_dir: str, dataset: str, key: str, label: str, before: dict, after: dict, percent: bool) -> dict:
    scale = 100.0 if percent else 1.0
    b, a = (None if r.get(key) is None else r[key] * scale for r in (before, after))
    notes = []
    for r, when in ((before, "before"), (after, "after")):
        fell_back, ungraded = r.get(f"{key}/score_fallback"), r.get(f"{key}/ungraded")
        if fell_back:
            notes.append(f"{when}: {fell_back} episodes graded by the raw 0-10 score (no ANSWER_CORRECT)")
        if ungraded:
            notes.append(f"{when}: {ungraded} episodes ungraded (coach failed), left out")
    overlap = after.get("train_overlap") or before.get("train_overlap")
    if overlap:
        notes.append(f"{overlap} problems are training problems: not held out")
    last = after or before
    return {"run": run_dir, "dataset": dataset, "metric": label, "key": key, "before": b, "after": a,
            "before_step": before.get("step"), "after_step": after.get("step"),
            "delta": None if a is None or b is None else a - b, "unit": "%" if scale == 100.0 else "",
            "samples": f"{last.get('n_problems')} x {last.get('n_samples')}", "note": "; ".join(notes)}


def markdown(result: dict) -> str:
    parts = []
    for kind, title, delta in (("mathchat", "MathChat accuracy", "Δ pp"), ("dsbench", "DSBench", "Δ")):
        if not result[kind]:
            continue
        parts += [f"## {title}", "", f"| run | eval set | metric | before (step 0) | after | {delta} | problems x "
                  "samples | note |", "|---|---|---|---:|---:|---:|---|---|"]
        for r in result[kind]:
            after = "-" if r["after"] is None else f"{_num(r['after'])} (step {r['after_step']})"
            delta_cell = "-" if r["delta"] is None else f"{r['delta']:+.1f}" if r["unit"] else f"{r['delta']:+.4f}"
            parts.append(f"| {os.path.basename(os.path.normpath(r['run']))} | {r['dataset']} | {r['metric']} | "
                         f"{_num(r['before'])} | {after} | {delta_cell} | {r['samples']} | {r['note']} |")
        parts.append("")
    return "\n".join(parts)


def _num(v) -> str:
    return "-" if v is None else f"{v:.1f}" if abs(v) >= 1 or v == 0 else f"{v:.4f}"


def write(run_dirs: list, out: str = None) -> tuple:
    """Write OUT.md and OUT.json (default: the first run's paper_table.*); returns (the Markdown, the two paths)."""
    result = table(run_dirs)
    out = out or os.path.join(run_dirs[0], "paper_table")
    text = markdown(result)
    with open(out + ".md", "w", encoding="utf-8") as f:
        f.write(text)
    with open(out + ".json", "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    return text, (out + ".md", out + ".json")
