"""DSBench: a Data Engineer, a Modeler and an Analyst solve a Kaggle-style modeling task in one workspace
(docs/reference.md, "DSBench pipeline"). Each agent owes the files of its `contract`, the next one's inputs;
its turns end on a reply without code (the authors' rule), or with `end_turn_on_files` once its files exist.

A task row names its task directory as "answer" (satisfying `load_tasks` without an answer in a prompt):
task.json, the public CSVs copied into the workspace (`workspace_files`: stateless, the authors' sandbox, or
persistent), and the hidden answers/test_answer.csv, read only by the scorer. Its "prompt" is the task's text
as DSBench states it (the coach's {task}, with the topology's problem_suffix); "agent_prompt", where
`mappa dsbench import` wrote the authors' cleaned text, is what the agents' {task} shows instead, never with
the suffix. The coach's evidence (`coach_evidence`) is the authors' (the files when the agent's turn began,
those earlier agents saved, the Analyst's raw metrics) or ours (the contract state after the action, the
submission's score); never the answers. A broken task directory or a bad submission is a status in the
outcome, never an exception.
"""

import dataclasses
import json
import os
import shutil
from fnmatch import fnmatchcase
from functools import partial
from typing import Callable, NamedTuple, Optional

import numpy as np
import pandas as pd
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import (accuracy_score, cohen_kappa_score, f1_score, log_loss, mean_absolute_error,
                             mean_squared_error, median_absolute_error, r2_score, roc_auc_score,
                             root_mean_squared_error, root_mean_squared_log_error)

from openrlhf_mappa.envs.base import MultiAgentEnv

PUBLIC_FILES = ("train.csv", "test.csv", "sample_submission.csv")
UPLOADED = ("train.csv", "test.csv")  # what the authors upload for every code run (no sample_submission.csv)
# What the authors' workflow fetches after a code run: the Data Engineer's and Modeler's artifacts, the
# Analyst's CSVs
ARTIFACTS = ("*.pkl", "*.joblib", "*.npy", "*.npz")
SUBMISSIONS = ("submission.csv", "predictions.csv")
WORKSPACE_FILES = ("stateless", "persistent")
COACH_EVIDENCE = ("authors", "ours")
ANSWER_FILE = os.path.join("answers", "test_answer.csv")
SUBMISSION = "submission.csv"
DEFAULT_CONTRACT = {"data_engineer": ["X_train.pkl", "y_train.pkl", "X_test.pkl"], "modeler": ["model.pkl"],
                    "analyst": [SUBMISSION]}


# ---------------------------------------------------------------- metrics
# y: true values, p: predictions, both 1-D arrays (2-D for a metric not `per_column`). A task with several
# target columns scores the mean of the per-column metric (Kaggle's "mean column-wise" convention).
# scikit-learn and scipy compute every metric they have; the few written here (SMAPE, MAP@3, word Jaccard) are
# the competitions' formulas.
class Metric(NamedTuple):
    fn: Callable
    higher_is_better: bool
    # predictions must be numbers (else labels, compared as numbers when both sides are numeric)
    numeric: bool
    perfect: float
    per_column: bool = True


def correlation(statistic, y, p) -> float:
    """scipy's Pearson or Spearman statistic; 0 where a side is constant (scipy: nan): a constant ranks
    nothing."""
    return 0.0 if np.ptp(y) == 0 or np.ptp(p) == 0 else float(statistic(y, p).statistic)


def quadratic_kappa(y, p) -> float:
    """Quadratic weighted kappa over every rating from the lowest to the highest given (Kaggle's N x N
    matrix), so that a rating nobody gave still counts in the distance; ratings must be integers."""
    ratings = np.concatenate([y, p]).astype(float)  # a label that is not a number is a ValueError here
    if not np.array_equal(ratings, np.round(ratings)):
        raise ValueError("quadratic weighted kappa needs integer ratings")
    return float(
        cohen_kappa_score(y, p, weights="quadratic", labels=np.arange(ratings.min(), ratings.max() + 1))
    )


def smape(y, p) -> float:
    """Kaggle's SMAPE in percent, 0 for a row where both values are 0 (neither library has it)."""
    mean_size = (np.abs(y) + np.abs(p)) / 2
    ratio = np.divide(np.abs(p - y), mean_size, out=np.zeros(len(y)), where=mean_size != 0)
    return float(100 * np.mean(ratio))


def map_at_3(y, p) -> float:
    """Kaggle's MAP@3 with one true label a row: 1/k when the first of the (space-separated) guesses to match
    is the k-th of the first 3, else 0."""
    scores = []
    for truth, guesses in zip(y, p):
        top = str(guesses).split()[:3]
        scores.append(1 / (top.index(str(truth)) + 1) if str(truth) in top else 0.0)
    return float(np.mean(scores))


def word_jaccard(y, p) -> float:
    """tweet-sentiment-extraction's word-level Jaccard (lower case, split on whitespace), the mean over rows;
    two texts without words agree."""
    scores = []
    for truth, pred in zip(y, p):
        a, b = set(str(truth).lower().split()), set(str(pred).lower().split())
        scores.append(len(a & b) / len(a | b) if a | b else 1.0)
    return float(np.mean(scores))


def class_log_loss(y, p) -> float:
    """Log loss over a row's columns: one column is the positive class's probability (labels 0/1), several are
    one probability per class against one-hot answers (lmsys). Rows are rescaled to sum to 1, as Kaggle's
    scorer (scikit-learn's "eps=auto" log_loss of its day) did; scikit-learn clips to the float precision."""
    if y.shape[1] == 1:
        return float(log_loss(y[:, 0], p[:, 0], labels=[0, 1]))
    return float(log_loss(y.argmax(axis=1), p / p.sum(axis=1, keepdims=True), labels=np.arange(y.shape[1])))


METRICS = {
    # by hand: scikit-learn refuses a probability where a label is due; Kaggle counts it as a wrong label
    "accuracy": Metric(lambda y, p: np.mean(y == p), True, False, 1.0),
    "f1": Metric(partial(f1_score, average="binary"), True, False, 1.0),  # the task's pos_label, else 1
    "f1_macro": Metric(partial(f1_score, average="macro"), True, False, 1.0),
    "f1_micro": Metric(partial(f1_score, average="micro"), True, False, 1.0),
    "qwk": Metric(quadratic_kappa, True, False, 1.0),
    "map3": Metric(map_at_3, True, False, 1.0),
    "jaccard": Metric(word_jaccard, True, False, 1.0),
    "roc_auc": Metric(roc_auc_score, True, True, 1.0),
    # normalized Gini: Kaggle's forum formula where no two predictions tie (it breaks ties by row order)
    "gini": Metric(lambda y, p: 2 * roc_auc_score(y, p) - 1, True, True, 1.0),
    "log_loss": Metric(class_log_loss, False, True, 0.0, per_column=False),
    "rmse": Metric(root_mean_squared_error, False, True, 0.0),
    "rmsle": Metric(root_mean_squared_log_error, False, True, 0.0),
    "mae": Metric(mean_absolute_error, False, True, 0.0),
    "medae": Metric(median_absolute_error, False, True, 0.0),
    "smape": Metric(smape, False, True, 0.0),
    "r2": Metric(r2_score, True, True, 1.0),
    "pearson": Metric(partial(correlation, pearsonr), True, True, 1.0),
    "spearman": Metric(partial(correlation, spearmanr), True, True, 1.0),
}


def relative_score(pred: float, baseline: float, best: float) -> Optional[float]:
    """DSBench's max(0, (pred - baseline) / (best - baseline)), right for lower-is-better metrics too (both
    differences flip sign); None when best == baseline (no room to improve)."""
    if best == baseline:
        return None
    return max(0.0, (pred - baseline) / (best - baseline))


def metric_value(name: str, truth: pd.DataFrame, pred: pd.DataFrame, pos_label=None) -> float:
    """The task metric: the mean over target columns, or one value over them all (log loss). Labels compare as
    numbers when both sides are numeric (a predicted 1.0 equals a true 1), else as strings."""
    metric = METRICS[name]
    if not metric.per_column:
        return float(metric.fn(truth.to_numpy(dtype=float), pred.to_numpy(dtype=float)))
    kwargs = {"pos_label": pos_label} if name == "f1" and pos_label is not None else {}
    values = []
    for col in truth.columns:
        y, p = truth[col], pred[col]
        yn, pn = pd.to_numeric(y, errors="coerce"), pd.to_numeric(p, errors="coerce")
        if metric.numeric or (yn.notna().all() and pn.notna().all()):
            y, p = yn, pn
        else:
            y, p = y.astype(str), p.astype(str)
        values.append(metric.fn(y.to_numpy(), p.to_numpy(), **kwargs))
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
    missing = [
        k
        for k in ("task_id", "data_type", "metric", "id_column", "target_columns", "baseline", "best")
        if k not in meta
    ]
    if missing:
        raise ValueError(f"{path}: missing key(s) {missing}")
    if meta["metric"] not in METRICS:
        raise ValueError(f"{path}: unknown metric {meta['metric']!r}; known: {', '.join(METRICS)}")
    absent = [
        name for name in PUBLIC_FILES + (ANSWER_FILE,) if not os.path.isfile(os.path.join(task_dir, name))
    ]
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
           "task_type": meta["data_type"]}  # until the answers are read

    def invalid(status, error):
        return dict(out, status=status, error=error)

    try:
        truth = pd.read_csv(os.path.join(task_dir, ANSWER_FILE), dtype={ids: str})
    except (OSError, ValueError) as e:
        raise ValueError(f"{task_dir}: unreadable {ANSWER_FILE}: {e}") from None
    if not set([ids] + targets) <= set(truth.columns):
        raise ValueError(f"{task_dir}: {ANSWER_FILE} lacks column(s) of {[ids] + targets}")
    out["task_type"] = detect_data_type(truth[targets])
    if not os.path.isfile(submission):
        return invalid("missing_file", f"no {os.path.basename(submission)} was written")
    try:
        sub = pd.read_csv(submission, dtype={ids: str})
    except (OSError, ValueError) as e:  # pandas' parser, empty-file and decoding errors are ValueErrors
        return invalid("unreadable", f"cannot read the submission as CSV: {e}")
    sub.columns = sub.columns.astype(str).str.strip()
    if sorted(sub.columns) != sorted([ids] + targets):
        return invalid("wrong_columns", f"expected columns {[ids] + targets}, got {list(sub.columns)}")
    if len(sub) != len(truth):
        return invalid("wrong_row_count", f"expected {len(truth)} rows (one per test row), got {len(sub)}")
    if sub[ids].duplicated().any() or set(sub[ids]) != set(truth[ids]):
        unknown = sorted(map(str, set(sub[ids]) - set(truth[ids])))[:5]  # str: an empty id reads as NaN
        return invalid(
            "wrong_ids", f"the {ids} values must be the test set's, each once; e.g. unknown: {unknown}"
        )
    sub = sub.set_index(ids).loc[truth[ids], targets]
    truth = truth.set_index(ids)[targets]
    numeric = METRICS[meta["metric"]].numeric
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
    except (ValueError, TypeError) as e:  # e.g. f1 with labels that do not fit the task's pos_label
        return invalid("metric_error", f"{meta['metric']} could not be computed: {e}")
    figures = coach_figures(out["task_type"], meta["metric"], truth, values)
    return dict(out, valid=True, metric=metric, figures=figures,
                relative_score=relative_score(metric, meta["baseline"], meta["best"]))


def detect_data_type(truth: pd.DataFrame) -> str:
    """The task's type from its answers, as the authors' detect_data_type (ground_truth_utils.py) reads the
    first target column: values within {0, 1}, two distinct values, or integers with at most 10 distinct
    values are classification, other numbers regression. Labels that are not numbers are classification here
    (theirs fall through to regression and then score nothing), whatever DSBench's metadata says."""
    values = truth.iloc[:, 0].dropna()
    distinct = set(values.unique())
    if not pd.api.types.is_numeric_dtype(values) or distinct <= {0, 1} or len(distinct) == 2:
        return "classification"
    if pd.api.types.is_integer_dtype(values) and len(distinct) <= 10:
        return "classification"
    return "regression"


def coach_figures(data_type: str, metric: str, truth: pd.DataFrame, pred: pd.DataFrame) -> dict:
    """The figures besides the metric that the authors' coach grades by (their ground_truth_utils.py):
    accuracy for labels; for regression RMSE, MAE and RMSE as a percentage of the target's range and
    interquartile range. Aggregates only: no answer reaches the coach."""
    if data_type != "regression":
        return {} if METRICS[metric].numeric else {"accuracy": metric_value("accuracy", truth, pred)}
    y = truth.apply(pd.to_numeric, errors="coerce").to_numpy(dtype=float).ravel()
    p = pred.apply(pd.to_numeric, errors="coerce").to_numpy(dtype=float).ravel()
    if not (np.isfinite(y).all() and np.isfinite(p).all()):
        return {}  # labels scored as labels (say macro F1 on integer classes): no error to size
    figures = {"rmse": root_mean_squared_error(y, p), "mae": mean_absolute_error(y, p)}
    spread = {"range": np.ptp(y), "iqr": np.subtract(*np.percentile(y, [75, 25]))}
    figures.update({f"rmse_pct_of_{k}": 100 * figures["rmse"] / v for k, v in spread.items() if v > 0})
    return figures


def authors_figures(truth: pd.Series, pred: pd.Series, data_type: str) -> dict:
    """The raw figures the authors' coach is shown for the Analyst (their ground_truth_utils.py
    compute_all_metrics): the submission's first prediction column against the answers' first target, paired
    row by row in file order as theirs are (not by id), over the shorter of the two. Numbers as theirs read
    them ("true"/"false" 1/0, what is no number 0). Classification: accuracy and F1 (binary, or weighted over
    more classes) of the rounded predictions, ROC-AUC for two classes when every prediction is a probability;
    text labels compare as text (theirs call those regression and compute nothing). Regression: RMSE, MAE, MSE
    and the target's statistics. A figure scikit-learn refuses is left out, as theirs is."""
    n = min(len(truth), len(pred))
    y, p = truth.iloc[:n], pred.iloc[:n]
    number = pd.to_numeric(p.map(lambda v: {"true": 1, "false": 0}.get(str(v).lower(), v)), errors="coerce")
    number = number.fillna(0.0).to_numpy(dtype=float)
    if data_type == "regression":
        y = y.to_numpy(dtype=float)
        mse = mean_squared_error(y, number)
        q25, median, q75 = np.percentile(y, [25, 50, 75])
        out = {"rmse": np.sqrt(mse), "mae": mean_absolute_error(y, number), "mse": mse, "target_min": y.min(),
               "target_max": y.max(), "target_mean": y.mean(), "target_std": y.std(), "target_q25": q25,
               "target_median": median, "target_q75": q75, "target_range": np.ptp(y), "target_iqr": q75 - q25}
        out.update({f"rmse_pct_of_{k}": 100 * out["rmse"] / out[f"target_{k}"] for k in ("range", "iqr")
                    if out[f"target_{k}"] > 0})
        return {k: float(v) for k, v in out.items()}
    numeric = pd.api.types.is_numeric_dtype(y)
    if numeric:
        y, labels = y.to_numpy().astype(int), np.round(number).astype(int)
    else:
        y, labels = y.astype(str).to_numpy(), p.astype(str).to_numpy()
    binary = len(np.unique(y)) == 2
    figures = {"accuracy": partial(accuracy_score, y, labels),
               "f1": partial(f1_score, y, labels, average="binary" if binary else "weighted",
                             zero_division=0)}
    if numeric and binary and ((number >= 0) & (number <= 1)).all():
        figures["roc_auc"] = partial(roc_auc_score, y, number)
    out = {}
    for name, compute in figures.items():
        try:
            out[name] = float(compute())
        except ValueError:  # e.g. binary F1 of labels other than 0/1
            pass
    return out


# ---------------------------------------------------------------- the environment
class DSBenchEnv(MultiAgentEnv):
    task_type = ""  # set per task: "regression" or "classification"
    grader = "valid submission.csv"

    def __init__(
        self,
        topology,
        task: dict,
        workspace: str,
        code_timeout_s: float = 120.0,
        contract: dict = None,
        end_turn_on_files: bool = False,
        workspace_files: str = "persistent",
        coach_evidence: str = "ours",
    ):
        super().__init__(topology, task, workspace, code_timeout_s)
        for key, value, allowed in (("workspace_files", workspace_files, WORKSPACE_FILES),
                                    ("coach_evidence", coach_evidence, COACH_EVIDENCE)):
            if value not in allowed:
                raise ValueError(f"env_kwargs {key} must be one of {', '.join(allowed)}, got {value!r}")
        self.stateless = workspace_files == "stateless"
        # stateless: the files fetched so far, beside the workspace (the authors' store, out of the sandbox's
        # sight)
        self.kept = workspace.rstrip(os.sep) + ".kept"
        self.authors_evidence = coach_evidence == "authors"
        # agent -> the workspace's files when its turn began (the authors' evidence)
        self.turn_start_files = {}
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
        self.copied = {}  # task file -> (inode, size, mtime) of its copy: how a changed one is told
        try:
            meta = load_task_dir(self.task_dir)
            self.task_type, self.metric_name = meta["data_type"], meta["metric"]
            os.makedirs(workspace, exist_ok=True)
            shutil.rmtree(self.kept, ignore_errors=True)  # a workspace used again starts with nothing kept
            self.copy_task_files()
        except (OSError, ValueError) as e:
            self.task_error = str(e)

    def copy_task_files(self):
        """Copy the task's files into the workspace, again where a code run removed or changed one."""
        for name in UPLOADED if self.stateless else PUBLIC_FILES:
            path = os.path.join(self.workspace, name)
            st = os.lstat(path) if os.path.lexists(path) else None
            if st and self.copied.get(name) == (st.st_ino, st.st_size, st.st_mtime_ns):
                continue
            if st:
                os.remove(path)  # not written through: it may be a link the code made
            shutil.copyfile(os.path.join(self.task_dir, name), path)
            st = os.lstat(path)
            self.copied[name] = (st.st_ino, st.st_size, st.st_mtime_ns)

    def observe(self, agent, turn: int, omit: int = 0) -> list:
        """The base's messages, with {task} the agents' text: the authors' cleaned one where the import wrote
        it ("agent_prompt"), else the task's own, never with the problem_suffix; the coach's {task}
        (task_text) is the task's own text and the suffix, as the authors' coach's {problem} was
        (dsbench_workflow.py L363-375 and `problem=prompt`, which prompts_loader.py ended with default.yaml's
        suffix)."""
        shown = self.task.get("agent_prompt")
        if shown is None:
            shown = self.task["prompt"]
        prompt = agent.prompt.replace("{task}", shown.replace("{", "{{").replace("}", "}}"))
        return super().observe(dataclasses.replace(agent, prompt=prompt), turn, omit)

    def step(self, agent, turn: int, response: str):
        if turn == 0:
            self.turn_start_files[agent.name] = self.listing()
        result = super().step(agent, turn, response)
        if self.stateless and result.feedback.ran and not self.task_error:
            self.restart_sandbox(agent)
        own = self.contract.get(agent.name)
        if self.end_turn_on_files and result.feedback.ran and own and not self.missing(own):
            result.done = True  # its files exist: the next agent starts
        return result

    def restart_sandbox(self, agent):
        """The authors' SandboxFusion is stateless: each code run starts from the uploaded train.csv and
        test.csv and the files their workflow fetched after earlier runs and kept on the host
        (dsbench_workflow.py L215-265, L488-493, L658-663, L863-866). So this run's files of the agent's kinds
        replace the kept ones in `kept`, everything else goes, and a kept file the run deleted or changed
        comes back as kept."""
        # The authors' Analyst fetched only its submission; the Data Engineer and Modeler their artifacts. The
        # agent owing submission.csv in the contract is the Analyst's place.
        kinds = SUBMISSIONS if SUBMISSION in self.contract.get(agent.name, []) else ARTIFACTS
        os.makedirs(self.kept, exist_ok=True)
        for name in os.listdir(self.workspace):
            path = os.path.join(self.workspace, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            elif (
                any(fnmatchcase(name, p) for p in kinds) and os.path.isfile(path) and not os.path.islink(path)
            ):
                shutil.copyfile(path, os.path.join(self.kept, name))  # fetched
            elif name not in UPLOADED:
                os.remove(path)
        for name in os.listdir(self.kept):
            if not os.path.exists(os.path.join(self.workspace, name)):  # not fetched from this run
                shutil.copyfile(os.path.join(self.kept, name), os.path.join(self.workspace, name))
        self.copy_task_files()

    def contract_files(self, agent) -> tuple:
        """(the files earlier agents had to save, this agent's own): what `judge` and our coach evidence blame
        by."""
        names = [a.name for a in self.topology.agents]
        upstream = [f for a in names[: names.index(agent.name)] for f in self.contract.get(a, [])]
        return upstream, self.contract.get(agent.name, [])

    def listing(self) -> list:
        return sorted(os.listdir(self.workspace)) if os.path.isdir(self.workspace) else []

    def missing(self, files) -> list:
        return [f for f in files if not os.path.isfile(os.path.join(self.workspace, f))]

    def submission_check(self) -> dict:
        if self.task_error:
            return {
                "valid": False,
                "status": "broken_task",
                "error": self.task_error,
                "task_type": self.task_type,
            }
        return score_submission(self.task_dir, os.path.join(self.workspace, SUBMISSION))

    def answer_formatted(self, agent, response: str) -> Optional[bool]:
        """For the agent that owes submission.csv: is the file there and valid after this action?"""
        return self.submission_check()["valid"] if SUBMISSION in self.contract.get(agent.name, []) else None

    def outcome(self) -> dict:
        """Ours (a valid submission, its metric) and the authors' figures of the predictions the Analyst left
        (authors_predictions; None: theirs scores no such episode), which evaluation pools as theirs does."""
        check = self.submission_check()
        missing = {a: m for a, files in self.contract.items() if (m := self.missing(files))}
        found = None if self.task_error else self.authors_predictions()
        figures = None if found is None else authors_figures(*found, self.task_type)
        return {"success": check.pop("valid"), **check, "missing_files": missing, "authors_figures": figures}

    def judge(self, agent, response: str, feedback, truncated_at) -> tuple:
        """The contract rule, from the workspace right after the action, so that a missing artifact costs the
        agent that had to make it: an earlier agent's file missing too -> 5 (not this agent's fault); its own
        files missing -> 1 after an error or without code, 3 after a clean run; an invalid submission -> 3;
        files present after an error -> 5; else 7, + 2 x the relative score (at most 1) of a valid
        submission."""
        upstream, own = self.contract_files(agent)
        if self.missing(upstream) and self.missing(own):
            return 5.0, "contract rule: an earlier agent's file is missing; not this agent's fault", False
        if self.missing(own):
            if feedback.error or not feedback.ran:
                return 1.0, "contract rule: its own files are missing after an error or without code", True
            return 3.0, "contract rule: ran cleanly but its own files are still missing", True
        check = self.submission_check() if SUBMISSION in own else None
        if check and not check["valid"]:
            return 3.0, "contract rule: submission.csv is invalid", True
        if feedback.error:  # a reply without code once the files exist closes the agent's turns: no failure
            return 5.0, "contract rule: its files exist but this action's code failed", False
        if check:  # the relative score is None only when the task has best == baseline
            rel = check["relative_score"] or 0.0
            why = f"contract rule: valid submission, relative score {rel:.3f}"
            return 7.0 + 2.0 * min(1.0, rel), why, False
        return 7.0, "contract rule: its files are saved", False

    def coach_ground_truth(self, agent) -> Optional[str]:
        """`ours`: the contract state right after the action (the rollout asks just after `step`), so the
        coach can blame the agent whose file is missing; for the Analyst also the submission's check.
        `authors`: what the authors' coach is shown (authors_evidence)."""
        if self.authors_evidence:
            return self.authors_evidence_text(agent)
        upstream, own = self.contract_files(agent)
        files = self.listing()
        lines = [
            f"DSBench file contract: this agent must save: {', '.join(own) or '(nothing)'}",
            f"Missing inputs (files earlier agents had to save): "
            f"{', '.join(self.missing(upstream)) or 'none'}",
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
                    lines.append(
                        "Submission figures: " + ", ".join(f"{k} = {v:.4g}" for k, v in c["figures"].items())
                    )
            else:
                lines.append(f"Submission check: invalid ({c['status']}): {c['error']}")
        return "\n".join(lines)

    def authors_evidence_text(self, agent) -> str:
        """The authors' coach evidence (dsbench_workflow.py L503-509, L673-679, L876-886): the files in the
        workspace when this agent's turn began (for the Analyst with their warning when no X_test or model
        file is there), the files each earlier agent saved (new by the next agent's turn), and for the agent
        owing submission.csv the raw figures of the submission (or predictions.csv) against the hidden answers
        (ground_truth_utils.py evaluate_analyst_output; their fallback of reading predictions out of the
        reply's text is not kept)."""
        starts = dict(self.turn_start_files)
        starts.setdefault(agent.name, self.listing())
        names = [a.name for a in self.topology.agents if a.name in starts]
        earlier = names[: names.index(agent.name)]
        lines = ["Files available to this agent when its turn began:"]
        lines += [f"  - {f}" for f in starts[agent.name]] or ["  (none)"]
        owes_submission = SUBMISSION in self.contract.get(agent.name, [])
        if owes_submission:
            critical = {"X_test.pkl (the preprocessed test features)": ("x_test", "xtest"),
                        "model.pkl (the trained model)": ("model",)}
            absent = [what for what, marks in critical.items()
                      if not any(m in f.lower() for f in starts[agent.name] for m in marks)]
            if absent:
                lines.append(f"  Warning: critical files missing: {'; '.join(absent)}")
        lines.append("Files saved by earlier agents:")
        for name, after in zip(earlier, names[1:]):
            saved = sorted(set(starts[after]) - set(starts[name]))
            lines.append(f"  {name} saved: {', '.join(saved) or 'no files'}")
        if not earlier:
            lines.append("  (the first agent: no earlier files)")
        lines.append("Figures computed against the hidden answers:")
        lines.append(self.authors_metrics_text() if owes_submission and not self.task_error else "N/A")
        return "\n".join(lines)

    def authors_predictions(self) -> Optional[tuple]:
        """(answers, predictions) as the authors read them (ground_truth_utils.py evaluate_analyst_output):
        the second column of the answers and of the first readable submission.csv or predictions.csv with two
        columns; None when there is none, or no row (their `error`: the episode is not scored)."""
        path = next((p for name in (SUBMISSION, "predictions.csv")
                     if os.path.isfile(p := os.path.join(self.workspace, name))), None)
        try:
            pred = pd.read_csv(path) if path else None
        except (OSError, ValueError):
            pred = None
        if pred is None or pred.shape[1] < 2 or pred.empty:
            return None
        truth = pd.read_csv(os.path.join(self.task_dir, ANSWER_FILE))
        return truth.iloc[:, 1], pred.iloc[:, 1]

    def authors_metrics_text(self) -> str:
        """The Analyst's figures as the authors' coach reads them (evaluate_analyst_output), or their error
        line."""
        found = self.authors_predictions()
        if found is None:
            return ("ERROR: no predictions found (no readable submission.csv or predictions.csv with 2 "
                    "columns)")
        figures = authors_figures(*found, self.task_type)
        lines = [f"Data type: {self.task_type}", f"Task metric: {self.metric_name}",
                 f"Number of predictions: {len(found[1])}", "Computed metrics:"]
        labels = {
            "accuracy": "Accuracy",
            "f1": "F1",
            "roc_auc": "ROC-AUC",
            "rmse": "RMSE",
            "mae": "MAE",
            "mse": "MSE",
        }
        for name, label in labels.items():
            if name in figures:
                better = (
                    "higher is better, at most 1"
                    if name in ("accuracy", "f1", "roc_auc")
                    else "lower is better"
                )
                lines.append(f"  - {label}: {figures[name]:.4f} ({better})")
        if "target_range" in figures:
            f = figures
            lines += [
                "Target statistics (to read the RMSE by):",
                f"  - range: {f['target_min']:.2f} to {f['target_max']:.2f} (range {f['target_range']:.2f})",
                f"  - quartiles: Q25 {f['target_q25']:.2f}, median {f['target_median']:.2f}, "
                f"Q75 {f['target_q75']:.2f}",
                f"  - mean {f['target_mean']:.2f}, std {f['target_std']:.2f}",
            ]
            lines += [f"  - RMSE as % of {label}: {f[f'rmse_pct_of_{k}']:.1f}%"
                      for k, label in (("range", "range"), ("iqr", "IQR")) if f"rmse_pct_of_{k}" in f]
        return "\n".join(lines)
