"""`mappa paper-table RUN_DIR [RUN_DIR ...]`: the paper's results table from runs' eval.jsonl, as Markdown and
JSON.

Per run (named by its directory, or the directory above a scripts' `run`) and eval set: the first evaluation
(step 0: the untrained team), the last one and the best one after it (each row's best value: lowest for an
error such as RMSE), and their differences. The authors' code logs every evaluation and picks none, so both
are shown.

An accuracy set gives the environment's grade (`accuracy`, headed by the record's `grader`: math-verify for
math) and the coach's (`accuracy_coach`, the authors'): its ANSWER_CORRECT in % with the difference in
percentage points, or the final agent's raw 0-10 coach score where the coach was asked no ANSWER_CORRECT. A
DSBench set (its records have `relative_score`) gives both definitions, each named: ours (a valid
submission.csv; DSBench's relative score; each competition's metric over valid submissions) and the authors'
(an episode scored when its predictions can be read; accuracy, F1, ROC-AUC, RMSE, MAE, MSE pooled over tasks).
An eval set that shares problems with the training tasks is marked (`train_overlap`).
"""

import json
import os

from openrlhf_mappa.tools.report import records

# The rows' figures where lower is better (an error), for "best": DSBench's error metrics (envs/dsbench.py
# METRICS) and the authors' pooled MSE.
LOWER_IS_BETTER = ("rmse", "rmsle", "mae", "medae", "mse", "smape", "log_loss")


def accuracy_rows(records: list) -> list:
    """(key, label, in %) of an accuracy set's rows: the environment's grade, then the coach's: ANSWER_CORRECT
    in %, or the raw 0-10 score where no ANSWER_CORRECT was asked (accuracy_coach/score counts those
    episodes)."""
    grader = records[-1].get("grader") or "accuracy"  # records before `grader` was written name none
    if any(r.get("accuracy_coach/score") for r in records):
        return [("accuracy", grader, True),
                ("accuracy_coach", "coach score of the final agent (0-10)", False)]
    return [("accuracy", grader, True), ("accuracy_coach", "coach ANSWER_CORRECT", True)]


def dsbench_rows(records: list) -> list:
    """(key, label, in %) of a DSBench set's rows: ours (success rate, relative score, per-metric means, the
    success rate per task type), the authors' (scored rate and pooled figures), and the authors' in-loop coach
    score."""
    keys = list(dict.fromkeys(k for r in records for k in r))
    rows = [("accuracy", "ours: success rate (valid submission.csv)", True),
            ("relative_score", "ours: relative score", False)]
    rows += [(k, f"ours: {k.split('/', 1)[1]} (competition metric, valid submissions)", False)
             for k in sorted(keys) if k.startswith("metric/")]
    rows += [(k, f"ours: {k.split('/')[0]} success rate", True)
             for k in sorted(keys) if k.endswith("/success_rate")]
    rows += [("authors/scored_rate", "authors': scored rate (predictions read)", True)]
    pooled = [k for k in keys
              if k.startswith("authors/") and not k.startswith(("authors/count_", "authors/scored"))]
    rows += [(k, f"authors': {k.split('/', 1)[1]} (pooled over tasks)", False) for k in pooled]
    return rows + [("accuracy_coach", "authors': coach score of the last action (in-loop eval, 0-10)", False)]


def run_name(run_dir: str) -> str:
    """A run's name: its directory's, or the one above it where that is `run` (the scripts'
    runs/<name>/run)."""
    path = os.path.normpath(os.path.abspath(run_dir))
    name = os.path.basename(path)
    return os.path.basename(os.path.dirname(path)) if name == "run" else name


def table(run_dirs: list) -> dict:
    """{"accuracy": rows, "dsbench": rows}; a row: run, name, dataset, metric, key, before, after (the last)
    and best with their steps, delta and best_delta, unit, samples, and a note (fallbacks, training
    overlap)."""
    out = {"accuracy": [], "dsbench": []}
    for run_dir in run_dirs:
        evals = records(os.path.join(run_dir, "eval.jsonl"))
        if not evals:
            raise ValueError(f"{run_dir}: no eval.jsonl records (pass --eval.dataset to the run)")
        for dataset in dict.fromkeys(r["dataset"] for r in evals):
            steps = sorted((r for r in evals if r["dataset"] == dataset), key=lambda r: r["step"])
            before = steps[0] if steps[0]["step"] == 0 else {}  # none: the run has no untrained evaluation
            later = [r for r in steps if r["step"] > 0]
            kind = "dsbench" if any("relative_score" in r for r in steps) else "accuracy"
            rows = dsbench_rows(steps) if kind == "dsbench" else accuracy_rows(steps)
            for key, label, percent in rows:
                if key in before or any(key in r for r in later):
                    out[kind].append(row(run_dir, dataset, key, label, before, later, percent))
    return out


def best_of(key: str, later: list) -> dict:
    """The evaluation after step 0 with the best value of `key` (the earliest of equals), {} where none has
    one."""
    valued = [r for r in later if r.get(key) is not None]
    if not valued:
        return {}
    lower = key.rsplit("/", 1)[-1] in LOWER_IS_BETTER
    return (min if lower else max)(valued, key=lambda r: r[key])


def row(run_dir: str, dataset: str, key: str, label: str, before: dict, later: list, percent: bool) -> dict:
    scale = 100.0 if percent else 1.0
    last, best = (later[-1] if later else {}), best_of(key, later)
    b, a, top = (None if r.get(key) is None else r[key] * scale for r in (before, last, best))
    notes = []
    shown = [(before, "before"), (last, "last")]
    if best is not last:
        shown.append((best, "best"))
    for r, when in shown:
        fell_back, ungraded = r.get(f"{key}/score_fallback"), r.get(f"{key}/ungraded")
        if fell_back:
            notes.append(f"{when}: {fell_back} episodes graded by the raw 0-10 score (no ANSWER_CORRECT, "
                         "asked twice)")
        if ungraded:
            notes.append(f"{when}: {ungraded} episodes ungraded (coach failed), left out")
    overlap = last.get("train_overlap") or before.get("train_overlap")
    if overlap:
        notes.append(f"{overlap} problems are training problems: not held out")
    shape = last or before
    return {"run": run_dir, "name": run_name(run_dir), "dataset": dataset, "metric": label, "key": key,
            "before": b, "after": a, "best": top, "before_step": before.get("step"),
            "after_step": last.get("step"),
            "best_step": best.get("step"), "delta": None if a is None or b is None else a - b,
            "best_delta": None if top is None or b is None else top - b, "unit": "%" if percent else "",
            "samples": f"{shape.get('n_problems')} x {shape.get('n_samples')}", "note": "; ".join(notes)}


def markdown(result: dict) -> str:
    parts = []
    for kind, title in (("accuracy", "Accuracy"), ("dsbench", "DSBench")):
        if not result[kind]:
            continue
        parts += [f"## {title}", "", "| run | eval set | metric | before (step 0) | after: last | Δ last | "
                  "after: best | Δ best | problems x samples | note |",
                  "|---|---|---|---:|---:|---:|---:|---:|---|---|"]
        for r in result[kind]:
            cells = [f"{_num(r['before'])}"]
            for value, step, change in ((r["after"], r["after_step"], r["delta"]),
                                        (r["best"], r["best_step"], r["best_delta"])):
                cells.append("-" if value is None else f"{_num(value)} (step {step})")
                cells.append("-" if change is None
                             else f"{change:+.1f} pp" if r["unit"] else f"{change:+.4f}")
            parts.append(f"| {r['name']} | {r['dataset']} | {r['metric']} | {' | '.join(cells)} | "
                         f"{r['samples']} | {r['note']} |")
        parts.append("")
    return "\n".join(parts)


def _num(v) -> str:
    return "-" if v is None else f"{v:.1f}" if abs(v) >= 1 or v == 0 else f"{v:.4f}"


def write(run_dirs: list, out: str = None) -> tuple:
    """Write OUT.md and OUT.json (default: the first run's paper_table.*); returns (the Markdown, the two
    paths)."""
    result = table(run_dirs)
    out = out or os.path.join(run_dirs[0], "paper_table")
    text = markdown(result)
    with open(out + ".md", "w", encoding="utf-8") as f:
        f.write(text)
    with open(out + ".json", "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    return text, (out + ".md", out + ".json")
