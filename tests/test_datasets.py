"""OpenRLHF's data flags (issue 53): tasks are what OpenRLHF's own `blending_datasets` loads from the same flags
(--data.prompt_dataset, --data.prompt_probs, --data.prompt_split, --data.input_key, --data.label_key,
--eval.dataset with --eval.split), row for row; and a coach-only environment, whose tasks have no answer, passes
the launcher's checks and trains a step."""

import json
from types import SimpleNamespace

import datasets
import pytest
from openrlhf.datasets.utils import blending_datasets

from conftest import stand_in_team, train_step
from test_coach import ScriptedPolicy
from test_launch import workdir  # noqa: F401 (a fixture)

from openrlhf_mappa.cli.train_mappa_ray import Preflight, choose_train_tasks, parse_args
from openrlhf_mappa.coach.heuristic import HeuristicCoach
from openrlhf_mappa.envs.base import MultiAgentEnv, load_tasks
from openrlhf_mappa.evaluation import load_eval_sets
from openrlhf_mappa.trainer import MappaTrainer

STRATEGY = SimpleNamespace(args=SimpleNamespace(use_ms=False), print=lambda *_: None, is_rank_0=lambda: False)
KEYS = ["--data.input_key", "question", "--data.label_key", "solution"]


def write_data(root):
    """A parquet file with other column names than MAPPA's (and one more), a JSONL file with the same ones, and a
    dataset folder (`save_to_disk`) with a train and a test split."""
    with open(root / "a.jsonl", "w") as f:
        for i in range(3):
            f.write(json.dumps({"question": f"What is {i} + 2?", "solution": i + 2}) + "\n")
    datasets.Dataset.from_dict({"question": [f"Name prime {i}." for i in range(5)], "solution": [2, 3, 5, 7, 11],
                                "topic": ["primes"] * 5}).to_parquet(str(root / "b.parquet"))  # fmt: skip
    split = {name: datasets.Dataset.from_dict({"question": [f"{name} {i}?" for i in range(n)], "solution": list(range(n))})
             for name, n in (("train", 2), ("test", 3))}  # fmt: skip
    datasets.DatasetDict(split).save_to_disk(str(root / "folder"))


def preflight(root, *flags, env="mathchat", top=""):
    """The launcher's checks of a launch from `root` with `flags` (on test_launch's workdir: a model,
    tasks.jsonl); `top`: more top-level lines of the topology."""
    (root / "t.yaml").write_text(f"name: t\nenv: {env}\n{top}agents:\n  - {{name: writer, model: "
                                 f"{root / 'model'}, role: writes, prompt: '{{task}}'}}\n")
    args = parse_args(["--mappa.topology", str(root / "t.yaml"), "--data.prompt_dataset", str(root / "tasks.jsonl"),
                       "--vllm.num_engines", "1", "--actor.num_gpus_per_node", "1", "--rollout.batch_size", "2",
                       "--rollout.n_samples_per_prompt", "1", "--rollout.max_new_tokens", "8", "--train.batch_size",
                       "2", "--train.micro_batch_size", "1", "--ds.attn_implementation", "sdpa", "--mappa.run_dir",
                       str(root / "run"), "--ckpt.path", str(root / "ckpt"), *flags])  # fmt: skip
    pre = Preflight(args)
    for _, method, _ in Preflight.STEPS[:6]:  # through the run directory: what needs no other machine
        getattr(pre, method)()
    return pre


def upstream(spec, probs=None, split="train"):
    """(text, answer) of each row, as OpenRLHF's blending_datasets loads `spec` (seed 42, --train.seed's default)."""
    rows = blending_datasets(spec, probs, STRATEGY, 42, dataset_split=split)
    return [(row["question"], str(row["solution"])) for row in rows]


@pytest.mark.parametrize("flag", ["input_key, label_key", "prompt_probs", "comma list", "prompt_split"])
def test_training_tasks_are_blending_datasets_rows(workdir, flag):  # noqa: F811 (the workdir fixture)
    write_data(workdir)
    spec, probs, split = {"input_key, label_key": (f"{workdir}/b.parquet", None, "train"),
                          "prompt_probs": (f"{workdir}/a.jsonl,{workdir}/b.parquet", "0.3,0.7", "train"),
                          "comma list": (f"{workdir}/b.parquet,{workdir}/a.jsonl", None, "train"),
                          "prompt_split": (f"{workdir}/folder", None, "test")}[flag]  # fmt: skip
    flags = ["--data.prompt_dataset", spec, "--data.prompt_split", split, *KEYS]
    pre = preflight(workdir, *flags, *(["--data.prompt_probs", probs] if probs else []))
    expected = upstream(spec, probs, split)
    assert [(t["prompt"], t["answer"]) for t in pre.all_tasks] == expected
    assert [t["id"] for t in pre.all_tasks] == [str(i) for i in range(len(expected))]  # no id column: positions
    assert pre.chosen["source"] == {"datasets": spec, "probs": probs, "split": split, "input_key": "question",
                                    "label_key": "solution"}  # fmt: skip
    if flag == "prompt_probs":  # the parquet oversampled to 0.7 of the blend, its rows repeated
        assert len(expected) > 8 and len(set(expected)) == 8
    if flag == "input_key, label_key":  # the parquet's other columns are kept for the environment
        assert {t["topic"] for t in pre.all_tasks} == {"primes"}


def test_max_samples_draws_from_the_blend(workdir):  # noqa: F811
    write_data(workdir)
    spec = f"{workdir}/a.jsonl,{workdir}/b.parquet"
    pre = preflight(workdir, "--data.prompt_dataset", spec, "--data.max_samples", "4", *KEYS)
    assert pre.tasks == choose_train_tasks(pre.all_tasks, 4, 42) and len(pre.tasks) == 4
    assert [t["prompt"] for t in pre.all_tasks] == [q for q, _ in upstream(spec)]
    assert json.loads(json.dumps(pre.chosen))["ids"] == [t["id"] for t in pre.tasks]


def test_each_eval_dataset_is_its_own_set_of_its_split(workdir):  # noqa: F811
    write_data(workdir)
    pre = preflight(workdir, "--eval.dataset", f"{workdir}/folder", "--eval.split", "test", *KEYS,
                    "--data.prompt_dataset", f"{workdir}/b.parquet")
    assert [(t["prompt"], t["answer"]) for t in pre.eval_sets["folder"]] == upstream(f"{workdir}/folder", split="test")
    # Each entry its own set (OpenRLHF would blend them), named by its file or folder; --eval.split's default: train.
    args = parse_args(["--mappa.topology", "t.yaml", "--eval.dataset", f"{workdir}/folder,{workdir}/b.parquet", *KEYS])
    sets = load_eval_sets(args)
    assert list(sets) == ["folder", "b"]
    assert [[(t["prompt"], t["answer"]) for t in tasks] for tasks in sets.values()] == [
        upstream(f"{workdir}/folder"), upstream(f"{workdir}/b.parquet")]
    # The parquet file has one split (train): refused with the flag to change.
    with pytest.raises(ValueError) as err:
        preflight(workdir, "--eval.dataset", f"{workdir}/b.parquet", "--eval.split", "test", *KEYS,
                  "--data.prompt_dataset", f"{workdir}/b.parquet")
    assert str(err.value) == (f"{workdir}/b.parquet: no split 'test' (a data file's only split is 'train'); name one "
                              "of its splits with --data.prompt_split, or --eval.split for --eval.dataset")


def test_ids_repeated_rows_and_conflicts(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"id": "x", "prompt": "a?", "answer": 1}) + "\n")
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"id": f"y{i}", "prompt": f"b{i}?", "answer": i}) + "\n"
                                              for i in range(4)))  # fmt: skip
    # A blend oversamples the smaller dataset: its identical row, repeated under its own id, is kept.
    tasks = load_tasks(f"{tmp_path}/a.jsonl,{tmp_path}/b.jsonl", "0.5,0.5")
    assert [t["id"] for t in tasks].count("x") > 1 and len({t["id"] for t in tasks}) == 5
    (tmp_path / "c.jsonl").write_text(json.dumps({"id": "x", "prompt": "c?", "answer": 3}) + "\n")
    with pytest.raises(ValueError) as err:
        load_tasks(f"{tmp_path}/a.jsonl,{tmp_path}/c.jsonl")
    assert str(err.value) == (f"{tmp_path}/a.jsonl,{tmp_path}/c.jsonl: row 0 (counting from 0) and row 1 (counting "
                              "from 0) have the same id 'x'; give every task its own id")



def test_a_bad_row_in_a_blend_is_named_in_its_own_dataset(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"question": "a?", "solution": 1}) + "\n")
    datasets.Dataset.from_dict({"question": ["b0?", "b1?", " "], "solution": [0, 1, 2]}).to_parquet(
        str(tmp_path / "b.parquet"))
    with pytest.raises(ValueError) as err:
        load_tasks(f"{tmp_path}/a.jsonl,{tmp_path}/b.parquet", "0.5,0.5", input_key="question", label_key="solution")
    assert str(err.value) == f"{tmp_path}/b.parquet: row 2 (counting from 0): empty 'question'"


def test_a_csv_row_with_an_unquoted_comma_is_refused_not_shifted(tmp_path):
    # Catches the old loader: pandas took the row's first field for an implicit index (__index_level_0__), and
    # the task loaded as {'id': 'A tag for Ana', 'request': ' who loves cake.', ...} ("8 of the 8" in mappa
    # check).
    (tmp_path / "gifts.csv").write_text("id,request,must_contain\ng0,A tag for Bo, who sings.,song\n"
                                        "g1,A tag for Ana, who loves cake.,cake\n")  # every row: the trial's
    with pytest.raises(ValueError, match="gifts.csv: line 2: 4 fields, but the header has 3"):
        load_tasks(str(tmp_path / "gifts.csv"), input_key="request", label_key="must_contain")
    (tmp_path / "gifts.csv").write_text('id,request,must_contain\ng0,"A tag for Bo, who\nsings.",song\n'
                                        "g1,A tag for Ana, who loves cake.,cake\n")
    with pytest.raises(ValueError) as err:
        load_tasks(str(tmp_path / "gifts.csv"), input_key="request", label_key="must_contain")
    assert str(err.value) == (f"{tmp_path}/gifts.csv: line 4: 4 fields, but the header has 3 "
                              "(id,request,must_contain): put a field that holds a comma in double quotes, "
                              f"e.g. \"A tag for Ana, who loves cake.\"")
    (tmp_path / "gifts.csv").write_text('id,request,must_contain\ng0,"A tag for Bo, who\nsings.",song\n\n'
                                        'g1,"A tag for Ana, who loves cake.",cake\n')  # quoted: as written
    tasks = load_tasks(str(tmp_path / "gifts.csv"), input_key="request", label_key="must_contain")
    assert [(t["id"], t["prompt"], t["answer"]) for t in tasks] == [
        ("g0", "A tag for Bo, who\nsings.", "song"), ("g1", "A tag for Ana, who loves cake.", "cake")]


def test_a_folder_not_created_yet_is_named_at_once_when_the_hub_is_out_of_reach(tmp_path, monkeypatch):
    # Catches the old loader, which sent `data/gifts` (no such folder yet) to the Hub, whose client retried an
    # unreachable Hub for ~30 s before blending_datasets' ConnectionError. The Hub here: a closed port.
    import huggingface_hub

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(ValueError) as err:
        load_tasks("data/gifts")
    assert str(err.value) == (f"data/gifts: no local file or folder (relative to {tmp_path}), and the "
                              "Hugging Face Hub (http://127.0.0.1:9) could not be reached to look it up as "
                              "a dataset name (ConnectError): check the path; a Hub dataset needs the "
                              f"network, or its copy in the cache and HF_HUB_OFFLINE=1")


class WriterEnv(MultiAgentEnv):
    """A writer judged by the coach alone: its tasks have no reference answer."""

    needs_answer = False

    def outcome(self):
        return {"success": bool(self.history[-1].response.strip())}


def test_a_coach_only_environment_takes_tasks_without_answers_and_trains(workdir, monkeypatch):  # noqa: F811
    (workdir / "briefs.jsonl").write_text(json.dumps({"prompt": "A poem about the sea."}) + "\n"
                                          + json.dumps({"prompt": "A haiku on rain."}) + "\n")
    with pytest.raises(ValueError) as err:  # an environment that needs answers refuses the row
        preflight(workdir, "--data.prompt_dataset", str(workdir / "briefs.jsonl"))
    assert str(err.value) == (f"{workdir}/briefs.jsonl: line 1: 'answer' is missing or null (its columns: prompt; name "
                              "the answer's with --data.label_key COLUMN); these tasks need a reference answer "
                              "(string or number)")  # fmt: skip
    pre = preflight(workdir, "--data.prompt_dataset", str(workdir / "briefs.jsonl"), env="test_datasets:WriterEnv")
    assert [(t["id"], t["prompt"], t["answer"]) for t in pre.tasks] == [("1", "A poem about the sea.", None),
                                                                       ("2", "A haiku on rain.", None)]  # fmt: skip

    # One training step: the driver for real, the writer's Ray side a stand-in, its replies scripted.
    agents = stand_in_team(pre.args, pre.topology)
    trainer = MappaTrainer(pre.args, pre.topology, agents, HeuristicCoach(), pre.tasks, pre.args.mappa.run_dir)
    trainer.policies = {"writer": ScriptedPolicy("The sea is wide and grey.")}
    m = train_step(trainer, 1, pre.tasks)
    ((step, rows),) = agents[0].trainer.trained
    assert step == 1 and len(rows) == 2 and m["agent/writer/updated"] == 1 and m["outcome/success_rate"] == 1.0
    episodes = [json.loads(line) for line in open(workdir / "run" / "episodes.jsonl")]
    assert [a["coach_request"]["ground_truth"] for ep in episodes for a in ep["actions"]] == [None, None]


def test_batch_strata_names_a_column_every_training_task_has(workdir):  # noqa: F811 (the workdir fixture)
    """A topology's batch_strata (dsbench.yaml: type) is a task-row column; a misspelt one, which would make
    one stratum of every task, is refused before Ray starts, naming the columns the tasks have."""
    write_data(workdir)
    flags = ["--data.prompt_dataset", f"{workdir}/b.parquet", *KEYS]
    assert preflight(workdir, *flags, top="batch_strata: topic\n").topology.batch_strata == "topic"
    with pytest.raises(SystemExit) as refused:
        preflight(workdir, *flags, top="batch_strata: topc\n")
    assert str(refused.value) == (
        f"{workdir}/t.yaml: batch_strata 'topc', but 5 of the 5 training tasks in {workdir}/b.parquet have "
        "no such column (task '0' has: answer, id, prompt, question, solution, topic, type); name one of "
        "those, or leave batch_strata out for one shuffle per pass")
