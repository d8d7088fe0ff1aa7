"""DSBench tasks: import the official data layout, or build an offline pack from scikit-learn's bundled data.

Both write one task directory per task (envs/dsbench.py) and a tasks.jsonl; `make_pack` writes a small
DSBench-style layout and runs the very importer real data goes through. With the authors' cleaned task texts
(their data/Bench/dsbench_modeling_cleaned_prompts.json) a task's row keeps DSBench's text as its "prompt"
(the coach's, as the authors' coach was shown it) and the cleaned one as "agent_prompt" (what the agents see).
Where DSBench's files are silent (docs/reference.md, "DSBench pipeline"), a metric not implemented here skips
the task rather than score it wrongly. pandas and scikit-learn (seconds to import) load only once the input
has been checked, so that `mappa dsbench import` refuses bad input at once.
"""

from __future__ import annotations

import json
import os
import re

# First match wins, so the more specific names come first; None marks a metric named but not implemented.
METRIC_PATTERNS = [
    (r"log(arithmic)? error|RMSLE", "rmsle"),
    (r"log ?loss|logarithmic loss|cross.?entropy", "log_loss"),
    (r"root mean squared? error|RMSE", "rmse"),
    (r"median absolute|MedAE", "medae"),
    (r"mean absolute error|\bMAE\b", "mae"),
    (r"SMAPE", "smape"),
    (r"gini", "gini"),
    (r"quadratic weighted kappa|\bQWK\b", "qwk"),
    (r"kappa", None),  # unweighted or linear: not implemented
    (r"pearson", "pearson"),
    (r"spearman", "spearman"),
    (r"jaccard", "jaccard"),
    (r"\bMAP@3\b|\bMPA@3\b", "map3"),  # Kaggle's s3e13 page writes MPA@3
    (r"\bROC\b|\bAUC\b", "roc_auc"),
    (r"micro.{0,20}F1|F1.{0,20}micro", "f1_micro"),
    (r"macro.{0,20}F1|F1.{0,20}macro", "f1_macro"),
    (r"\bF1\b|F-score", "f1"),
    (r"accuracy", "accuracy"),
    (r"\bR2\b|R\^2|R²|coefficient of determination", "r2"),
]
# Where a description states its metric: a heading, or the sentence itself where a page has no heading
# (nlp-getting-started), or one whose first "Evaluation" is another word's (learning-agency-lab's "Automated
# Writing Evaluation").
METRIC_ANCHOR = r"Evaluation|Metric|[Ss]ubmissions (are|will be) (evaluated|scored)"
CLEANED_PROMPTS = "dsbench_modeling_cleaned_prompts.json"
AUTHORS_DATA = "https://github.com/ltjed/multiagent-coaching (data/Bench/)"


def load_cleaned_prompts(path: str, how_found: str) -> dict:
    """task id -> the authors' cleaned task text, from their {task id: {"cleaned_prompt": ...}} file;
    ValueError naming the file, the entry and where the authors publish it otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"no {path} ({how_found}): the agents' task text is the authors' cleaned one by "
                         f"default; get {CLEANED_PROMPTS} from {AUTHORS_DATA} and put it there or pass "
                         "--cleaned-prompts PATH, or pass --task-text raw to give the agents DSBench's raw "
                         "Kaggle text") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not the authors' cleaned prompts ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object of task id -> {{\"cleaned_prompt\": text}}")
    for task_id, entry in data.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("cleaned_prompt"), str):
            raise ValueError(f"{path}: entry {task_id!r} has no \"cleaned_prompt\" text")
    return {task_id: entry["cleaned_prompt"] for task_id, entry in data.items()}


def infer_metric(prompt: str):
    """(metric or None, the phrase it was read from) from a Kaggle description's evaluation text: the 1,500
    characters from each anchor in turn, the first that names a metric."""
    starts = [m.start() for m in re.finditer(METRIC_ANCHOR, prompt)] or [0]
    for at in starts:
        for pattern, metric in METRIC_PATTERNS:
            m = re.search(pattern, prompt[at : at + 1500], re.IGNORECASE)
            if m:
                return metric, m.group(0)
    return None, "no metric named in the description"


def constant_baseline(metric: str, train: pd.DataFrame, truth: pd.DataFrame, pos_label=None) -> float:
    """The metric of a prediction made without features: one constant per target column, from train.csv."""
    import pandas as pd

    from openrlhf_mappa.envs.dsbench import METRICS, metric_value

    pred = pd.DataFrame(index=truth.index)
    for col in truth.columns:
        if METRICS[metric].numeric:  # numbers (ROC-AUC included: a constant probability scores 0.5)
            pred[col] = pd.to_numeric(train[col], errors="coerce").mean()
        else:
            pred[col] = train[col].mode().iloc[0]
    return metric_value(metric, truth, pred, pos_label)


def _relocate(data_root: str, path: str) -> str:
    """A metadata path moved under data_root, from its "data_resplit/" or "answers/" part onwards."""
    for anchor in ("data_resplit/", "answers/"):
        if anchor in path:
            return os.path.join(data_root, anchor + path.split(anchor, 1)[1])
    return os.path.join(data_root, path)


def import_tasks(data_root: str, metadata_path: str, out_dir: str, cleaned: dict = None) -> tuple:
    """Write out_dir/<task_id>/ and out_dir/tasks.jsonl; return (task rows, [skip reasons]). Metadata rows (as
    in DSBench's dsbench_modeling_*.json): {prompt, metadata: {task_id, train_file, test_file, answer_dir,
    url, and optionally metric, baseline, best, pos_label}}; their data_type is not read (the answers decide
    it). `cleaned` (load_cleaned_prompts): a task it has gets that text as its "agent_prompt"; one it lacks
    keeps DSBench's text for the agents too, as the authors' workflow does."""
    with open(metadata_path, encoding="utf-8") as f:
        text = f.read()
    try:  # JSON Lines, as mappa-bench ships it, or one JSON list
        rows = (json.loads(text) if text.lstrip().startswith("[")
                else [json.loads(x) for x in text.splitlines() if x.strip()])
    except json.JSONDecodeError as e:
        raise ValueError(f"{metadata_path}: broken JSON: {e}") from None
    for i, row in enumerate(rows, 1):
        if not isinstance(row, dict) or not isinstance(row.get("metadata") or {}, dict):
            raise ValueError(f"{metadata_path}: entry {i} is not a task's record (a JSON object with a "
                             f"'metadata' object)")
    if not os.path.isdir(data_root):
        raise ValueError(f"--data-root {data_root}: not a directory (the one holding data_resplit/ and "
                         f"answers/)")
    os.makedirs(out_dir, exist_ok=True)
    tasks, skipped = [], []
    for row in rows:
        meta = row.get("metadata") or {}
        try:
            task = _import_one(data_root, row, meta, out_dir)
        except (OSError, ValueError) as e:
            skipped.append(f"{meta.get('task_id', '?')}: {e}")
            continue
        if cleaned and task["id"] in cleaned:
            task["agent_prompt"] = cleaned[task["id"]]
        tasks.append(task)
    if tasks:
        with open(os.path.join(out_dir, "tasks.jsonl"), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(t) + "\n" for t in tasks)
    return tasks, skipped


def _import_one(data_root: str, row: dict, meta: dict, out_dir: str) -> dict:
    import pandas as pd

    from openrlhf_mappa.envs.dsbench import ANSWER_FILE, METRICS, detect_data_type

    for key in ("task_id", "train_file", "test_file", "answer_dir"):
        if not meta.get(key):
            raise ValueError(f"metadata has no {key!r}")
    if not re.fullmatch(r"[\w.-]+", meta["task_id"]) or meta["task_id"].startswith("."):
        raise ValueError(f"task_id {meta['task_id']!r} cannot be a directory name")
    data_dir = os.path.dirname(_relocate(data_root, meta["test_file"]))
    sources = {
        "train.csv": _relocate(data_root, meta["train_file"]),
        "test.csv": _relocate(data_root, meta["test_file"]),
        "sample_submission.csv": os.path.join(data_dir, "sample_submission.csv"),
        ANSWER_FILE: os.path.join(_relocate(data_root, meta["answer_dir"]), "test_answer.csv"),
    }
    absent = [path for path in sources.values() if not os.path.isfile(path)]
    if absent:
        raise ValueError(f"missing file(s): {', '.join(absent)}")
    metric, phrase = ((meta["metric"], "metadata") if meta.get("metric")
                      else infer_metric(row.get("prompt", "")))
    if metric not in METRICS:
        raise ValueError(f"metric not supported (read from {phrase!r}); supported: {', '.join(METRICS)}")
    columns = list(pd.read_csv(sources["sample_submission.csv"], nrows=0).columns)
    id_column, targets = columns[0], columns[1:]
    truth = pd.read_csv(sources[ANSWER_FILE], dtype={id_column: str})
    if not targets or any(c not in truth.columns for c in columns):
        raise ValueError(f"test_answer.csv columns {list(truth.columns)} do not cover the submission's "
                         f"{columns}")
    truth = truth[targets]
    # The metadata's data_type is not read: 3 string-label tasks say regression.
    data_type = detect_data_type(truth)
    baseline = meta.get("baseline")
    if baseline is None:
        train_columns = pd.read_csv(sources["train.csv"], nrows=0).columns
        if any(c not in train_columns for c in targets):
            raise ValueError(f"cannot compute a baseline: train.csv lacks target column(s) {targets}; "
                             "add 'baseline' to the metadata")
        train = pd.read_csv(sources["train.csv"], usecols=targets)
        baseline = constant_baseline(metric, train, truth, meta.get("pos_label"))
    best = meta.get("best", METRICS[metric].perfect)

    task_dir = os.path.abspath(os.path.join(out_dir, meta["task_id"]))
    os.makedirs(os.path.join(task_dir, "answers"), exist_ok=True)
    for name, src in sources.items():
        link = os.path.join(task_dir, name)
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(os.path.abspath(src), link)
    task_json = {"task_id": meta["task_id"], "data_type": data_type, "metric": metric, "id_column": id_column,
                 "target_columns": targets, "baseline": float(baseline), "best": float(best),
                 "url": meta.get("url", "")}
    if meta.get("pos_label") is not None:
        task_json["pos_label"] = meta["pos_label"]
    with open(os.path.join(task_dir, "task.json"), "w", encoding="utf-8") as f:
        json.dump(task_json, f, indent=1)
    return {"id": meta["task_id"], "prompt": row["prompt"], "answer": task_dir, "type": data_type}


# ---------------------------------------------------------------- the offline pack
PACK = [  # (task id, sklearn loader, data type, metric, what the target is)
    ("sk-diabetes", "load_diabetes", "regression", "rmse",
     "a quantitative measure of disease progression one year after baseline"),
    ("sk-breast-cancer", "load_breast_cancer", "classification", "roc_auc",
     "whether the tumour is benign (1) or malignant (0)"),
    ("sk-wine", "load_wine", "classification", "accuracy", "the cultivar of the wine (0, 1 or 2)"),
    ("sk-iris", "load_iris", "classification", "f1_macro",
     "the iris species (setosa, versicolor or virginica)"),
]
METRIC_TEXT = {
    "rmse": "the root mean squared error (RMSE) between the predicted and the actual values",
    "roc_auc": "the area under the ROC curve between the predicted probability and the observed target",
    "accuracy": "classification accuracy, the share of predicted labels that are correct",
    "f1_macro": "the macro-averaged F1 score between the predicted and the actual labels",
}


def make_pack(out_dir: str, seed: int = 0) -> tuple:
    """Build the offline pack from datasets inside scikit-learn (no download), deterministically; returns
    import_tasks'. A 70/30 split (stratified for classification), baseline a constant predictor, best a random
    forest's score (a perfect value would make every real model look poor)."""
    import numpy as np
    import pandas as pd
    from sklearn import datasets
    from sklearn.ensemble import RandomForestClassifier, RandomForestRegressor
    from sklearn.model_selection import train_test_split

    from openrlhf_mappa.envs.dsbench import metric_value

    raw = os.path.join(out_dir, "raw")
    metadata = []
    for task_id, loader, data_type, metric, target_text in PACK:
        bunch = getattr(datasets, loader)(as_frame=True)
        X, y = bunch.data, bunch.target
        if loader == "load_iris":  # string labels, so the scorer's label path is exercised too
            y = y.map(dict(enumerate(bunch.target_names)))
        X.insert(0, "id", np.arange(1000, 1000 + len(X)))
        stratify = y if data_type == "classification" else None
        X_tr, X_te, y_tr, y_te = train_test_split(X, y, test_size=0.3, random_state=seed, stratify=stratify)
        data_dir, answer_dir = (os.path.join(raw, "data_resplit", task_id),
                                os.path.join(raw, "answers", task_id))
        for d in (data_dir, answer_dir):
            os.makedirs(d, exist_ok=True)
        X_tr.assign(target=y_tr).to_csv(os.path.join(data_dir, "train.csv"), index=False)
        X_te.to_csv(os.path.join(data_dir, "test.csv"), index=False)
        placeholder = y_tr.mode().iloc[0] if metric in ("accuracy", "f1_macro") else 0.5
        for where, target in ((os.path.join(data_dir, "sample_submission.csv"), placeholder),
                              (os.path.join(answer_dir, "test_answer.csv"), y_te)):
            pd.DataFrame({"id": X_te["id"], "target": target}).to_csv(where, index=False)

        features, test = X_tr.drop(columns="id"), X_te.drop(columns="id")
        forest = RandomForestRegressor if data_type == "regression" else RandomForestClassifier
        ref = forest(n_estimators=100, random_state=seed).fit(features, y_tr)
        pred = ref.predict_proba(test)[:, 1] if metric == "roc_auc" else ref.predict(test)
        best = metric_value(metric, pd.DataFrame({"target": y_te.to_numpy()}), pd.DataFrame({"target": pred}))
        prompt = (
            f"Description\nPredict {target_text} from the features of scikit-learn's bundled "
            f"{loader.removeprefix('load_')} dataset ({len(X)} rows, {features.shape[1]} feature "
            f"columns).\n\n"
            f"Evaluation\nSubmissions are evaluated on {METRIC_TEXT[metric]}.\n\n"
            f"Submission File\nFor each id in the test set, predict the target. The file must have a header "
            f"and exactly the columns of sample_submission.csv:\nid,target\n"
            f"{X_te['id'].iloc[0]},{placeholder}\netc.\n\n"
            "Files\n- train.csv - the training set (an id column, the features and the target column)\n"
            "- test.csv - the test set (the id column and the features)\n"
            "- sample_submission.csv - a sample submission file in the correct format"
        )
        metadata.append({"prompt": prompt, "answer": None, "metadata": {
            "task_id": task_id, "task_type": "data_modeling", "data_type": data_type,
            "train_file": f"./data_resplit/{task_id}/train.csv",
            "test_file": f"./data_resplit/{task_id}/test.csv",
            "answer_dir": f"./answers/{task_id}", "url": f"sklearn.datasets.{loader}",
            "metric": metric, "best": best,
        }})
    metadata_path = os.path.join(raw, "metadata.jsonl")
    with open(metadata_path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(m) + "\n" for m in metadata)
    return import_tasks(raw, metadata_path, out_dir)
