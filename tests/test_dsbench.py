"""DSBench: metrics against hand-computed values, scripted (non-LLM) agents running real code through
DSBenchEnv on the offline pack, bad submissions, broken task directories, the heuristic coach's blame,
the importer (a fake DSBench layout, and the real metadata when present) and the `mappa dsbench` CLI."""

import asyncio
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats
from sklearn import metrics
from sklearn.preprocessing import MultiLabelBinarizer

from conftest import MAPPA
from openrlhf_mappa.coach import CoachRequest, render_prompt
from openrlhf_mappa.coach.heuristic import HeuristicCoach
from openrlhf_mappa.envs.dsbench import (METRICS, PUBLIC_FILES, DSBenchEnv, authors_figures, detect_data_type,
                                        metric_value, relative_score, score_submission)
from openrlhf_mappa.tools.dsbench_tasks import import_tasks, infer_metric
from openrlhf_mappa.envs.base import load_tasks
from openrlhf_mappa.team import load_topology

ROOT = Path(__file__).resolve().parents[1]
DSBENCH_YAML = ROOT / "examples" / "configs" / "dsbench.yaml"
OWN_RUBRIC_YAML = ROOT / "examples" / "configs" / "dsbench_own_rubric.yaml"
BENCH = Path(os.environ.get("MAPPA_BENCH_DIR", ROOT.parent / "shared" / "data" / "mappa-bench"))


def recipe(**env_kwargs):
    """dsbench.yaml with env_kwargs changed (`coach_evidence="ours"` where a test reads our evidence's text; the
    heuristic coach takes DSBenchEnv.judge's grade, which reads the workspace, whatever the evidence)."""
    topology = load_topology(str(DSBENCH_YAML))
    topology.env_kwargs = dict(topology.env_kwargs, **env_kwargs)
    return topology


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    """The offline pack, built by the real console script (`mappa dsbench make-pack`)."""
    out = tmp_path_factory.mktemp("pack")
    proc = subprocess.run([MAPPA, "dsbench", "make-pack", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("4 task(s) in ") and "(0 skipped)" in proc.stdout, proc.stderr
    return {t["id"]: t for t in load_tasks(str(out / "tasks.jsonl"))}


# ---------------------------------------------------------------- metrics


def one_col(values):
    return pd.DataFrame({"target": values})


@pytest.mark.parametrize(
    "metric, truth, pred, expected",
    [
        ("rmse", [1, 2, 3, 4], [1, 2, 3, 6], 1.0),  # sqrt(4 / 4)
        ("mae", [1, 2, 3, 4], [2, 2, 3, 1], 1.0),  # (1 + 0 + 0 + 3) / 4
        ("rmsle", [0, np.e - 1], [np.e - 1, 0], 1.0),  # log1p: (1 - 0)^2 and (0 - 1)^2 -> sqrt(1)
        ("r2", [1, 2, 3], [1, 2, 4], 0.5),  # 1 - 1 / 2
        ("accuracy", [0, 1, 1, 0], [0, 1, 0, 0], 0.75),
        ("accuracy", [1, 2, 2], [1.0, 2.0, 1.0], 2 / 3),  # 1.0 counts as the label 1
        ("f1", [1, 1, 0, 0], [1, 0, 1, 0], 0.5),  # precision 1/2, recall 1/2
        ("f1_macro", ["a", "a", "b", "b"], ["a", "a", "a", "b"], (0.8 + 2 / 3) / 2),  # a: 2*(2/3*1)/(5/3); b: 2/3
        ("roc_auc", [0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8], 0.75),  # 3 of 4 (pos, neg) pairs ordered right
    ],
)
def test_metrics_match_hand_computed_values(metric, truth, pred, expected):
    assert metric_value(metric, one_col(truth), one_col(pred)) == pytest.approx(expected)


def test_multi_column_metric_is_the_column_mean():
    truth = pd.DataFrame({"a": [0.0, 0.0], "b": [0.0, 0.0]})
    pred = pd.DataFrame({"a": [1.0, 1.0], "b": [3.0, 3.0]})
    assert metric_value("rmse", truth, pred) == pytest.approx(2.0)


def test_relative_score_is_dsbenchs_formula_for_both_directions():
    assert relative_score(0.9, baseline=0.5, best=1.0) == pytest.approx(0.8)  # higher is better
    assert relative_score(60.0, baseline=80.0, best=55.0) == pytest.approx(0.8)  # error: lower is better
    assert relative_score(90.0, baseline=80.0, best=55.0) == 0.0  # worse than the baseline: clipped
    assert relative_score(0.5, baseline=0.5, best=0.5) is None


def test_metric_is_read_from_kaggle_descriptions():
    assert infer_metric("Evaluation\nSubmissions are evaluated on area under the ROC curve")[0] == "roc_auc"
    assert infer_metric("Evaluation: the Root Mean Squared Logarithmic Error. The RMSLE is")[0] == "rmsle"
    assert infer_metric("Evaluation  Submissions are scored on the root mean squared error.")[0] == "rmse"
    assert infer_metric("Evaluation Submissions are evaluated using the macro F1 score.")[0] == "f1_macro"
    assert infer_metric("Evaluation Submissions are scored on the log loss")[0] == "log_loss"
    assert infer_metric("Evaluation Submissions are evaluated on SMAPE between forecasts")[0] == "smape"
    assert infer_metric("Evaluation Submissions are scored on Cohen's kappa")[0] is None  # named, unsupported
    # words that merely contain a metric's letters do not count
    assert infer_metric("Evaluation: the process is scored by accuracy")[0] == "accuracy"
    assert infer_metric("Evaluation\nMicrosoft scores the area under the ROC curve")[0] == "roc_auc"
    # no heading (nlp-getting-started), or an "Evaluation" that is another word's (learning-agency-lab's)
    assert infer_metric("Welcome! " * 300 + "Submissions are evaluated using F1 between the predicted")[0] == "f1"
    essay = "Automated Writing Evaluation (AWE) systems score essays. " + "Words. " * 300
    assert infer_metric(essay + "**Evaluation** Submissions are scored on the quadratic weighted kappa")[0] == "qwk"


# Every metric against scikit-learn's or scipy's own function on random data; the three no library has (SMAPE,
# MAP@3, the word Jaccard) against hand-computed values above and below, the Jaccard also against scikit-learn's
# per-sample set Jaccard.
def random_case(metric: str, rng, n=300) -> tuple:
    """(truth, a good prediction) of the kind the metric scores, as one-column frames (three for log loss)."""
    if metric in ("roc_auc", "gini", "log_loss"):
        y = rng.integers(0, 2, n)
        p = np.clip(0.3 * y + rng.uniform(0, 0.7, n), 0.01, 0.99)
        if metric == "log_loss":  # three classes, one-hot answers, rows of probabilities
            y = rng.integers(0, 3, n)
            probs = rng.dirichlet(np.ones(3), n) + 2 * np.eye(3)[y]
            return pd.DataFrame(np.eye(3)[y]), pd.DataFrame(probs / probs.sum(axis=1, keepdims=True))
    elif metric in ("accuracy", "f1", "f1_macro", "f1_micro", "qwk"):
        y = rng.integers(1, 7, n) if metric == "qwk" else rng.integers(0, 2 if metric == "f1" else 4, n)
        p = np.where(rng.random(n) < 0.6, y, rng.permutation(y))
    elif metric == "jaccard":
        words = ["so", "happy", "Today", "bad", "day", "yes", "it", "was"]
        y = [" ".join(rng.choice(words, rng.integers(1, 5))) for _ in range(n)]
        p = [" ".join(rng.choice(words, rng.integers(1, 5))) for _ in range(n)]
    else:  # regression: positive values (RMSLE takes logs)
        y = rng.uniform(1, 100, n)
        p = np.abs(y + rng.normal(0, 10, n))
    return one_col(y), one_col(p)


def kaggle_gini(y, p) -> float:
    """The normalized Gini of Kaggle's porto-seguro forum code: cumulative share of positives by prediction."""
    def gini(actual, pred):
        order = np.argsort(-pred, kind="stable")
        cum = np.cumsum(actual[order]) / actual.sum()
        return (cum.sum() - (len(actual) + 1) / 2) / len(actual)
    return gini(y, p) / gini(y, y)


LIBRARY = {  # metric -> its value computed by scikit-learn / scipy (or Kaggle's published formula)
    "accuracy": lambda y, p: metrics.accuracy_score(y, p),
    "f1": lambda y, p: metrics.f1_score(y, p),
    "f1_macro": lambda y, p: metrics.f1_score(y, p, average="macro"),
    "f1_micro": lambda y, p: metrics.f1_score(y, p, average="micro"),
    "qwk": lambda y, p: metrics.cohen_kappa_score(y, p, weights="quadratic"),  # every rating 1-6 occurs
    "roc_auc": lambda y, p: metrics.roc_auc_score(y, p),
    "gini": kaggle_gini,
    "log_loss": lambda y, p: metrics.log_loss(y.argmax(axis=1), p),
    "rmse": lambda y, p: metrics.root_mean_squared_error(y, p),
    "rmsle": lambda y, p: metrics.root_mean_squared_log_error(y, p),
    "mae": lambda y, p: metrics.mean_absolute_error(y, p),
    "medae": lambda y, p: metrics.median_absolute_error(y, p),
    "r2": lambda y, p: metrics.r2_score(y, p),
    "pearson": lambda y, p: stats.pearsonr(y, p).statistic,
    "spearman": lambda y, p: stats.spearmanr(y, p).statistic,
    "jaccard": lambda y, p: metrics.jaccard_score(*word_sets(y, p), average="samples", zero_division=1.0),
}


def word_sets(y, p):
    sets = [[set(t.lower().split()) for t in texts] for texts in (y, p)]
    binarizer = MultiLabelBinarizer().fit(sets[0] + sets[1])
    return binarizer.transform(sets[0]), binarizer.transform(sets[1])


@pytest.mark.parametrize("metric", sorted(LIBRARY))
def test_every_metric_equals_the_librarys_on_random_data(metric):
    truth, pred = random_case(metric, np.random.default_rng(0))
    y, p = (truth.to_numpy(), pred.to_numpy()) if metric == "log_loss" else (truth["target"].to_numpy(),
                                                                            pred["target"].to_numpy())
    expected = LIBRARY[metric](y, p)
    assert 0.05 < abs(expected) < 100  # a real value, not a degenerate 0 or 1
    assert metric_value(metric, truth, pred) == pytest.approx(expected, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize(
    "metric, truth, pred, expected",
    [
        ("smape", [100, 0, 50], [50, 0, 150], 100 * (50 / 75 + 0 + 100 / 100) / 3),  # both 0: that row counts 0
        ("map3", ["a", "b", "c", "d"], ["a b c", "c b", "a b c", "a b c"], (1 + 1 / 2 + 1 / 3 + 0) / 4),
        ("map3", ["a"], ["b a a"], 1 / 2),  # a repeated guess counts once, at its first place
        ("jaccard", ["It was, yes", "bad"], ["it WAS", " "], (1 / 4 + 0) / 2),  # lower case; "was," is not "was"
        ("qwk", [1, 2, 4], [1, 4, 4], 2 / 3),  # ratings 1..4, 3 given by nobody (see below)
        ("gini", [0, 1, 0, 1], [0.1, 0.9, 0.2, 0.8], 1.0),
        ("medae", [1, 2, 3, 4, 5], [1, 2, 13, 4, 0], 0.0),  # |errors| 0, 0, 10, 0, 5: the median is 0
        ("pearson", [1, 2, 3], [5, 5, 5], 0.0),  # a constant prediction: scipy's nan, here 0
        ("log_loss", [0, 1], [0.5, 0.5], np.log(2)),
    ],
)
def test_new_metrics_match_hand_computed_values(metric, truth, pred, expected):
    """The quadratic kappa by hand, over ratings 1..4 (Kaggle's N x N): pairs (1,1) (2,4) (4,4), weights
    (i-j)^2 / 9, observed sum 4/9; E = outer(truth counts (1,1,0,1), prediction counts (1,0,0,2)) / 3, weighted
    sum 12/9; so 1 - 4/12. scikit-learn's default, over the given ratings 1, 2, 4 only, says 0.8."""
    assert metric_value(metric, one_col(truth), one_col(pred)) == pytest.approx(expected, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("metric", sorted(METRICS))
def test_each_metric_rewards_the_better_prediction(metric):
    """The direction: the true answers score the metric's perfect value, a good prediction scores between it and a
    constant one (the importer's baseline), so DSBench's relative score orders them 0 < good < 1."""
    rng = np.random.default_rng(1)
    if metric == "map3":  # guesses: the truth first, second or absent
        truth = one_col(rng.choice(list("abcde"), 200))
        good = one_col([f"{t} x y" if rng.random() < 0.5 else f"x {t}" for t in truth["target"]])
    elif metric == "smape":
        truth, good = random_case("rmse", rng)
    else:
        truth, good = random_case(metric, rng)
    constant = good.copy()
    for col in constant.columns:
        constant[col] = good[col].mean() if METRICS[metric].numeric else good[col].mode().iloc[0]
    perfect, good_value, baseline = (metric_value(metric, truth, pred) for pred in (truth, good, constant))
    assert perfect == pytest.approx(METRICS[metric].perfect, abs=1e-9)
    if METRICS[metric].higher_is_better:
        assert baseline < good_value < perfect
    else:
        assert baseline > good_value > perfect
    assert 0 < relative_score(good_value, baseline, METRICS[metric].perfect) < 1


# ---------------------------------------------------------------- scripted agents, real code


def scripted_replies(task_type: str, metric: str) -> dict:
    """What a competent team writes: three ```python replies that follow the file contract."""
    model = "RandomForestRegressor" if task_type == "regression" else "RandomForestClassifier"
    predict = "model.predict_proba(X)[:, 1]" if metric == "roc_auc" else "model.predict(X)"
    return {
        "data_engineer": """Load, split features from target, save the contract files.
```python
import pandas as pd
train, test = pd.read_csv("train.csv"), pd.read_csv("test.csv")
train.drop(columns=["id", "target"]).to_pickle("X_train.pkl")
train["target"].to_pickle("y_train.pkl")
test.drop(columns=["id"]).to_pickle("X_test.pkl")
print(train.shape, test.shape)
```""",
        "modeler": f"""```python
import pickle
import pandas as pd
from sklearn.ensemble import {model}
model = {model}(n_estimators=50, random_state=0).fit(pd.read_pickle("X_train.pkl"), pd.read_pickle("y_train.pkl"))
pickle.dump(model, open("model.pkl", "wb"))
print("saved")
```""",
        "analyst": f"""```python
import pickle
import pandas as pd
model = pickle.load(open("model.pkl", "rb"))
X = pd.read_pickle("X_test.pkl")
pd.DataFrame({{"id": pd.read_csv("test.csv")["id"], "target": {predict}}}).to_csv("submission.csv", index=False)
print("written")
```""",
    }


def closing(replies: dict) -> dict:
    """Each agent's code reply, then a closing reply without code: under the authors' turn rule (dsbench.yaml)
    a reply without code is what ends an agent's turns."""
    return {name: [code, f"Done: my files are saved ({name})."] for name, code in replies.items()}


def play(env, replies: dict, coach=None, agents=None) -> dict:
    """Drive the env as rollout.run_episode does (observe, step, coach request right after the step). An agent's
    replies: one for every turn, or a list (turn i takes item i, the last one repeated)."""
    scores = {}
    for agent in agents or env.topology.agents:
        for turn in range(agent.max_actions):
            env.observe(agent, turn)
            reply = replies[agent.name]
            reply = reply[min(turn, len(reply) - 1)] if isinstance(reply, list) else reply
            result = env.step(agent, turn, reply)
            if coach is not None:
                request = CoachRequest(
                    episode_id="e", agent=agent.name, turn=turn, role=agent.role, task=env.task_text,
                    task_type=env.task_type, agent_input="", agent_output=reply,
                    feedback=result.feedback.as_text(), ground_truth=env.coach_ground_truth(agent),
                    env_grade=env.judge(agent, reply, result.feedback, None),
                    is_final_agent=agent is env.topology.agents[-1], runs_code=agent.runs_code,
                )  # fmt: skip
                scores[agent.name] = asyncio.run(coach.score(request)).score
            if result.done:
                break
    return scores


@pytest.mark.parametrize("task_id", ["sk-diabetes", "sk-breast-cancer"])
# the settings of dsbench.yaml (the authors') and of dsbench_own_rubric.yaml
@pytest.mark.parametrize("end_turn_on_files, workspace_files", [(False, "stateless"), (True, "persistent")])
def test_scripted_team_passes_all_three_stages(pack, tmp_path, task_id, end_turn_on_files, workspace_files):
    task = pack[task_id]
    topology = recipe(end_turn_on_files=end_turn_on_files, workspace_files=workspace_files)
    env = topology.make_env(task, str(tmp_path / "ws"))
    task_files = ["test.csv", "train.csv"] if workspace_files == "stateless" else sorted(PUBLIC_FILES)
    assert sorted(os.listdir(tmp_path / "ws")) == task_files
    meta = json.load(open(os.path.join(task["answer"], "task.json")))
    scores = play(env, closing(scripted_replies(task["type"], meta["metric"])), HeuristicCoach())
    out = env.outcome()
    assert out["success"] and out["status"] == "ok", out
    assert out["relative_score"] > 0 and out["missing_files"] == {}
    assert out["task_type"] == task["type"] == env.task_type
    assert out["metric_name"] == meta["metric"] and out["baseline"] == meta["baseline"]
    # the authors' rule (dsbench.yaml): each agent's closing reply without code ended its turns; with
    # end_turn_on_files every agent was done as soon as its files existed
    per_agent = 1 if end_turn_on_files else 2
    agents = ("data_engineer", "modeler", "analyst")
    assert [h.agent for h in env.history] == [a for a in agents for _ in range(per_agent)]
    assert "test_answer.csv" not in str(sorted(os.listdir(tmp_path / "ws")))  # hidden answers stay hidden
    assert min(scores.values()) >= 7.0, scores
    # the hand-offs are pickles, which the authors' stateless sandbox carries from agent to agent
    assert sorted(os.listdir(tmp_path / "ws")) == sorted(task_files + [*env.contract["data_engineer"], "model.pkl",
                                                                       "submission.csv"])


# A code run that writes what agents' code does: a CSV, a text file, a directory (catboost writes one), each kind the
# authors' workflow carries, and it overwrites train.csv and deletes test.csv.
LISTING = 'import os\nprint(sorted(f for f in os.listdir() if not f.startswith("_mappa_code_")))  # (the code itself)'
WRITES = f"""```python
{LISTING}
os.mkdir("catboost_info")
open("catboost_info/log.txt", "w").write("x")
for name in ("features.csv", "notes.txt", "X.pkl", "scaler.joblib", "a.npy", "b.npz", "submission.csv",
             "predictions.csv"):
    open(name, "w").write("x")
open("train.csv", "w").write("overwritten")
os.remove("test.csv")
{LISTING}
```"""
WRITTEN = ["X.pkl", "a.npy", "b.npz", "catboost_info", "features.csv", "notes.txt", "predictions.csv", "scaler.joblib",
           "submission.csv"]
ARTIFACT_FILES = ["X.pkl", "a.npy", "b.npz", "scaler.joblib"]  # what the Data Engineer's run carries


@pytest.mark.parametrize("workspace_files", ["stateless", "persistent"])
def test_what_the_next_code_run_finds(pack, tmp_path, workspace_files):
    """stateless (dsbench.yaml): the authors' SandboxFusion starts every code run from the uploaded train.csv and
    test.csv and the files their workflow fetched after earlier runs (after the Data Engineer's: pickles, joblib
    and numpy files, not its CSVs); persistent (ours before) keeps what a run left, and sample_submission.csv."""
    task = pack["sk-diabetes"]
    topology = load_topology(str(DSBENCH_YAML))
    topology.env_kwargs = dict(topology.env_kwargs, workspace_files=workspace_files)
    ws, (engineer, modeler, _) = tmp_path / "ws", topology.agents
    env = topology.make_env(task, str(ws))
    start = ["test.csv", "train.csv"] if workspace_files == "stateless" else sorted(PUBLIC_FILES)
    assert sorted(os.listdir(ws)) == start
    result = env.step(engineer, 0, WRITES)
    assert result.feedback.stdout == f"{start}\n{sorted(set(start + WRITTEN) - {'test.csv'})}\n"  # saw all it wrote
    look = env.step(modeler, 0, f"```python\n{LISTING}\n```")
    if workspace_files == "stateless":
        assert look.feedback.stdout == f"{sorted(ARTIFACT_FILES + ['test.csv', 'train.csv'])}\n"
        for name in ("train.csv", "test.csv"):  # restored as the task gives them
            assert (ws / name).read_bytes() == (Path(task["answer"]) / name).read_bytes()
    else:
        assert look.feedback.stdout == f"{sorted(set(start + WRITTEN) - {'test.csv'})}\n"
        assert (ws / "train.csv").read_text() == "overwritten"


def test_each_agents_runs_carry_its_kinds_and_a_deleted_file_comes_back(pack, tmp_path):
    """dsbench.yaml's stateless workspace carries what the authors fetched after each agent's runs: the Data
    Engineer's and Modeler's *.pkl/*.joblib/*.npy/*.npz, the Analyst's submission.csv/predictions.csv
    (dsbench_workflow.py L488-493, L658-663, L863-866). Fetched files stay on their host and are uploaded for
    every run, so a kept file a run deletes or changes is back as kept at the next run."""
    topology = load_topology(str(DSBENCH_YAML))
    ws, (engineer, modeler, analyst) = tmp_path / "ws", topology.agents
    env = topology.make_env(pack["sk-diabetes"], str(ws))
    run = "```python\nimport os\n{}\n" + LISTING + "\n```"
    env.step(engineer, 0, run.format('open("X.pkl", "w").write("features")'))
    look = env.step(modeler, 0, run.format('open("model.pkl", "w").write("model")\n'
                                           'open("submission.csv", "w").write("id,y")\nos.remove("X.pkl")'))
    assert look.feedback.stdout == "['model.pkl', 'submission.csv', 'test.csv', 'train.csv']\n"
    assert sorted(os.listdir(ws)) == ["X.pkl", "model.pkl", "test.csv", "train.csv"]  # its CSV gone, X.pkl back
    assert (ws / "X.pkl").read_text() == "features"
    look = env.step(analyst, 0, run.format('open("submission.csv", "w").write("id,y")\n'
                                           'open("analyst.pkl", "w").write("x")\nos.remove("model.pkl")\n'
                                           'open("X.pkl", "w").write("changed")'))
    assert look.feedback.stdout == "['X.pkl', 'analyst.pkl', 'submission.csv', 'test.csv', 'train.csv']\n"
    assert sorted(os.listdir(ws)) == ["X.pkl", "model.pkl", "submission.csv", "test.csv", "train.csv"]
    assert [(ws / f).read_text() for f in ("X.pkl", "model.pkl", "submission.csv")] == ["features", "model", "id,y"]
    env.step(analyst, 1, run.format('os.remove("submission.csv")'))
    assert (ws / "submission.csv").read_text() == "id,y"  # its own kept file too
    # the store is beside the workspace, where the sandbox does not see it
    assert sorted(os.listdir(f"{ws}.kept")) == ["X.pkl", "model.pkl", "submission.csv"]


def test_missing_upstream_artifact_is_blamed_upstream(pack, tmp_path):
    """The Data Engineer forgets X_test.pkl: its score drops; the Analyst, who crashes on the missing
    file, is not punished for it (the plain tool rule would have given a failed run 2)."""
    task = pack["sk-diabetes"]
    topology = recipe()
    good = scripted_replies("regression", "rmse")
    bad = dict(good, data_engineer=good["data_engineer"].replace('test.drop(columns=["id"]).to_pickle("X_test.pkl")', ""))
    coach = HeuristicCoach()
    ok_scores = play(topology.make_env(task, str(tmp_path / "ok")), closing(good), coach, agents=topology.agents[:1])
    bad_env = topology.make_env(task, str(tmp_path / "bad"))
    bad_scores = play(bad_env, closing(bad), coach)
    crash = next(h.feedback for h in bad_env.history if h.agent == "analyst")  # its code, before its closing reply
    assert "FileNotFoundError" in crash and "X_test.pkl" in crash
    assert bad_scores["data_engineer"] < ok_scores["data_engineer"] - 3
    assert bad_scores["data_engineer"] < bad_scores["analyst"]
    assert bad_scores["analyst"] >= 5.0 and bad_scores["modeler"] >= 7.0  # it needs only X_train/y_train
    out = bad_env.outcome()
    assert not out["success"] and out["status"] == "missing_file"
    assert out["missing_files"] == {"data_engineer": ["X_test.pkl"], "analyst": ["submission.csv"]}
    # each agent's code, then its closing reply without code (the authors' turn rule)
    assert [h.agent for h in bad_env.history] == ["data_engineer"] * 2 + ["modeler"] * 2 + ["analyst"] * 2


def test_a_turn_ends_on_a_reply_without_code_not_when_the_files_exist(pack, tmp_path):
    """dsbench.yaml's turn rule is the authors' (their step ends a turn on a reply without a tool call): an agent
    whose code saved its files keeps its turn until it replies without code or has taken max_actions.
    end_turn_on_files (dsbench_own_rubric.yaml) ends it as soon as the files exist."""
    good = scripted_replies("regression", "rmse")
    engineer = load_topology(str(DSBENCH_YAML)).agents[0]
    authors = load_topology(str(DSBENCH_YAML)).make_env(pack["sk-diabetes"], str(tmp_path / "a"))
    assert authors.step(engineer, 0, good["data_engineer"]).done is False  # files saved, the turn goes on
    assert not authors.missing(authors.contract["data_engineer"])
    assert authors.step(engineer, 1, "```python\nprint('checked')\n```").done is False
    assert authors.step(engineer, 2, "All three files are saved.").done is True
    own = load_topology(str(OWN_RUBRIC_YAML)).make_env(pack["sk-diabetes"], str(tmp_path / "b"))
    assert own.end_turn_on_files and own.step(engineer, 0, good["data_engineer"]).done is True


def engineer_after_a_failed_try(topology_path, pack, tmp_path):
    """An episode whose Data Engineer's first code failed: it sees that action and its error as chat turns."""
    topology = load_topology(str(topology_path))
    env = topology.make_env(pack["sk-diabetes"], str(tmp_path / "ws"))
    failing = "```python\nimport pandas as pd\npd.read_csv('nope.csv')\n```"
    assert not env.step(topology.agents[0], 0, failing).done
    second_look = env.observe(topology.agents[0], 1)
    assert [m["role"] for m in second_look] == ["user", "assistant", "user"] and second_look[1]["content"] == failing
    assert "FileNotFoundError" in second_look[2]["content"]  # its own code's output
    return env, topology.agents, scripted_replies("regression", "rmse")


def test_each_agent_sees_the_final_reply_of_the_agents_before_it(pack, tmp_path):
    """dsbench.yaml's views (the authors'): an agent sees the task, its own earlier actions as chat turns,
    and each earlier agent's final reply, its closing reply without code, reasoning removed."""
    env, (engineer, modeler, analyst), good = engineer_after_a_failed_try(DSBENCH_YAML, pack, tmp_path)
    assert not env.step(engineer, 1, good["data_engineer"]).done
    last = "<think>I should drop the id column.</think>Saved X_train.pkl, y_train.pkl, X_test.pkl."
    assert env.step(engineer, 2, last).done

    (modeler_input,) = [m["content"] for m in env.observe(modeler, 0)]
    assert "### data_engineer (action 3)\nSaved X_train.pkl, y_train.pkl, X_test.pkl." in modeler_input
    assert "Output of the code" not in modeler_input and "Load, split features" not in modeler_input  # earlier tries
    assert "drop the id column" not in modeler_input and "nope.csv" not in modeler_input  # reasoning, earlier tries
    assert not env.step(modeler, 0, good["modeler"]).done and env.step(modeler, 1, "model.pkl is saved.").done
    (analyst_input,) = [m["content"] for m in env.observe(analyst, 0)]
    assert "### data_engineer (action 3)" in analyst_input
    assert "### modeler (action 2)\nmodel.pkl is saved." in analyst_input
    assert "nope.csv" not in analyst_input


def test_own_rubric_hand_offs_show_the_code_output(pack, tmp_path):
    """dsbench_own_rubric.yaml (this project's earlier default): an agent's turns end once its files exist, so
    the next agent sees that final code reply with what it printed."""
    env, (engineer, modeler, analyst), good = engineer_after_a_failed_try(OWN_RUBRIC_YAML, pack, tmp_path)
    assert env.step(engineer, 1, "<think>I should drop the id column.</think>" + good["data_engineer"]).done

    (modeler_input,) = [m["content"] for m in env.observe(modeler, 0)]
    assert "### data_engineer (action 2)\nLoad, split features" in modeler_input
    assert "#### Output of the code\nstdout:\n(" in modeler_input  # what its code printed (the shapes)
    assert "drop the id column" not in modeler_input and "nope.csv" not in modeler_input  # reasoning, earlier tries
    assert env.step(modeler, 0, good["modeler"]).done
    (analyst_input,) = [m["content"] for m in env.observe(analyst, 0)]
    assert "### data_engineer (action 2)" in analyst_input and "### modeler (action 1)" in analyst_input
    assert "nope.csv" not in analyst_input


def test_coach_ground_truth_never_carries_the_answers(pack, tmp_path):
    task = pack["sk-wine"]
    truth = pd.read_csv(os.path.join(task["answer"], "answers", "test_answer.csv"))
    texts = {}
    for evidence in ("ours", "authors"):
        topology = recipe(coach_evidence=evidence)
        env = topology.make_env(task, str(tmp_path / evidence))
        truth.to_csv(tmp_path / evidence / "submission.csv", index=False)
        texts[evidence] = text = env.coach_ground_truth(topology.agents[-1])
        assert task["answer"] not in text and not any(f"\n{i},{t}\n" in text for i, t in truth.to_numpy()[:5])
    text = texts["ours"]
    assert "Submission check: valid; accuracy = 1" in text and "relative score 1.000" in text
    assert "Missing outputs (this agent's own files): none" in text
    assert "Missing inputs (files earlier agents had to save): X_train.pkl, y_train.pkl, X_test.pkl, model.pkl" in text
    assert "Submission figures: accuracy = 1\n" in text + "\n"  # what the authors' caps read, beside the metric
    assert "  - Accuracy: 1.0000 (higher is better, at most 1)" in texts["authors"]


def test_regression_figures_are_what_the_authors_caps_read(pack, tmp_path):
    """The Analyst's coach sees RMSE, MAE and RMSE as a share of the true target's range and IQR (the authors'
    ground_truth_utils.py), computed here by hand: every prediction 10 too high gives RMSE = MAE = 10."""
    task = pack["sk-diabetes"]
    topology = recipe(coach_evidence="ours")
    env = topology.make_env(task, str(tmp_path / "ws"))
    truth = pd.read_csv(os.path.join(task["answer"], "answers", "test_answer.csv"))
    truth.assign(target=truth["target"] + 10).to_csv(tmp_path / "ws" / "submission.csv", index=False)
    figures = env.submission_check()["figures"]
    y = truth["target"].to_numpy(dtype=float)
    q75, q25 = np.percentile(y, [75, 25])
    assert figures == pytest.approx({"rmse": 10.0, "mae": 10.0, "rmse_pct_of_range": 1000 / (y.max() - y.min()),
                                     "rmse_pct_of_iqr": 1000 / (q75 - q25)})
    text = env.coach_ground_truth(topology.agents[-1])
    assert f"rmse_pct_of_range = {1000 / (y.max() - y.min()):.4g}" in text and task["answer"] not in text


# ---------------------------------------------------------------- the authors' coach evidence


def files_lines(title: str, names: list) -> str:
    return "\n".join([title, *(f"  - {n}" for n in names)])


@pytest.mark.parametrize("task_id", ["sk-diabetes", "sk-breast-cancer"])
def test_the_recipe_shows_the_coach_the_authors_evidence(pack, tmp_path, task_id):
    """dsbench.yaml (coach_evidence: authors), a scripted team: each action's coach is shown the files there when
    its agent's turn began (not those its own action wrote), what each earlier agent saved, and for the Analyst the
    raw figures of its submission against the answers (dsbench_workflow.py, ground_truth_utils.py), computed here
    with scikit-learn: RMSE, MAE, MSE and the target's statistics, or accuracy, F1 and ROC-AUC."""
    task = pack[task_id]
    topology = load_topology(str(DSBENCH_YAML))
    env = topology.make_env(task, str(tmp_path / "ws"))
    meta = json.load(open(os.path.join(task["answer"], "task.json")))
    evidence = {}
    for agent, replies in zip(topology.agents, closing(scripted_replies(task["type"], meta["metric"])).values()):
        for turn, reply in enumerate(replies):
            env.step(agent, turn, reply)
            evidence.setdefault(agent.name, []).append(env.coach_ground_truth(agent))
    start, engineer = ["test.csv", "train.csv"], ["X_test.pkl", "X_train.pkl", "y_train.pkl"]
    first = files_lines("Files available to this agent when its turn began:", start)
    assert evidence["data_engineer"] == [f"{first}\nFiles saved by earlier agents:\n  (the first agent: no earlier "
                                         "files)\nFigures computed against the hidden answers:\nN/A"] * 2
    modeler = files_lines("Files available to this agent when its turn began:", sorted(start + engineer))
    assert evidence["modeler"] == [f"{modeler}\nFiles saved by earlier agents:\n  data_engineer saved: "
                                   f"{', '.join(engineer)}\nFigures computed against the hidden answers:\nN/A"] * 2
    analyst = files_lines("Files available to this agent when its turn began:", sorted(start + engineer + ["model.pkl"]))
    head = (f"{analyst}\nFiles saved by earlier agents:\n  data_engineer saved: {', '.join(engineer)}\n  modeler "
            f"saved: model.pkl\nFigures computed against the hidden answers:\nData type: {task['type']}\nTask metric: "
            f"{meta['metric']}\nNumber of predictions: ")
    y = pd.read_csv(os.path.join(task["answer"], "answers", "test_answer.csv"))["target"].to_numpy()
    p = pd.read_csv(tmp_path / "ws" / "submission.csv")["target"].to_numpy()
    if task["type"] == "regression":
        rmse, q25, median, q75 = metrics.root_mean_squared_error(y, p), *np.percentile(y, [25, 50, 75])
        figures = [f"  - RMSE: {rmse:.4f} (lower is better)",
                   f"  - MAE: {metrics.mean_absolute_error(y, p):.4f} (lower is better)",
                   f"  - MSE: {metrics.mean_squared_error(y, p):.4f} (lower is better)",
                   "Target statistics (to read the RMSE by):",
                   f"  - range: {y.min():.2f} to {y.max():.2f} (range {np.ptp(y):.2f})",
                   f"  - quartiles: Q25 {q25:.2f}, median {median:.2f}, Q75 {q75:.2f}",
                   f"  - mean {y.mean():.2f}, std {y.std():.2f}", f"  - RMSE as % of range: {100 * rmse / np.ptp(y):.1f}%",
                   f"  - RMSE as % of IQR: {100 * rmse / (q75 - q25):.1f}%"]
    else:
        rounded, better = np.round(p).astype(int), "(higher is better, at most 1)"
        figures = [f"  - Accuracy: {metrics.accuracy_score(y, rounded):.4f} {better}",
                   f"  - F1: {metrics.f1_score(y, rounded):.4f} {better}",
                   f"  - ROC-AUC: {metrics.roc_auc_score(y, p):.4f} {better}"]
    shown = "\n".join(figures)
    assert evidence["analyst"][-1] == f"{head}{len(p)}\nComputed metrics:\n{shown}"
    assert evidence["analyst"][0] == evidence["analyst"][-1]  # the submission its code wrote, read after the action


def test_the_authors_evidence_when_the_analyst_has_nothing(pack, tmp_path):
    """An Analyst whose earlier agents saved nothing: the authors' warning naming the missing critical files, and
    their error line for a missing submission."""
    topology = load_topology(str(DSBENCH_YAML))
    env = topology.make_env(pack["sk-wine"], str(tmp_path / "ws"))
    for agent in topology.agents:
        env.step(agent, 0, "I will not write code.")
    assert env.coach_ground_truth(topology.agents[-1]) == (
        "Files available to this agent when its turn began:\n  - test.csv\n  - train.csv\n  Warning: critical files "
        "missing: X_test.pkl (the preprocessed test features); model.pkl (the trained model)\nFiles saved by earlier "
        "agents:\n  data_engineer saved: no files\n  modeler saved: no files\nFigures computed against the hidden "
        "answers:\nERROR: no predictions found (no readable submission.csv or predictions.csv with 2 columns)")


def test_the_authors_figures_are_scikit_learns_on_random_data():
    """authors_figures against scikit-learn and numpy: rows paired in file order over the shorter column, "true" /
    "false" and what is no number read as theirs read them, weighted F1 over more than two classes."""
    rng = np.random.default_rng(0)
    y = pd.Series(rng.uniform(0, 50, 40))
    p = pd.Series(rng.uniform(0, 50, 45))  # 5 rows more: left out
    got = authors_figures(y, p, "regression")
    q = p[:40].to_numpy()
    assert got["rmse"] == pytest.approx(metrics.root_mean_squared_error(y, q))
    assert got["mse"] == pytest.approx(metrics.mean_squared_error(y, q))
    assert got["mae"] == pytest.approx(metrics.mean_absolute_error(y, q))
    assert got["target_iqr"] == pytest.approx(stats.iqr(y)) and got["target_std"] == pytest.approx(np.std(y))
    assert got["rmse_pct_of_range"] == pytest.approx(100 * got["rmse"] / np.ptp(y))
    labels = pd.Series(rng.integers(0, 2, 30))
    probs = pd.Series(rng.uniform(0, 1, 30))
    got = authors_figures(labels, probs, "classification")
    rounded = np.round(probs).astype(int)
    assert got == pytest.approx({"accuracy": metrics.accuracy_score(labels, rounded),
                                 "f1": metrics.f1_score(labels, rounded), "roc_auc": metrics.roc_auc_score(labels, probs)})
    words = pd.Series(["true", "False", "x", 1] * 5)  # 1, 0, 0 (no number), 1
    assert authors_figures(pd.Series([1, 0, 1, 1] * 5), words, "classification")["accuracy"] == 0.75
    three, guess = pd.Series(rng.integers(0, 3, 30)), pd.Series(rng.integers(0, 3, 30)).astype(float)
    got = authors_figures(three, guess, "classification")
    assert got == pytest.approx({"accuracy": metrics.accuracy_score(three, guess),
                                 "f1": metrics.f1_score(three, guess, average="weighted")})  # no ROC-AUC: 3 classes


# ---------------------------------------------------------------- bad inputs


def write_sub(path, df):
    df.to_csv(path, index=False)
    return str(path)


@pytest.fixture
def diabetes(pack):
    task_dir = pack["sk-diabetes"]["answer"]
    return task_dir, pd.read_csv(os.path.join(task_dir, "answers", "test_answer.csv"))


def test_perfect_submission_scores_perfectly(diabetes, tmp_path):
    task_dir, truth = diabetes
    result = score_submission(task_dir, write_sub(tmp_path / "s.csv", truth.iloc[::-1]))  # row order is free
    assert result["valid"] and result["metric"] == pytest.approx(0.0) and result["relative_score"] > 1


@pytest.mark.parametrize(
    "mutate, status",
    [
        (lambda t: t.rename(columns={"target": "y"}), "wrong_columns"),
        (lambda t: t.assign(extra=1), "wrong_columns"),
        (lambda t: t.iloc[:-1], "wrong_row_count"),
        (lambda t: t.assign(id=t["id"] + 1), "wrong_ids"),
        (lambda t: t.assign(id=np.where(t.index == 0, np.nan, t["id"])), "wrong_ids"),  # an empty id
        (lambda t: t.assign(target=np.where(t.index == 3, np.nan, t["target"])), "missing_values"),
        (lambda t: t.assign(target="high"), "non_numeric"),
        (lambda t: t.assign(target=np.inf), "non_numeric"),
    ],
)
def test_bad_submissions_get_a_clear_status(diabetes, tmp_path, mutate, status):
    task_dir, truth = diabetes
    result = score_submission(task_dir, write_sub(tmp_path / "s.csv", mutate(truth)))
    assert not result["valid"] and result["status"] == status and result["error"], result


def test_missing_or_unreadable_submission(diabetes, tmp_path):
    task_dir, _ = diabetes
    assert score_submission(task_dir, str(tmp_path / "none.csv"))["status"] == "missing_file"
    (tmp_path / "empty.csv").write_text("")
    assert score_submission(task_dir, str(tmp_path / "empty.csv"))["status"] == "unreadable"
    (tmp_path / "bin.csv").write_bytes(b"\xff\xfe\x00garbage\x00")
    assert score_submission(task_dir, str(tmp_path / "bin.csv"))["status"] in ("unreadable", "wrong_columns")


def test_broken_task_dir_is_an_outcome_status_not_a_crash(pack, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(pack["sk-iris"]["answer"], broken)
    os.remove(broken / "answers" / "test_answer.csv")
    task = dict(pack["sk-iris"], answer=str(broken))
    topology = load_topology(str(DSBENCH_YAML))
    errors = []
    for task_dir in (str(broken), str(tmp_path / "nowhere")):
        env = topology.make_env(dict(task, answer=task_dir), str(tmp_path / "ws"))
        play(env, {a.name: "no code" for a in topology.agents}, HeuristicCoach())
        out = env.outcome()
        assert out["success"] is False and out["status"] == "broken_task", out
        assert out["task_type"] == "classification"
        errors.append(out["error"])
    assert errors[0] == f"{broken}: missing file(s) ['answers/test_answer.csv']"
    assert errors[1].startswith(f"{tmp_path / 'nowhere'}: not a DSBench task directory (task.json: ")
    with pytest.raises(ValueError, match="not a DSBench task directory"):
        score_submission(str(tmp_path / "nowhere"), "x.csv")


# ---------------------------------------------------------------- importer and CLI


def fake_dsbench(root: Path, task_id="toy-task", with_answers=True, prompt="Evaluation\nScored by MAE."):
    """A tiny copy of the official layout, metadata paths written as in mappa-bench's files."""
    data = root / "data_resplit" / task_id
    data.mkdir(parents=True)
    pd.DataFrame({"PassengerId": [1, 2, 3, 4], "x": [1, 2, 3, 4], "Fare": [10.0, 20.0, 30.0, 40.0]}).to_csv(data / "train.csv", index=False)
    pd.DataFrame({"PassengerId": [5, 6], "x": [5, 6]}).to_csv(data / "test.csv", index=False)
    pd.DataFrame({"PassengerId": [5, 6], "Fare": [0, 0]}).to_csv(data / "sample_submission.csv", index=False)
    if with_answers:
        (root / "answers" / task_id).mkdir(parents=True)
        pd.DataFrame({"PassengerId": [5, 6], "Fare": [50.0, 70.0]}).to_csv(root / "answers" / task_id / "test_answer.csv", index=False)
    base = f"./data/DSBench/data/data_resplit/{task_id}"
    return {"prompt": prompt, "answer": None, "metadata": {
        "task_id": task_id, "task_type": "data_modeling", "data_type": "regression",
        "train_file": f"{base}/train.csv", "test_file": f"{base}/test.csv",
        "answer_dir": f"./data/DSBench/data/answers/{task_id}", "url": "https://example.org"}}  # fmt: skip


def test_importer_reads_the_official_layout_and_names_what_is_missing(tmp_path):
    root = tmp_path / "DSBench"
    rows = [fake_dsbench(root), fake_dsbench(root, "no-answers", with_answers=False),
            fake_dsbench(root, "kappa", prompt="Evaluation\nSubmissions are scored on Cohen's kappa.")]  # fmt: skip
    (tmp_path / "meta.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks, skipped = import_tasks(str(root), str(tmp_path / "meta.json"), str(tmp_path / "out"))
    assert [t["id"] for t in tasks] == ["toy-task"]
    assert len(skipped) == 2
    assert skipped[0].startswith("no-answers: missing file(s): ") and "answers/no-answers/test_answer.csv" in skipped[0]
    assert skipped[1].startswith("kappa: metric not supported (read from 'kappa')")
    meta = json.load(open(tmp_path / "out" / "toy-task" / "task.json"))
    # MAE read from the prompt; baseline: the training mean 25 predicted for 50 and 70 -> MAE 35; best: perfect 0
    assert meta["metric"] == "mae" and meta["baseline"] == pytest.approx(35.0) and meta["best"] == 0.0
    assert meta["id_column"] == "PassengerId" and meta["target_columns"] == ["Fare"]
    assert load_tasks(str(tmp_path / "out" / "tasks.jsonl"))[0]["answer"] == str(tmp_path / "out" / "toy-task")
    sub = write_sub(tmp_path / "s.csv", pd.DataFrame({"PassengerId": [6, 5], "Fare": [60.0, 50.0]}))
    result = score_submission(tasks[0]["answer"], sub)
    assert result["metric"] == pytest.approx(5.0) and result["relative_score"] == pytest.approx(30 / 35)


RAW = "Description\nA long Kaggle page: prizes, a forum link.\n\nEvaluation\nScored by MAE."
SUFFIX = "\n\nPlease reason step by step, and put your final answer within \\boxed{}."  # dsbench.yaml's, the authors'


def first_prompts(task: dict, tmp_path) -> tuple:
    """(the Data Engineer's first prompt, the coach's prompt) of a task under dsbench.yaml, both rendered."""
    topology = load_topology(str(DSBENCH_YAML))
    env = topology.make_env(task, str(tmp_path / "ws"))
    coach = render_prompt(topology.coach_template, CoachRequest("e", "data_engineer", 0, "r", env.task_text, "", "",
                                                                "", ""))
    return env.observe(topology.agents[0], 0)[-1]["content"], coach


def test_import_gives_the_agents_the_authors_cleaned_text(tmp_path):
    """`mappa dsbench import` by default reads the authors' cleaned texts beside --metadata: the agents' {task} is
    the cleaned text (braces kept as written), the coach's the task's own text and the authors' default suffix
    (their coach's {problem}), which the agents never see; a task the file lacks keeps its own text for the agents
    too, as theirs does, and is named. --task-text raw writes the rows of before (the raw text for both)."""
    root = tmp_path / "DSBench"
    rows = [fake_dsbench(root, prompt=RAW), fake_dsbench(root, "not-cleaned", prompt=RAW)]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "meta.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cleaned = "Task: predict the fare.\nEvaluation: MAE, lower is better.\nFormat: {PassengerId, Fare}"
    (tmp_path / "data" / "dsbench_modeling_cleaned_prompts.json").write_text(json.dumps(
        {"toy-task": {"cleaned_prompt": cleaned, "metric": "mae"}, "unused-task": {"cleaned_prompt": "x"}}))
    run = [MAPPA, "dsbench", "import", "--data-root", str(root), "--metadata", str(tmp_path / "data" / "meta.json")]
    proc = subprocess.run([*run, "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "not in the cleaned prompts, the agents see DSBench's text: not-cleaned\n"
    tasks = {t["id"]: t for t in load_tasks(str(tmp_path / "out" / "tasks.jsonl"))}
    agent, coach = first_prompts(tasks["toy-task"], tmp_path / "a")
    assert f"Task:\n{cleaned}\n\nThe working directory" in agent and RAW not in agent
    assert f"The task the team is solving:\n{RAW}{SUFFIX}\n" in coach and cleaned not in coach
    assert SUFFIX.strip() not in agent
    agent, coach = first_prompts(tasks["not-cleaned"], tmp_path / "b")
    assert f"Task:\n{RAW}\n\nThe working directory" in agent and f"{RAW}{SUFFIX}\n" in coach
    assert SUFFIX.strip() not in agent

    proc = subprocess.run([*run, "--out", str(tmp_path / "raw"), "--task-text", "raw"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    raw = load_tasks(str(tmp_path / "raw" / "tasks.jsonl"))
    before, _ = import_tasks(str(root), str(tmp_path / "data" / "meta.json"), str(tmp_path / "before"))
    assert [dict(t, answer=None) for t in raw] == [dict(t, answer=None) for t in before]
    agent, coach = first_prompts(raw[0], tmp_path / "c")
    assert f"Task:\n{RAW}\n\nThe working directory" in agent and RAW in coach


needs_bench = pytest.mark.skipif(not (BENCH / "dsbench_modeling_eval.json").exists(),
                                 reason=f"mappa-bench data not found under {BENCH}")


@needs_bench
def test_importer_on_the_real_metadata_names_the_missing_data(tmp_path):
    """The real metadata without the DSBench CSVs (users download those): every task is skipped, each
    with the file it lacks, and nothing crashes."""
    tasks, skipped = import_tasks(str(tmp_path), str(BENCH / "dsbench_modeling_eval.json"), str(tmp_path / "out"))
    assert tasks == [] and len(skipped) == 8
    assert all("missing file(s): " + str(tmp_path / "data_resplit") in s for s in skipped)


# The authors' 72 tasks (mappa-bench's metadata) over tiny synthetic CSVs in DSBench's layout (the real CSVs are
# DSBench's download). The answers are of each task's kind: class names where DSBench's are, whatever its
# metadata's data_type says (3 of them say regression).
TEXT_ANSWERS = {
    "tabular-playground-series-feb-2022": ["Streptococcus_pneumoniae", "Enterococcus_hirae", "Escherichia_coli"],
    "playground-series-s4e6": ["Graduate", "Dropout", "Enrolled"],
    "playground-series-s4e2": ["Normal_Weight", "Obesity_Type_I", "Insufficient_Weight"],
    "playground-series-s3e22": ["lived", "died", "euthanized"],
    "playground-series-s3e13": ["Dengue", "Malaria", "Lyme_disease"],
    "tweet-sentiment-extraction": ["so happy today", "bad", "it was, yes"],
}
RATINGS = {"playground-series-s3e5", "learning-agency-lab-automated-essay-scoring-2", "liverpool-ion-switching"}
ONE_HOT = {"lmsys-chatbot-arena": ["winner_model_a", "winner_model_b", "winner_tie"]}
STRING_LABEL_TASKS = ["tabular-playground-series-feb-2022", "playground-series-s4e6", "playground-series-s4e2"]


def synthetic_answers(task_id: str, data_type: str, n: int, rng) -> pd.DataFrame:
    if task_id in ONE_HOT:
        return pd.DataFrame(np.eye(3, dtype=int)[rng.integers(0, 3, n)], columns=ONE_HOT[task_id])
    if task_id in TEXT_ANSWERS:
        values = rng.choice(TEXT_ANSWERS[task_id], n)
    elif task_id in RATINGS:
        values = rng.integers(1, 7, n)
    elif data_type == "classification":
        values = rng.integers(0, 2, n)
    else:
        values = rng.uniform(1, 100, n).round(3)
    return pd.DataFrame({"target": values})


def authors_layout(root: Path) -> dict:
    """DSBench's layout under root for every row of the authors' two metadata files, 20 training and 10 test
    rows a task; returns {"train" | "eval": the metadata file}. tests/test_fidelity.py counts what imports."""
    rng = np.random.default_rng(0)
    metadata = {split: BENCH / f"dsbench_modeling_{split}.json" for split in ("train", "eval")}
    for path in metadata.values():
        for line in path.read_text(encoding="utf-8").splitlines():
            meta = json.loads(line)["metadata"]
            answers = synthetic_answers(meta["task_id"], meta["data_type"], 30, rng)
            rows = pd.concat([pd.DataFrame({"id": np.arange(30), "x": rng.normal(size=30)}), answers], axis=1)
            data, answer_dir = root / "data_resplit" / meta["task_id"], root / "answers" / meta["task_id"]
            data.mkdir(parents=True)
            answer_dir.mkdir(parents=True)
            rows.iloc[:20].to_csv(data / "train.csv", index=False)
            test = rows.iloc[20:]
            test[["id", "x"]].to_csv(data / "test.csv", index=False)
            test[["id", *answers.columns]].to_csv(answer_dir / "test_answer.csv", index=False)
            test[["id", *answers.columns]].assign(**{c: 0 for c in answers.columns}).to_csv(
                data / "sample_submission.csv", index=False)
    return metadata


@pytest.fixture(scope="module")
def authors_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("DSBench")
    return root, authors_layout(root)


# The 16 the importer skipped before (metric not implemented, or not found in the description).
NEWLY_SCORED = {
    "porto-seguro-safe-driver-prediction": "gini", "playground-series-s3e5": "qwk",
    "tabular-playground-series-jan-2022": "smape", "us-patent-phrase-to-phrase-matching": "pearson",
    "playground-series-s3e13": "map3", "demand-forecasting-kernels-only": "smape",
    "google-quest-challenge": "spearman", "learning-agency-lab-automated-essay-scoring-2": "qwk",
    "nlp-getting-started": "f1", "playground-series-s3e22": "f1_micro", "playground-series-s3e19": "smape",
    "tabular-playground-series-sep-2022": "smape", "tweet-sentiment-extraction": "jaccard",
    "playground-series-s3e10": "log_loss", "lmsys-chatbot-arena": "log_loss", "playground-series-s3e25": "medae",
}


@needs_bench
def test_every_task_of_the_authors_imports_and_scores(authors_data, tmp_path):
    """All 64 training and 8 eval tasks of the authors' metadata import, none skipped, each with the metric its
    description names; their answers, submitted, are valid and score that metric's perfect value."""
    root, metadata = authors_data
    tasks = {}
    for split, path in metadata.items():
        tasks[split], skipped = import_tasks(str(root), str(path), str(tmp_path / split))
        assert skipped == []
    assert len(tasks["train"]) == 64 and len(tasks["eval"]) == 8
    metric_of = {}
    for task in tasks["train"] + tasks["eval"]:
        meta = json.load(open(os.path.join(task["answer"], "task.json")))
        metric_of[task["id"]] = meta["metric"]
        result = score_submission(task["answer"], os.path.join(task["answer"], "answers", "test_answer.csv"))
        assert result["valid"] and result["task_type"] == task["type"] == meta["data_type"], result
        assert result["metric"] == pytest.approx(METRICS[meta["metric"]].perfect, abs=1e-9), task["id"]
    assert {t: metric_of[t] for t in NEWLY_SCORED} == NEWLY_SCORED
    assert metric_of["titanic"] == "accuracy" and metric_of["bike-sharing-demand"] == "rmsle"
    assert metric_of["microsoft-malware-prediction"] == "roc_auc"
    assert metric_of["liverpool-ion-switching"] == "f1_macro"


@pytest.mark.parametrize(
    "values, expected",
    [
        ([0.0, 1.0, 1.0], "classification"),  # within {0, 1}
        ([True, False, True], "classification"),
        ([2.5, 7.5, 2.5], "classification"),  # two distinct values
        ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "classification"),  # integers, at most 10 distinct
        (list(range(11)), "regression"),
        ([0.5, 1.5, 2.5], "regression"),
        (["Graduate", "Dropout", "Enrolled"], "classification"),  # text (the authors' rule says regression)
    ],
)
def test_the_data_type_comes_from_the_answers(values, expected):
    assert detect_data_type(pd.DataFrame({"target": values})) == expected


@needs_bench
@pytest.mark.parametrize("task_id", STRING_LABEL_TASKS)
def test_a_string_label_task_scores_as_classification(authors_data, task_id, tmp_path):
    """DSBench's metadata call these three regression; their answers are class names. A valid submission scores
    as classification (accuracy, also the coach's figure), and the episode's outcome and coach evidence come out:
    before, the regression figures read 'Graduate' as a number and the episode failed."""
    root, metadata = authors_data
    rows = [json.loads(x) for path in metadata.values() for x in path.read_text(encoding="utf-8").splitlines()]
    (row,) = [r for r in rows if r["metadata"]["task_id"] == task_id]
    assert row["metadata"]["data_type"] == "regression"
    (tmp_path / "one.json").write_text(json.dumps(row) + "\n")
    (task,), _ = import_tasks(str(root), str(tmp_path / "one.json"), str(tmp_path / "out"))
    assert task["type"] == "classification"

    topology = recipe(coach_evidence="ours")
    env = topology.make_env(task, str(tmp_path / "ws"))
    truth = pd.read_csv(os.path.join(task["answer"], "answers", "test_answer.csv"))
    guess = truth.assign(target=np.where(truth.index % 2 == 0, truth["target"], TEXT_ANSWERS[task_id][0]))
    guess.to_csv(tmp_path / "ws" / "submission.csv", index=False)
    accuracy = float(np.mean(guess["target"] == truth["target"]))
    assert 0.5 <= accuracy < 1
    out = env.outcome()
    assert out["success"] and out["status"] == "ok" and env.task_type == out["task_type"] == "classification"
    assert out["metric_name"] == "accuracy" and out["metric"] == accuracy
    assert out["figures"] == {"accuracy": accuracy}
    evidence = env.coach_ground_truth(topology.agents[-1])
    assert f"Submission check: valid; accuracy = {accuracy:.6g}" in evidence
    assert f"Submission figures: accuracy = {accuracy:.4g}" in evidence
    authors = recipe().make_env(task, str(tmp_path / "authors"))  # the labels compare as text (theirs: no figure)
    guess.to_csv(tmp_path / "authors" / "submission.csv", index=False)
    assert f"  - Accuracy: {accuracy:.4f} (higher" in authors.coach_ground_truth(topology.agents[-1])


def test_cli_score(pack, tmp_path):
    task_dir = Path(pack["sk-wine"]["answer"])
    truth = pd.read_csv(task_dir / "answers" / "test_answer.csv")
    score = [MAPPA, "dsbench", "score", "--task-dir", str(task_dir), "--submission"]
    proc = subprocess.run(score + [write_sub(tmp_path / "s.csv", truth)], capture_output=True, text=True, timeout=60)
    result = json.loads(proc.stdout)
    assert proc.returncode == 0 and result["valid"] and result["metric"] == 1.0 and result["metric_name"] == "accuracy"
    proc = subprocess.run(score + [write_sub(tmp_path / "s.csv", truth.iloc[:3])], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and json.loads(proc.stdout)["status"] == "wrong_row_count"
    proc = subprocess.run([MAPPA, "dsbench", "score", "--task-dir", str(tmp_path), "--submission", "s.csv"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and "not a DSBench task directory" in proc.stderr and "Traceback" not in proc.stderr


def test_evaluation_reports_dsbench_both_ways_and_its_coach_score_is_no_fallback(pack, tmp_path):
    """Audit 4, C14: ours (a valid submission.csv; the competition metric) beside the authors' (an episode
    scored whenever predictions can be read, the second column by position, any rows; accuracy, F1, ROC-AUC,
    RMSE, MAE, MSE pooled over the scored episodes of every task, multi_agent_world_async.py L385-388,
    L437-457). DSBench's coach asks no ANSWER_CORRECT: its raw score is the authors' in-loop figure, never
    counted as a fallback."""
    from openrlhf_mappa.episode import Action, Episode, Verdict
    from openrlhf_mappa.evaluation import summarize

    topology = load_topology(str(DSBENCH_YAML))
    breast, diabetes = pack["sk-breast-cancer"], pack["sk-diabetes"]
    truth = {t["id"]: pd.read_csv(os.path.join(t["answer"], "answers", "test_answer.csv"))
             for t in (breast, diabetes)}
    # other columns, 3 rows short
    renamed = truth["sk-breast-cancer"].set_axis(["row", "guess"], axis=1).iloc[:-3]
    # every value off by 10
    regression = truth["sk-diabetes"].assign(target=truth["sk-diabetes"]["target"] + 10.0)
    plays = [(breast, truth["sk-breast-cancer"]), (breast, renamed), (breast, None), (diabetes, regression)]
    episodes = []
    for i, (task, submission) in enumerate(plays):
        env = topology.make_env(task, str(tmp_path / f"ws{i}"))
        if submission is not None:
            write_sub(tmp_path / f"ws{i}" / "submission.csv", submission)
        final = Action(str(i), topology.agents[-1].name, 0, [], [], coach_request={"is_final_agent": True},
                       verdict=Verdict(6.0 + i, "ok"))
        episodes.append(Episode(str(i), task["id"], env.task_type, [final], env.outcome()))
    outcomes = [ep.outcome for ep in episodes]
    assert [o["success"] for o in outcomes] == [True, False, False, True]
    assert [o["authors_figures"] is None for o in outcomes] == [False, False, True, False]
    assert outcomes[0]["authors_figures"] == {"accuracy": 1.0, "f1": 1.0, "roc_auc": 1.0}
    assert outcomes[1]["authors_figures"] == {"accuracy": 1.0, "f1": 1.0, "roc_auc": 1.0}
    assert outcomes[1]["status"] == "wrong_columns"
    assert outcomes[3]["authors_figures"]["rmse"] == pytest.approx(10.0)
    assert outcomes[3]["authors_figures"]["mae"] == pytest.approx(10.0)
    assert outcomes[3]["authors_figures"]["mse"] == pytest.approx(100.0)

    tasks = [{"id": t["id"], "answer": t["answer"], "type": t["type"]} for t in (breast, diabetes)]
    summary, _ = summarize(episodes, [], tasks, answer_asked=False)
    assert {k: v for k, v in summary.items() if k.startswith("authors/")} == pytest.approx({
        "authors/scored_rate": 0.75, "authors/accuracy": 1.0, "authors/count_accuracy": 2, "authors/f1": 1.0,
        "authors/count_f1": 2, "authors/roc_auc": 1.0, "authors/count_roc_auc": 2, "authors/rmse": 10.0,
        "authors/count_rmse": 1, "authors/mae": 10.0, "authors/count_mae": 1, "authors/mse": 100.0,
        "authors/count_mse": 1})  # fmt: skip
    assert summary["accuracy"] == pytest.approx((1 / 3 + 1) / 2)  # ours: per task, then over tasks
    assert {k: v for k, v in summary.items() if k.startswith("accuracy_coach/")} == {
        "accuracy_coach/answer_correct": 0, "accuracy_coach/score_fallback": 0, "accuracy_coach/score": 4,
        "accuracy_coach/no_final_action": 0, "accuracy_coach/ungraded": 0}  # fmt: skip
