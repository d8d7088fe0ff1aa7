"""DSBench: a Data Engineer, a Modeler and an Analyst solve a Kaggle-style modeling task in one workspace
(docs/reference.md, "DSBench pipeline"). Each agent owes the files of its `contract`, the next one's inputs;
its turns end on a reply without code (the authors' rule), or with `end_turn_on_files` once its files exist.

A task row names its task directory as "answer" (satisfying `load_tasks` without an answer in a prompt): task.json,
the public CSVs copied into every workspace, and the hidden answers/test_answer.csv, read only by the scorer. The
coach gets the contract state and the submission's score, never the answers. A broken task directory or a bad
submission is a status in the outcome, never an exception.
"""

import json
import os
import shutil
from typing import Optional

import numpy as np
import pandas as pd
from sklearn.metrics import f1_score, roc_auc_score

from openrlhf_mappa.envs.base import MultiAgentEnv

PUBLIC_FILES = ("train.csv", "test.csv", "sample_submission.csv")
ANSWER_FILE = os.path.join("answers", "test_answer.csv")
SUBMISSION = "submission.csv"
DEFAULT_CONTRACT = {"data_engineer": ["X_train.pkl", "y_train.pkl", "X_test.pkl"], "modeler": ["model.pkl"],
                    "analyst": [SUBMISSION]}


# ---------------------------------------------------------------- metrics
# y: true values, p: predictions, both 1-D arrays. A task with several target columns scores the mean of
# the per-column metric (Kaggle's "mean column-wise" convention).
def rmse(y, p):
    return float(np.sqrt(np.mean((y - p) ** 2)))


def mae(y, p):
    return float(np.mean(np.abs(y - p)))


# name -> (function, higher is better, predictions must be numbers, perfect value)
METRICS = {
    "accuracy": (lambda y, p: float(np.mean(y == p)), True, False, 1.0),
    "f1": (lambda y, p, pos_label=1: float(f1_score(y, p, average="binary", pos_label=pos_label)), True, False, 1.0),
    "f1_macro": (lambda y, p: float(f1_score(y, p, average="macro")), True, False, 1.0),
    "roc_auc": (lambda y, p: float(roc_auc_score(y, p)), True, True, 1.0),
    "rmse": (rmse, False, True, 0.0),
    "rmsle": (lambda y, p: float(np.sqrt(np.mean((np.log1p(p) - np.log1p(y)) ** 2))), False, True, 0.0),
    "mae": (mae, False, True, 0.0),
    "r2": (lambda y, p: float(1.0 - np.sum((y - p) ** 2) / np.sum((y - np.mean(y)) ** 2)), True, True, 1.0),
}


def relative_score(pred: float, baseline: float, best: float) -> Optional[float]:
    """DSBench's max(0, (pred - baseline) / (best - baseline)), right for lower-is-better metrics too (both
    differences flip sign); None when best == baseline (no room to improve)."""
    if best == baseline:
        return None
    return max(0.0, (pred - baseline) / (best - baseline))


def metric_value(name: str, truth: pd.DataFrame, pred: pd.DataFrame, pos_label=None) -> float:
    """The task metric, the mean over target columns. Labels compare as numbers when both sides are numeric (a
    predicted 1.0 equals a true 1), else as strings."""
    fn, _, numeric, _ = METRICS[name]
    kwargs = {"pos_label": pos_label} if name == "f1" and pos_label is not None else {}
    values = []
    for col in truth.columns:
        y, p = truth[col], pred[col]
        yn, pn = pd.to_numeric(y, errors="coerce"), pd.to_numeric(p, errors="coerce")
        if numeric or (yn.notna().all() and pn.notna().all()):
            y, p = yn, pn
        else:
            y, p = y.astype(str), p.astype(str)
        values.append(fn(y.to_numpy(), p.to_numpy(), **kwargs))
    return float(np.mean(values))


# ---------------------------------------------------------------- task directory and scoring
def load_task_dir(task_dir: str) -> dict:
    """task.json of a task directory, checked; ValueError naming the problem otherwise."""
    path = os.path.join(task_dir, "task.json")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{task_dir}: not a DSBench task directory (task.json: {e})") from None
    missing = [k for k in ("task_id", "data_type", "metric", "id_column", "target_columns", "baseline", "best")
               if k not in meta]
    if missing:
        raise ValueError(f"{path}: missing key(s) {missing}")
    if meta["metric"] not in METRICS:
        raise ValueError(f"{path}: unknown metric {meta['metric']!r}; known: {', '.join(METRICS)}")
    absent = [name for name in PUBLIC_FILES + (ANSWER_FILE,) if not os.path.isfile(os.path.join(task_dir, name))]
    if absent:
        raise ValueError(f"{task_dir}: missing file(s) {absent}")
    return meta


def score_submission(task_dir: str, submission: str) -> dict:
    """Validate a submission against the hidden answers and score it: {"valid", "status", "metric_name",
    "metric", "baseline", "best", "relative_score", "task_type"}, "figures" when valid, "error" when not.
    A broken task directory raises ValueError (the env makes it a status, the CLI an error message)."""
    meta = load_task_dir(task_dir)
    ids, targets = meta["id_column"], list(meta["target_columns"])
    out = {"valid": False, "status": "ok", "metric_name": meta["metric"], "metric": None,
           "baseline": meta["baseline"], "best": meta["best"], "relative_score": None,
           "task_type": meta["data_type"]}

    def invalid(status, error):
        return dict(out, status=status, error=error)

    try:
        truth = pd.read_csv(os.path.join(task_dir, ANSWER_FILE), dtype={ids: str})
    except (OSError, ValueError) as e:
        raise ValueError(f"{task_dir}: unreadable {ANSWER_FILE}: {e}") from None
    if not os.path.isfile(submission):
        return invalid("missing_file", f"no {os.path.basename(submission)} was written")
    try:
        sub = pd.read_csv(submission, dtype={ids: str})
    except (OSError, ValueError) as e:  # pandas' parser, empty-file and decoding errors are ValueErrors
        return invalid("unreadable", f"cannot read the submission as CSV: {e}")
    sub.columns = [str(c).strip() for c in sub.columns]
    if sorted(sub.columns) != sorted([ids] + targets):
        return invalid("wrong_columns", f"expected columns {[ids] + targets}, got {list(sub.columns)}")
    if len(sub) != len(truth):
        return invalid("wrong_row_count", f"expected {len(truth)} rows (one per test row), got {len(sub)}")
    if sub[ids].duplicated().any() or set(sub[ids]) != set(truth[ids]):
        unknown = sorted(map(str, set(sub[ids]) - set(truth[ids])))[:5]  # str: an empty id reads as NaN
        return invalid("wrong_ids", f"the {ids} values must be the test set's, each once; e.g. unknown: {unknown}")
    sub = sub.set_index(ids).loc[truth[ids], targets]
    truth = truth.set_index(ids)[targets]
    numeric = METRICS[meta["metric"]][2]
    values = sub.apply(pd.to_numeric, errors="coerce") if numeric else sub
    missing = int(sub.isna().sum().sum())
    if missing:
        return invalid("missing_values", f"{missing} empty/NaN prediction(s)")
    if numeric and not np.isfinite(values.to_numpy(dtype=float)).all():
        return invalid("non_numeric", f"{meta['metric']} needs finite numbers; some predictions are not")
    if meta["metric"] == "rmsle" and (values.to_numpy() < 0).any():
        return invalid("negative_values", "RMSLE needs predictions >= 0")
    try:
        metric = metric_value(meta["metric"], truth, values, meta.get("pos_label"))
    except ValueError as e:  # e.g. f1 with labels that do not fit the task's pos_label
        return invalid("metric_error", f"{meta['metric']} could not be computed: {e}")
    return dict(out, valid=True, metric=metric, figures=coach_figures(meta, truth, values),
                relative_score=relative_score(metric, meta["baseline"], meta["best"]))


def coach_figures(meta: dict, truth: pd.DataFrame, pred: pd.DataFrame) -> dict:
    """The figures besides the metric that the authors' coach grades by (their ground_truth_utils.py): accuracy
    for labels; for regression RMSE, MAE and RMSE as a percentage of the target's range and interquartile range.
    Aggregates only: no answer reaches the coach."""
    if meta["data_type"] != "regression":
        return {} if METRICS[meta["metric"]][2] else {"accuracy": metric_value("accuracy", truth, pred)}
    y, p = truth.to_numpy(dtype=float).ravel(), pred.to_numpy(dtype=float).ravel()
    figures = {"rmse": rmse(y, p), "mae": mae(y, p)}
    spread = {"range": np.ptp(y), "iqr": np.subtract(*np.percentile(y, [75, 25]))}
    figures.update({f"rmse_pct_of_{k}": 100 * figures["rmse"] / v for k, v in spread.items() if v > 0})
    return figures


# ---------------------------------------------------------------- the environment
class DSBenchEnv(MultiAgentEnv):
    task_type = ""  # set per task: "regression" or "classification"

    def __init__(self, topology, task: dict, workspace: str, code_timeout_s: float = 120.0, contract: dict = None,
                 end_turn_on_files: bool = False):
        super().__init__(topology, task, workspace, code_timeout_s)
        self.contract = DEFAULT_CONTRACT if contract is None else contract
        self.end_turn_on_files = end_turn_on_files
        names = [a.name for a in topology.agents]
        unknown = sorted(set(self.contract) - set(names))
        if unknown:
            raise ValueError(f"DSBench contract names agent(s) {unknown} that the topology lacks ({names})")
        self.task_dir = task["answer"]
        self.task_type = task.get("type") or ""
        # A broken task must not end the run: the episode still plays out and its outcome says why.
        self.task_error = None
        try:
            self.task_type = load_task_dir(self.task_dir)["data_type"]
            os.makedirs(workspace, exist_ok=True)
            for name in PUBLIC_FILES:
                shutil.copyfile(os.path.join(self.task_dir, name), os.path.join(workspace, name))
        except (OSError, ValueError) as e:
            self.task_error = str(e)

    def step(self, agent, turn: int, response: str):
        result = super().step(agent, turn, response)
        own = self.contract.get(agent.name)
        if self.end_turn_on_files and result.feedback.ran and own and not self.missing(own):
            result.done = True  # its files exist: the next agent starts
        return result

    def missing(self, files) -> list:
        return [f for f in files if not os.path.isfile(os.path.join(self.workspace, f))]

    def submission_check(self) -> dict:
        if self.task_error:
            return {"valid": False, "status": "broken_task", "error": self.task_error, "task_type": self.task_type}
        return score_submission(self.task_dir, os.path.join(self.workspace, SUBMISSION))

    def answer_formatted(self, agent, response: str) -> Optional[bool]:
        """For the agent that owes submission.csv: is the file there and valid after this action?"""
        return self.submission_check()["valid"] if SUBMISSION in self.contract.get(agent.name, []) else None

    def outcome(self) -> dict:
        check = self.submission_check()
        missing = {a: m for a, files in self.contract.items() if (m := self.missing(files))}
        return {"success": check.pop("valid"), **check, "missing_files": missing}

    def coach_ground_truth(self, agent) -> Optional[str]:
        """The contract state right after the action (the rollout asks just after `step`), so the coach can blame
        the agent whose file is missing; for the Analyst also the submission's check. The heuristic parses it."""
        names = [a.name for a in self.topology.agents]
        upstream = [f for a in names[: names.index(agent.name)] for f in self.contract.get(a, [])]
        own = self.contract.get(agent.name, [])
        files = sorted(os.listdir(self.workspace)) if os.path.isdir(self.workspace) else []
        lines = [
            f"DSBench file contract: this agent must save: {', '.join(own) or '(nothing)'}",
            f"Missing inputs (files earlier agents had to save): {', '.join(self.missing(upstream)) or 'none'}",
            f"Missing outputs (this agent's own files): {', '.join(self.missing(own)) or 'none'}",
            f"Workspace files: {', '.join(files) or '(none)'}",
        ]
        if SUBMISSION in own:
            c = self.submission_check()
            if c["valid"]:
                rel = "n/a" if c["relative_score"] is None else f"{c['relative_score']:.3f}"
                lines.append(f"Submission check: valid; {c['metric_name']} = {c['metric']:.6g} (baseline "
                             f"{c['baseline']:.6g}, best {c['best']:.6g}); relative score {rel}")
                if c["figures"]:
                    lines.append("Submission figures: " + ", ".join(f"{k} = {v:.4g}" for k, v in c["figures"].items()))
            else:
                lines.append(f"Submission check: invalid ({c['status']}): {c['error']}")
        return "\n".join(lines)
