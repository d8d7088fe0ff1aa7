"""The shipped recipes train what the authors trained. `render` reads the effective settings of a GPU script
(its flags, through train_mappa_ray's real parser) and its topology; each is compared with a table of the
authors' values, each naming the file of the authors' code (github.com/ltjed/multiagent-coaching) it comes
from. A value that departs fails, unless the table marks it as a documented difference: then it names what we
ship and the README's fidelity row that says so, and a change to that value fails too.

Also: the loss aggregation the scripts pass reproduces the authors' per-sequence mean (OpenRLHF's own loss
code), each agent's learning-rate schedule follows the authors' formula, and the prompts state the limits
the flags set."""

import dataclasses
import functools
import inspect
import json
import math
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from conftest import submit_script
from test_dsbench import BENCH, authors_layout, fake_dsbench
from openrlhf_mappa.cli.train_mappa_ray import parse_args, schedule_steps
from openrlhf_mappa.coach import CoachRequest, parse_score, render_prompt
from openrlhf_mappa.envs import dsbench
from openrlhf_mappa.envs.base import HistoryEntry, load_tasks
from openrlhf_mappa.tools.dsbench_tasks import import_tasks
from openrlhf_mappa.rewards import compute_advantages
from openrlhf_mappa.team import load_topology

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "examples" / "scripts"
SAME = object()


@dataclass(frozen=True)
class Authors:
    value: object
    source: str  # where in ltjed/multiagent-coaching the value comes from
    ours: object = SAME  # a documented difference: what the recipe ships instead
    readme: str = ""  # ... and the README fidelity row that documents it


# ---------------------------------------------------------------- the criteria, prompts and views, as checkable facts
# Each criterion of the authors' coach prompt or agent prompt, as a regex over ours (lower case, whitespace
# collapsed); the rendered value is the set of those that match. A FORBIDDEN one is a rule the authors do not have.
FORBIDDEN = {"capped by the outcome": r"(cannot|can't|must not) score above",
             "states the turn rule": r"a reply without a code block ends your turn"}  # DSBench's: documented
MATHCHAT_COACH = {
    "the three agents in order": r"1\. problem solver.*2\. code executor.*3\. verifier",
    "the verifier's final answer decides": r"decided by the verifier's final answer alone",
    "every agent sees the problem": r"every agent is shown the problem statement",
    "(most important) its role, given its input": r"\(most important\) did well in its role with the information",
    "stayed within the output-length limit": r"kept within its output-length limit",
    "helps the team toward a correct answer": r"how much does its output help the team reach a correct final answer",
    "code executor: format, syntax, solves it": r"code executor: is its code in the expected format, free of syntax",
    "verifier: synthesises, gives the answer": r"verifier: does it combine the information correctly and give the",
    "strict, 0 (terrible) to 10 (perfect)": r"be strict in scoring, from 0 \(terrible\) to 10 \(perfect\)",
    "answer_correct 1/0 when a reference is given": r"reference answer is given.*answer_correct: 1.*answer_correct: 0",
    "ends with the score lines": r"process_score: <integer from 0 to 10>\s*answer_correct: <1 or 0",
}
DSBENCH_COACH = {
    "the three agents and the files they owe":
        r"data engineer:.*x_train\.pkl, y_train\.pkl and x_test\.pkl.*modeler:.*model\.pkl.*analyst:.*submission\.csv",
    "root cause of a missing submission": r"when submission\.csv is missing or invalid the pipeline has failed",
    "a missing file is its owner's fault": r"a file that is missing is the fault of the agent that owed it",
    "blame by error type": r"filenotfounderror for x_test\.pkl is the data engineer's fault, one for model\.pkl the "
                           r"modeler's; a keyerror, typeerror or attributeerror is most likely a bug in this agent's",
    "blame bands 0-2 / own work / 3-5": r"0-2 if it caused the failure downstream.*by the quality of its own work if "
                                        r"it did its job.*3-5 if it failed because a file an earlier agent owed",
    "the file chain": r"data engineer saves x_train\.pkl, y_train\.pkl, x_test\.pkl.*-> modeler loads x_train\.pkl and "
                      r"y_train\.pkl, saves model\.pkl -> analyst loads x_test\.pkl and model\.pkl, saves submission",
    "words without code: 0-2": r"descriptions, explanations or bare file names instead of code.*failed badly \(0-2\)",
    "process: code runs, files saved, files checked": r"runnable python in ```python blocks, and did the code run "
                                                      r"without errors.*did it check which files exist before loading",
    "score bands 10 / 8-9 / 6-7 / 4-5 / 2-3 / 0-1": r"10: exceptional.*earns 8-9, not 10\. 8-9: its code ran.*6-7: "
                                                    r".*4-5: .*2-3: .*0-1: ",
    "analyst caps, classification": r"roc-auc at least 0\.85 or accuracy at least 85%: 9 \(10 only if exceptional\); "
                                    r"0\.75 to 0\.85: 8; 0\.65 to 0\.75: 6; 0\.55 to 0\.65: 4; below 0\.55 "
                                    r"\(near chance\): 3",
    "analyst caps, regression rmse % of range": r"rmse as a percentage of the true target's range: under 10%: 9; "
                                                r"10% to 25%: 8; 25% to 50%: 6; over 50%: 4",
    "outliers: judge by the iqr": r"interquartile range is much higher than of the range.*judge by the interquartile",
    "upstream caps 5 (modeler) and 6 (data engineer)": r"model is close to chance \(roc-auc about 0\.5\) scores at "
                                                       r"most 5.*preprocessing led to poor features scores at most 6",
    "task difficulty": r"imbalanced classes f1 matters more.*time-series.*70% accuracy may be good.*90% should be",
    "cap by default; above it only to 8": r"apply the cap whenever the outcome is poor.*go above the cap \(to 8 at "
                                          r"most, never 10\) only when all of these hold",
    "worked examples 9/8/6/3/6-7/6": r"85% accuracy scores 9; with 78%, 8; with 65%, 6; with 54% and no clear "
                                     r"culprit, 3; with 54% and a clear earlier failure, 6-7; a buggy process .*, 6",
    "analysis (3-5 sentences) then the score": r"short analysis \(3 to 5 sentences\).*files this agent had.*ran "
                                               r"without errors.*which files it saved.*which agent is responsible",
}
_BUDGET = r"counting your reasoning between <think> and </think>; whatever goes past that is cut off"
MATHCHAT_PROMPTS = {
    "problem_solver": {
        "its place among the three": r"the problem solver, the first of three agents .*code executor, then a verifier",
        "the team succeeds only by the verifier": r"the team succeeds only when the verifier",
        "the budget counts its thinking": _BUDGET,
        "its job: draft a solution": r"your part is to draft a solution",
    },
    "code_executor": {
        "its place among the three": r"the code executor, the second of three agents .*problem solver, then you, then",
        "the team succeeds only by the verifier": r"the team succeeds only when the verifier",
        "the budget counts its thinking": _BUDGET,
        "its code runs; it may iterate": r"python you write in a ```python block is run for you.*keep going or state",
        "sees the problem solver's reply": r"what the problem solver wrote:",
    },
    "verifier": {
        "its place among the three": r"the verifier, the last of three agents .*problem solver, then a code executor",
        "the team succeeds only by its answer": r"the team succeeds only when your answer is correct",
        "the budget counts its thinking": _BUDGET,
        "final answer as \\boxed": r"write the final answer as \\boxed\{\{answer\}\}",
        "sees the code executor's work": r"what the code executor produced:",
    },
}
_THINK = r"think briefly \(under 1,000 words inside <think>\), then write runnable code in a ```python block"
_PLACE = r"you are the {} of a data science pipeline of three agents"
DSBENCH_PROMPTS = {
    "data_engineer": {
        "its place in the pipeline": _PLACE.format("data engineer"),
        "brief thinking, then code": _THINK,
        "eda, preprocessing, features": r"explore them: column types, shape, missing values.*preprocess: fill or drop "
                                        r"missing values, encode categorical columns, scale numeric ones",
        "save x_train, y_train, x_test (+ transformers)": r"x_train\.pkl +the preprocessed training features.*"
                                                          r"y_train\.pkl +the training target.*x_test\.pkl +the "
                                                          r"preprocessed test features.*fitted transformer",
        "x_test.pkl is essential": r"x_test\.pkl is essential",
        "the preprocessing summary block": r"---preprocessing_summary---.*---end_summary---",
        "same transforms, no leakage, deterministic": r"transform train and test in the same way; fit nothing on the "
                                                      r"test data \(no leakage\); make the preprocessing deterministic",
    },
    "modeler": {
        "its place in the pipeline": _PLACE.format("modeler"),
        "brief thinking, then code": _THINK,
        "the data engineer's summary": r"the data engineer's final reply \(its preprocessing summary\):",
        "check files first": r"check first which files exist",
        "algorithm choice, cv, tuning": r"choose the algorithm.*train with cross-validation, tune the hyperparameters",
        "save model.pkl": r"save it with pickle as model\.pkl: the analyst needs it",
        "the model summary block": r"---model_summary---.*---end_summary---",
    },
    "analyst": {
        "its place in the pipeline": _PLACE.format("analyst"),
        "brief thinking, then code": _THINK,
        "both summaries": r"final replies of the data engineer \(its preprocessing summary\) and of the modeler",
        "check files; name a missing one": r"check first which files exist.*if either is missing you cannot write "
                                           r"submission\.csv: say which file is missing",
        "ids from test.csv": r"take the id column from the original test\.csv",
        "quality checks": r"no missing predictions, values in range \(probabilities within \[0, 1\]\), the right "
                          r"column names and order",
        "submission.csv is scored": r"submission\.csv is what gets scored",
    },
}
# Facts of the authors' DSBench prompts that ours lack, and one ours add (see the README row "agents' prompts").
DSBENCH_PROMPT_GAPS = {"the workspace's files listed", "a warning naming missing critical files (analyst)",
                       "an example program"}
DSBENCH_PROMPT_EXTRA = {"states the turn rule": r"a reply without a code block ends your turn \(at most \d+ replies\)"}


def facts(text: str, table: dict) -> set:
    flat = re.sub(r"\s+", " ", text.lower())
    return {name for name, rx in {**table, **FORBIDDEN}.items() if re.search(rx, flat)}


def stated_limits(text: str) -> set:
    """The output limits a prompt states, in tokens ("at most 4,096 tokens")."""
    return {int(n.replace(",", "")) for n in re.findall(r"at most ([\d,]+) tokens", text)}


def view_of(topology, spec, workdir: Path) -> str:
    """What an agent's prompt effectively shows of the agents before it (the chain): the environment's own
    observe(), on a history where each earlier agent replied twice (a code agent's code ran each time), each part
    marked."""
    env = topology.make_env({"id": "t", "prompt": "the task", "answer": str(workdir / "no-task")}, str(workdir / "ws"))
    earlier = topology.agents[: topology.agents.index(spec)]
    for other in earlier:
        for turn in (0, 1):
            ran = f"F{turn}-{other.name}" if other.runs_code else ""
            env.history.append(HistoryEntry(other.name, turn, f"<think>R{turn}-{other.name}</think>A{turn}-{other.name}",
                                            ran))
    prompt = "".join(m["content"] for m in env.observe(spec, 0))
    shown = [a.name for a in earlier if f"A1-{a.name}" in prompt]
    if not shown:
        return "nothing"
    replies = "all" if all(f"A0-{a}" in prompt for a in shown) else "last"
    thinking = ", thinking removed" * all(f"R1-{a}" not in prompt for a in shown)
    if thinking:  # and of a reply cut off inside its reasoning (Qwen3-4B-Thinking-2507 writes no <think>)
        env = topology.make_env({"id": "t", "prompt": "the task", "answer": str(workdir / "no-task")},
                                str(workdir / "ws-cut"))
        env.history += [HistoryEntry(other.name, 0, f"<think>CUT-{other.name}", "") for other in earlier]
        cut = "".join(m["content"] for m in env.observe(spec, 0))
        kept = all(f"CUT-{a}" in cut for a in shown)
        thinking += f", a reply cut off in its reasoning {'handed on' if kept else 'shows nothing'}"
    code = ", with their code output" * any(f"F1-{a}" in prompt for a in shown)
    return f"{', '.join(shown)}: {replies} replies{thinking}{code}"


def turn_rule_of(topology, workdir: Path) -> str:
    """When a code agent's turn ends, by the environment's own step(): on a reply whose code ran and saved the
    agent's files, or only on a reply without code."""
    env = topology.make_env({"id": "t", "prompt": "the task", "answer": str(workdir / "no-task")}, str(workdir / "ws"))
    agent = next(a for a in topology.agents if a.runs_code)
    files = getattr(env, "contract", {}).get(agent.name, [])
    code = "\n".join(f"open({f!r}, 'w').write('x')" for f in files) or "print(1)"
    if env.step(agent, 0, f"Saving.\n```python\n{code}\n```").done:
        return "on files saved"
    return "on a reply without code" if env.step(agent, 1, "Done: the files are saved.").done else "never"


def one_row_env(topology, workdir: Path):
    """The topology's environment on a one-row DSBench task (baseline 0.4321: a number only a relative score shows)."""
    task_dir = workdir / "task"
    (task_dir / "answers").mkdir(parents=True)
    for name in ("train.csv", "test.csv", "sample_submission.csv", "answers/test_answer.csv"):
        (task_dir / name).write_text("id,target\n1,0\n")
    (task_dir / "task.json").write_text(json.dumps({"task_id": "t", "data_type": "classification", "metric": "accuracy",
                                                    "id_column": "id", "target_columns": ["target"], "baseline": 0.4321,
                                                    "best": 1.0}))
    return topology.make_env({"id": "t", "prompt": "the task", "answer": str(task_dir)}, str(workdir / "ws"))


def workspace_of(topology, workdir: Path) -> str:
    """What a code agent's code finds in the workspace, by the environment's own step() on a one-row task: the task's
    files at the start; after each code agent's run, which of the files it wrote (or overwrote: train.csv) the next
    run finds as it left them; and what a run that deletes every file leaves for the next one."""
    env = one_row_env(topology, workdir)
    ws = workdir / "ws"
    start = sorted(os.listdir(ws))
    written = ["train.csv", "notes.txt", "features.csv", "X.pkl", "m.joblib", "a.npy", "b.npz", "submission.csv",
               "predictions.csv"]
    coders = [a for a in topology.agents if a.runs_code]
    kept = []
    for agent in coders:
        code = "\n".join(f"open({f!r}, 'w').write({agent.name!r})" for f in written)
        env.step(agent, 0, f"```python\n{code}\n```")
        found = [f for f in written if (ws / f).exists() and (ws / f).read_text() == agent.name]
        kept.append(f"{agent.name}'s {', '.join(found) or 'nothing'}")
    wipe = "import os\nfor f in os.listdir():\n    if not f.startswith('_mappa_code_'):\n        os.remove(f)"
    env.step(coders[0], 1, f"```python\n{wipe}\n```")
    return (f"starts with {', '.join(start)}; the next code run finds, as the run left them, {'; '.join(kept)}; "
            f"after a run deleting every file: {', '.join(sorted(os.listdir(ws)))}")


def coach_evidence_of(topology, workdir: Path) -> str:
    """What the coach is shown, by the environment's own coach_ground_truth() on a one-row task: whether the second
    agent's evidence lists the file its own action wrote (the workspace after the action) or not (the files when its
    turn began), and whether the last agent's, for a perfect submission, gives the task's baseline (a relative score)
    or F1 (the authors' raw figures)."""
    env = one_row_env(topology, workdir)
    agents = topology.agents
    env.step(agents[0], 0, "```python\nopen('X_train.pkl', 'w').write('x')\n```")
    env.step(agents[1], 0, "```python\nopen('model.pkl', 'w').write('x')\n```")
    files = "the workspace after the action" if "model.pkl" in env.coach_ground_truth(agents[1]) else \
        "the files when the agent's turn began"
    env.step(agents[-1], 0, "```python\nopen('submission.csv', 'w').write('id,target\\n1,0\\n')\n```")
    last = env.coach_ground_truth(agents[-1])
    figures = "against the baseline" if "0.4321" in last else "raw, with F1" if re.search(r"\bF1\b", last) else "none"
    return f"{files}; the Analyst's figures {figures}"


def task_texts(topology, workdir: Path, argv: tuple = ()) -> dict:
    """Which text of a task the first agent's prompt and the coach's show, rendered: a one-task DSBench layout with a
    cleaned text beside its metadata, imported by `mappa dsbench import` (its own parser and code; `argv`: flags
    added), then made an episode of the topology."""
    from openrlhf_mappa.tools import mappa

    row = fake_dsbench(workdir / "DSBench", prompt="KAGGLE-PAGE-TEXT\nEvaluation\nScored by MAE.")
    (workdir / "meta.json").write_text(json.dumps(row) + "\n")
    (workdir / "dsbench_modeling_cleaned_prompts.json").write_text(json.dumps(
        {row["metadata"]["task_id"]: {"cleaned_prompt": "CLEANED-TASK-TEXT"}}))
    args = mappa.build_parser()[0].parse_args(["dsbench", "import", "--data-root", str(workdir / "DSBench"), "--metadata",
                                               str(workdir / "meta.json"), "--out", str(workdir / "out"), *argv])
    assert mappa.dsbench(args) == 0
    (task,) = load_tasks(str(workdir / "out" / "tasks.jsonl"))
    env = topology.make_env(task, str(workdir / "ws"))
    coach = render_prompt(topology.coach_template, CoachRequest("e", "a", 0, "r", env.task_text, "", "", "", ""))
    shown = {"agents": env.observe(topology.agents[0], 0)[-1]["content"], "coach": coach}
    return {f"task text/{who}": "cleaned" if "CLEANED-TASK-TEXT" in text else "raw" if "KAGGLE-PAGE-TEXT" in text
            else "none" for who, text in shown.items()}


def whitening_of(args) -> str:
    """Over what the advantages are whitened, by rewards.compute_advantages on two agents' batches with the
    recipe's scope: each agent's returns to mean 0 on their own, or only the team's together."""
    from types import SimpleNamespace

    def batch(rewards):
        return SimpleNamespace(rewards=torch.tensor(rewards), kl=torch.zeros(len(rewards), 2),
                               action_mask=torch.ones(len(rewards), 2, dtype=torch.bool))

    batches = {"a": [batch([1.0, 3.0])], "b": [batch([10.0, 20.0])]}
    compute_advantages(batches, 0.0, args.mappa.norm_scope, args.algo.advantage.gamma,
                       std_norm=not args.algo.advantage.no_std_norm)
    own_means = [abs(float(b[0].advantages.mean())) for b in batches.values()]
    return "each agent's batch" if max(own_means) < 1e-6 else "the team's batches together"


def problem_suffixes(topology) -> dict:
    """What follows a task's problem where it is shown, rendered: in every agent's first prompt ("agents"; one
    value if all agree) and the coach's prompt ("coach")."""
    with tempfile.TemporaryDirectory() as workspace:
        env = topology.make_env({"id": "0", "prompt": "PROBLEM", "answer": workspace, "type": ""}, workspace)
        after = [env.observe(spec, 0)[-1]["content"].split("PROBLEM", 1)[1] for spec in topology.agents]
        coach = render_prompt(topology.coach_template, CoachRequest("e", "a", 0, "r", env.task_text, "", "", "", ""))
    suffix = env.task_text.removeprefix("PROBLEM")
    agents = {suffix if text.startswith(suffix) else "" for text in after}  # (DSBench's agents never get it)
    return {"agents": agents.pop() if len(agents) == 1 else sorted(agents),
            "coach": suffix if "PROBLEM" + suffix in coach else coach}


# ---------------------------------------------------------------- rendering a recipe


def render(args, topology, rows_in_task_file: int, coach_facts: dict, prompt_facts: dict, workdir: Path) -> dict:
    """The settings that decide what trains, as the launcher reads them (`args` from train_mappa_ray's parser);
    `rows_in_task_file`: rows of the authors' training file (not committed here), of which --data.max_samples
    are used; the criteria of the coach and the agents' prompts as the facts of those tables that hold."""
    tasks = min(args.data.max_samples, rows_in_task_file)
    steps = schedule_steps(args, topology, tasks)
    a = args
    out = {
        "estimator": a.algo.advantage.estimator, "gamma": a.algo.advantage.gamma,
        "kl coefficient": a.algo.kl.init_coef, "kl estimator": a.algo.kl.estimator,
        "kl in the reward": not a.algo.kl.use_loss,
        "advantage whitening": whitening_of(a), "reward": a.mappa.reward,
        "loss aggregation": a.actor.loss_agg_mode, "policy clip": tuple(a.actor.eps_clip_low_high),
        "lr": a.actor.adam.lr, "lr scheduler": a.actor.lr_scheduler, "lr warm-up ratio": a.actor.lr_warmup_ratio,
        "min lr ratio": a.actor.min_lr_ratio, "adam betas": tuple(a.actor.adam.betas),
        "weight decay": a.actor.adam.weight_decay, "grad norm clip": a.actor.max_norm,
        "tasks": tasks, "subset seed": a.train.seed, "episodes": a.train.num_episodes,
        "rollout batch": a.rollout.batch_size, "samples per prompt": a.rollout.n_samples_per_prompt,
        "rollout micro-batch": a.rollout.micro_batch_size, "train batch": a.train.batch_size,
        "train micro-batch": a.train.micro_batch_size, "epochs": a.train.max_epochs,
        "temperature": a.rollout.temperature, "top_p": a.rollout.top_p,
        "eval sets": sorted(Path(p).name for p in (a.eval.dataset or "").split(",") if p),
        "eval every (steps)": a.eval.steps, "eval samples": a.eval.n_samples_per_prompt,
        "eval temperature": a.eval.temperature,
        "generation length": a.rollout.max_new_tokens, "prompt length": a.data.max_len - a.rollout.max_new_tokens,
        "truncated actions trained": a.mappa.train_truncated,
        "batch semantics": a.mappa.batch_semantics,  # its behaviour: tests/test_batch_semantics.py
        "reward scale": topology.reward_scale,
        "turns end": turn_rule_of(topology, workdir / "turns"),
        "code timeout (s)": topology.env_kwargs.get(
            "code_timeout_s", inspect.signature(topology.env_cls).parameters["code_timeout_s"].default),
        "score key": topology.score_key,
        # The outcome key's weight: what a reply giving both keys trains on (theirs: 1.0 x process + 0.0 x outcome).
        "reward of 'PROCESS_SCORE: 4 / ANSWER_CORRECT: 1'": parse_score("Sound.\nPROCESS_SCORE: 4\nANSWER_CORRECT: 1",
                                                                        topology.score_key),
        "coach: stated output limit": stated_limits(topology.coach_template),
        "coach criteria": facts(topology.coach_template, coach_facts),
        "coach model": a.mappa.coach.model, "coach reply format": a.mappa.coach.structured,
        "earlier reasoning in an agent's later prompts": "kept" if topology.keep_reasoning else "the template's",
        "coach input": topology.coach_input, "batch strata": topology.batch_strata,
        **{f"problem suffix/{who}": text for who, text in problem_suffixes(topology).items()},
    }
    for spec in topology.agents:
        out[f"schedule length/{spec.name}"] = steps[spec.name]
        out[f"warm-up steps/{spec.name}"] = math.ceil(steps[spec.name] * a.actor.lr_warmup_ratio)
        out[f"model/{spec.name}"] = a.mappa.model or spec.model
        out[f"coach role/{spec.name}"] = spec.role
        out[f"actions per episode/{spec.name}"] = spec.max_actions
        out[f"runs code/{spec.name}"] = spec.runs_code
        out[f"view/{spec.name}"] = view_of(topology, spec, workdir / spec.name)
        out[f"generation length/{spec.name}"] = spec.max_new_tokens or a.rollout.max_new_tokens
        out[f"prompt: stated output limit/{spec.name}"] = stated_limits(spec.prompt)
        out[f"prompt facts/{spec.name}"] = facts(spec.prompt, prompt_facts[spec.name])
    return out


def submitted(script: Path, tmp_path) -> list:
    argv, _ = submit_script(script, tmp_path, MAPPA_COACH_BASE_URL="", MAPPA_COACH_MODEL="")  # the scripts' own coach
    return argv[argv.index("openrlhf_mappa.cli.train_mappa_ray") + 1:]


# ---------------------------------------------------------------- the authors' values

MC, MCY, MCW = "scripts/run_train_mathchat.sh", "marti/cli/configs/mathchat_with_coach.yaml", \
    "marti/worlds/workflows/mathchat_workflow_with_coach.py"
DS, DSY, DSW = "scripts/run_train_dsbench.sh", "marti/cli/configs/dsbench_ds_pipeline.yaml", \
    "marti/worlds/workflows/dsbench_workflow.py"
DEFAULTS, ACTOR = "marti/cli/configs/default.yaml", "marti/trainers/ppo/actor.py"
BASE = "marti/controllers/base_controller.py"
STEP = "marti/worlds/steps/mcp_step.py (a step without a tool call is done)"
COACH = "marti/verifiers/coach/external_coach.py"
SUFFIX = "\n\nPlease reason step by step, and put your final answer within \\boxed{}."
LOSS = ("seq-mean-token-mean", f"{DEFAULTS} token_level_loss: true, per micro-batch of micro_train_batch_size=1 "
        f"({MC}); DeepSpeed averages the micro-batches: a mean of per-sequence token means")


def common(script: str) -> dict:
    """What both of the authors' recipes set alike."""
    return {
        "estimator": Authors("reinforce", f"{script} advantage_estimator=reinforce_plus_plus"),
        "gamma": Authors(1, f"{DEFAULTS} gamma: 1"),
        "kl coefficient": Authors(0.01, f"{script} init_kl_coef=0.01"),
        "kl estimator": Authors("k1", f"{script} use_kl_estimator_k3=False"),
        "kl in the reward": Authors(True, f"{script} use_kl_loss=False"),
        "advantage whitening": Authors("each agent's batch", "marti/trainers/ppo/ (REINFORCE++ whitening of each agent's "
                                       "buffer)"),
        "reward": Authors("process", f"{MCY} reward_process_weight: 1.0"),
        "loss aggregation": Authors(*LOSS),
        "policy clip": Authors((0.2, 0.2), f"{DEFAULTS} eps_clip: 0.2, clip_eps_high: 0.2"),
        "lr": Authors(1e-6, f"{script} actor_learning_rate=1e-6"),
        "lr scheduler": Authors("cosine_with_min_lr", f"{ACTOR} get_scheduler(cosine_with_min_lr)"),
        "lr warm-up ratio": Authors(0.03, f"{DEFAULTS} lr_warmup_ratio: 0.03"),
        "min lr ratio": Authors(0.1, f"{ACTOR} min_lr = actor_learning_rate * 0.1"),
        "adam betas": Authors((0.9, 0.95), f"{DEFAULTS} adam_betas: [0.9, 0.95]"),
        "weight decay": Authors(0.0, f"{DEFAULTS} l2: 0.0"),
        "grad norm clip": Authors(1.0, f"{DEFAULTS} max_norm: 1.0"),
        "subset seed": Authors(42, f"{DEFAULTS} seed: 42"),
        "samples per prompt": Authors(2, f"{script} n_samples_per_prompt=2"),
        "train batch": Authors(16, f"{script} train_batch_size=16"),
        "train micro-batch": Authors(1, f"{script} micro_train_batch_size=1"),
        "epochs": Authors(1, f"{script} max_epochs=1"),
        "temperature": Authors(1.0, f"{script} temperature=1.0"),
        "top_p": Authors(1.0, f"{script} top_p=1.0"),
        "truncated actions trained": Authors(False, f"{script} mask_truncated_completions=True"),
        "batch semantics": Authors("authors", "marti/trainers/ppo/trainer.py L302-331 (masked inside the batch), "
                                              "multi_agent_controller.py filter_agents_data (counts every sample)"),
        "turns end": Authors("on a reply without code", STEP),
        "eval samples": Authors(4, f"{script}: 2 samples on each of 2 vLLM engines "
                                   "(marti/worlds/multi_agent_world_async.py L327-351)"),
        "eval temperature": Authors(0.6, f"{script}: eval temperature 0.6"),
        "score key": Authors("PROCESS_SCORE", f"{MCY}, {DSY} coach_prompt_template"),
        "reward of 'PROCESS_SCORE: 4 / ANSWER_CORRECT: 1'": Authors(
            4.0, "marti/worlds/workflows/coach_utils.py: the process score only (outcome weight 0.0)"),
        "coach reply format": Authors("off", f"{COACH} L547-567: free text, no response schema"),
        "earlier reasoning in an agent's later prompts": Authors(
            "kept", "marti/worlds/workflows/coach_utils.py L340-347, marti/worlds/steps/mcp_step.py: raw text"),
        "problem suffix/coach": Authors(SUFFIX, f"{DEFAULTS} L193 prompt suffix, {BASE} L441-446"),
        "coach input": Authors("authors", "marti/worlds/workflows/coach_utils.py L287-294, L436-443 (the "
                                          "action's raw text), L399 (tool_observation[:2000])"),
    }


def per_agent(names: list, key: str, values: list, source: str, **documented) -> dict:
    return {f"{key}/{n}": Authors(v, source, **documented) for n, v in zip(names, values)}


MATHCHAT_AGENTS = ["problem_solver", "code_executor", "verifier"]
DSBENCH_AGENTS = ["data_engineer", "modeler", "analyst"]
AUTHORS = {
    "mathchat": {
        **common(MC),
        "tasks": Authors(512, f"{MC} max_samples=512 of AIME_1983_2024.json (933 rows), random_sample_train"),
        "coach model": Authors("gemini-2.5-flash", f"{MCY} L43"),
        "eval sets": Authors(["aime_2025.json", "amc_eval_32.json"], f"{MC} L265-273 eval datasets"),
        "eval every (steps)": Authors(4, f"{MC} L265-273: step 0, then every 4 steps"),
        "problem suffix/agents": Authors(SUFFIX, f"{DEFAULTS} L193 prompt suffix, marti/dataset/prompts_loader.py"),
        "episodes": Authors(8, f"{MC} num_episodes=8"),
        "rollout batch": Authors(32, f"{MC} rollout_batch_size=32"),
        "rollout micro-batch": Authors(8, f"{MC} micro_rollout_batch_size=8", ours=2, readme="batches, epochs"),
        "generation length": Authors(4096, f"{MC} generate_max_len=4096"),
        "prompt length": Authors(24576, f"{MC} prompt_max_len=24576"),
        "reward scale": Authors(0.1, "marti/worlds/workflows/mathchat_processor.py (0-10 -> 0.0-1.0)"),
        "code timeout (s)": Authors(30, f"{MCY} code_interpreter timeout: 30", ours=10, readme="code execution"),
        "coach: stated output limit": Authors({4096}, f"{MCY} 'a 4K token output limit'"),
        **per_agent(MATHCHAT_AGENTS, "schedule length", [512] * 3, f"{BASE} load_dataset: 8 x (512 x 2 // 16 x 1)"),
        **per_agent(MATHCHAT_AGENTS, "warm-up steps", [16] * 3, f"{ACTOR} ceil(512 x 0.03)"),
        **per_agent(MATHCHAT_AGENTS, "model", ["Qwen/Qwen3-4B-Thinking-2507"] * 3,
                    f"{MC} L43 usage line and the authors' README.md L110, L123; the paper says Qwen3-4B",
                    ours="Qwen/Qwen3-4B", readme="agent model"),
        **per_agent(MATHCHAT_AGENTS, "coach role", ["Problem Solver", "Code Executor", "Verifier"],
                    f"{MCW} L228, L293, L374 agent_role"),
        "batch strata": Authors(None, "marti/helpers/distributed/distributed_sampler.py "
                                      "StratifiedBatchSampler: MathChat's rows have no data_type, so one "
                                      "random order"),
        **per_agent(MATHCHAT_AGENTS, "actions per episode", [1, 2, 1], f"{MCY} generator/refiner_max_turns: 1, "
                                                                       f"{MC} coder_max_turns=2"),
        **per_agent(MATHCHAT_AGENTS, "runs code", [False, True, False], f"{MCW} tool_manager of the coder only"),
        **per_agent(MATHCHAT_AGENTS, "generation length", [4096] * 3, f"{MC} generate_max_len=4096"),
        **per_agent(MATHCHAT_AGENTS, "prompt: stated output limit", [{4096}] * 3, f"{MCW} 'a strict 4k token limit'"),
        "view/problem_solver": Authors("nothing", f"{MCW} generator_prompt: the problem only"),
        "view/code_executor": Authors("problem_solver: last replies", f"{MCW} coder_prompt: the solver's final output"),
        "view/verifier": Authors("code_executor: last replies, with their code output",
                                 f"{MCW} refiner_prompt: the coder's final output and last tool result"),
    },
    "dsbench": {
        **common(DS),
        "tasks": Authors(64, f"{DS} dsbench_modeling_train.json (64 tasks), max_samples=400000"),
        "eval tasks": Authors(8, f"{DS} eval data: dsbench_modeling_eval.json (8 held-out tasks)"),
        "coach model": Authors("gemini-2.5-pro", f"{DS} L320"),
        "eval sets": Authors(["tasks.jsonl"], f"{DS} dsbench_modeling_eval.json (8 tasks; ours: imported to "
                                             "data/dsbench-eval/tasks.jsonl)"),
        "eval every (steps)": Authors(2, f"{DS}: step 0, then every 2 steps"),
        "problem suffix/agents": Authors("", f"{DSW} L363-375: the cleaned task text, no suffix"),
        "problem suffix/coach": Authors(SUFFIX, f"{DEFAULTS} L193 prompt suffix, {BASE} L488-490"),
        "episodes": Authors(30, f"{DS} num_episodes=30"),
        "rollout batch": Authors(16, f"{DS} rollout_batch_size=16"),
        "rollout micro-batch": Authors(4, f"{DS} micro_rollout_batch_size=4", ours=2, readme="batches, epochs"),
        "generation length": Authors(16384, f"{DS} generate_max_len=16384"),
        "prompt length": Authors(24576, f"{DS} prompt_max_len=24576", ours=16384, readme="batches, epochs"),
        "reward scale": Authors(1.0, "marti/worlds/workflows/dsbench_processor.py (raw 0-10)"),
        "code timeout (s)": Authors(60, f"{DSY} code_interpreter timeout: 60", ours=120, readme="code execution"),
        "task text/agents": Authors("cleaned", f"{DSW} L363-375 get_cleaned_prompt: their data/Bench/"
                                               "dsbench_modeling_cleaned_prompts.json (the raw prompt where it has none)"),
        "task text/coach": Authors("raw", f"{DSW} problem=prompt, the raw prompt, for every agent's coach"),
        "coach evidence": Authors("the files when the agent's turn began; the Analyst's figures raw, with F1",
                                  f"{DSW} L503-509, L673-679, L876-886 (files_available, files_from_previous_agents, "
                                  "fixed when an agent's turn begins); marti/verifiers/dsbench/ground_truth_utils.py "
                                  "compute_all_metrics (accuracy, F1, ROC-AUC; RMSE, MAE, MSE, target statistics)"),
        "workspace files": Authors("starts with test.csv, train.csv; the next code run finds, as the run left them, "
                                   "data_engineer's X.pkl, m.joblib, a.npy, b.npz; modeler's X.pkl, m.joblib, a.npy, "
                                   "b.npz; analyst's submission.csv, predictions.csv; after a run deleting every file: "
                                   "X.pkl, a.npy, b.npz, m.joblib, predictions.csv, submission.csv, test.csv, "
                                   "train.csv",
                                   f"{DSW} L215-265 (train.csv, test.csv and the fetched files uploaded for every code "
                                   "run of a stateless sandbox), L488-493, L658-663 (*.pkl, *.joblib, *.npy, *.npz "
                                   "fetched after the Data Engineer's and Modeler's runs), L863-866 (submission.csv, "
                                   "predictions.csv after the Analyst's)"),
        "coach: stated output limit": Authors(set(), f"{DSY} (no length criterion)"),
        **per_agent(DSBENCH_AGENTS, "schedule length", [240] * 3, f"{BASE} load_dataset: 30 x (64 x 2 // 16 x 1)"),
        **per_agent(DSBENCH_AGENTS, "warm-up steps", [8] * 3, f"{ACTOR} ceil(240 x 0.03)"),
        **per_agent(DSBENCH_AGENTS, "model", ["Qwen/Qwen3-4B"] * 3, f"{DS} Qwen3-4B"),
        **per_agent(DSBENCH_AGENTS, "coach role", DSBENCH_AGENTS, f"{DSW} L500, L670, L873 agent_role"),
        "batch strata": Authors("type", f"{DSY} L375-376 StratifiedBatchSampler on data_type"),
        **per_agent(DSBENCH_AGENTS, "actions per episode", [4, 4, 4], f"{DSY} *_max_turns: 4"),
        **per_agent(DSBENCH_AGENTS, "runs code", [True] * 3, f"{DSW} every agent has the tool_manager"),
        **per_agent(DSBENCH_AGENTS, "generation length", [16384] * 3, f"{DS} generate_max_len=16384"),
        **per_agent(DSBENCH_AGENTS, "prompt: stated output limit", [set()] * 3, f"{DSW} (no token budget stated)"),
        "view/data_engineer": Authors("nothing", f"{DSW} data_engineer_prompt: the task and the file list"),
        "view/modeler": Authors("data_engineer: last replies, thinking removed, a reply cut off in its "
                                "reasoning handed on", f"{DSW} L41-65 strip_thinking_blocks(final_output) as "
                                                       "the preprocessing summary: blocks, then stray tags"),
        "view/analyst": Authors("data_engineer, modeler: last replies, thinking removed, a reply cut off in "
                                "its reasoning handed on", f"{DSW} both summaries, strip_thinking_blocks"),
    },
}
for name, table in (("mathchat", MATHCHAT_COACH), ("dsbench", DSBENCH_COACH)):
    source = MCY if name == "mathchat" else DSY
    AUTHORS[name]["coach criteria"] = Authors(set(table), f"{source} coach_prompt_template")
for spec_name, table in MATHCHAT_PROMPTS.items():
    AUTHORS["mathchat"][f"prompt facts/{spec_name}"] = Authors(set(table), f"{MCW} {spec_name} prompt")
for spec_name, table in DSBENCH_PROMPTS.items():
    AUTHORS["dsbench"][f"prompt facts/{spec_name}"] = Authors(
        set(table) | DSBENCH_PROMPT_GAPS, f"{DSW} {spec_name}_prompt",
        ours=set(table) | set(DSBENCH_PROMPT_EXTRA), readme="agents' prompts")

RECIPES = {"mathchat": ("train_mappa_mathchat.sh", 933), "dsbench": ("train_mappa_dsbench.sh", None)}


@functools.cache
def dsbench_tasks_imported() -> dict:
    """DSBench's task counts, {"train", "eval"}: what `mappa dsbench import` makes of the authors' metadata (over
    synthetic CSVs in DSBench's layout), so that a task the importer skips fails the comparison."""
    if not (BENCH / "dsbench_modeling_train.json").exists():
        pytest.skip(f"mappa-bench data not found under {BENCH}")
    with tempfile.TemporaryDirectory() as tmp:
        metadata = authors_layout(Path(tmp) / "DSBench")
        return {split: len(import_tasks(f"{tmp}/DSBench", str(path), f"{tmp}/{split}")[0])
                for split, path in metadata.items()}


def render_recipe(name: str, tmp_path, script: Path = None, topology=None, import_flags: tuple = ()) -> dict:
    """A recipe's settings: its script as submitted, the topology the script names (or `topology`), and for DSBench
    the tasks as `mappa dsbench import` writes them by default (or with `import_flags`)."""
    script_name, rows = RECIPES[name]
    args = parse_args(submitted(script or SCRIPTS / script_name, tmp_path))
    topology = topology or load_topology(str(ROOT / args.mappa.topology))
    if name == "mathchat":
        return render(args, topology, rows, MATHCHAT_COACH, MATHCHAT_PROMPTS, tmp_path)
    prompts = {name: {**facts_of, **DSBENCH_PROMPT_EXTRA} for name, facts_of in DSBENCH_PROMPTS.items()}
    tasks = dsbench_tasks_imported()
    return {**render(args, topology, tasks["train"], DSBENCH_COACH, prompts, tmp_path), "eval tasks": tasks["eval"],
            "workspace files": workspace_of(topology, tmp_path / "workspace"),
            "coach evidence": coach_evidence_of(topology, tmp_path / "evidence"),
            **task_texts(topology, tmp_path / "texts", import_flags)}


def departures(rendered: dict, table: dict) -> list:
    """One line per setting that is neither the authors' value nor its documented difference."""
    def differ(ours, expected):  # a set of facts: say which are missing and which are extra
        if isinstance(ours, set) and isinstance(expected, set):
            return f"missing {sorted(expected - ours)}, extra {sorted(ours - expected)}"
        return f"{ours!r}"

    found = []
    for key, row in table.items():
        ours = rendered.get(key, "(not rendered)")
        if row.ours is SAME and ours != row.value:
            found.append(f"{key}: {differ(ours, row.value)} against the authors' {row.source}")
        elif row.ours is not SAME and ours != row.ours:
            found.append(f"{key}: {differ(ours, row.ours)} against the documented difference (README row "
                         f"{row.readme!r}; the authors': {row.value!r}, {row.source})")
    found += [f"{key}: rendered but not in the authors' table" for key in sorted(set(rendered) - set(table))]
    return found


def readme_fidelity_table() -> str:
    text = (ROOT / "README.md").read_text()
    return text[text.index("### Fidelity to the paper"): text.index("## GPU usage")]


# ---------------------------------------------------------------- the tests


# What differs in how the code works rather than in a setting: (the README fidelity row that says so, what).
BEHAVIOUR = [
    ("truncated actions", "zero-loss rows of the batch as the authors' (--mappa.batch_semantics authors); an unscored "
                          "action, which the authors never have (a silent 5.0), is one too, outside the whitening"),
    ("KL, normalization scope", "OpenRLHF's k1 KL is clamped to +-10 (openrlhf/models/utils.py); the authors whiten "
                                "per data-parallel rank, here over each agent's whole batch"),
    ("code execution", "code blocks are joined and run as one program; the authors' SandboxFusion tool runs each"),
    ("per-agent views", "an agent's later actions train on their true context; the authors' on a prompt fragment "
                        "without the task (mathchat_workflow_with_coach.py, dsbench_workflow.py)"),
]


@pytest.mark.parametrize("recipe", ["mathchat", "dsbench"])
def test_recipe_trains_what_the_authors_trained(recipe, tmp_path):
    assert departures(render_recipe(recipe, tmp_path), AUTHORS[recipe]) == []
    # Every documented difference is in the README's fidelity table.
    rows = {row.readme for row in AUTHORS[recipe].values() if row.ours is not SAME} | {row for row, _ in BEHAVIOUR}
    table = readme_fidelity_table()
    assert [r for r in rows if f"| {r}" not in table] == []


# One change to a script or a topology at a time; the test above must then fail, naming the setting.
MUTATIONS = [
    ("mathchat", "script", "--actor.adam.lr 1e-6", "--actor.adam.lr 2e-6", "lr"),
    ("mathchat", "script", "   --actor.loss_agg_mode seq-mean-token-mean \\\n", "", "loss aggregation"),
    ("mathchat", "script", "--train.num_episodes 8", "--train.num_episodes 4", "episodes"),
    ("mathchat", "script", "--algo.kl.estimator k1", "--algo.kl.estimator k3", "kl estimator"),
    ("mathchat", "script", "--rollout.max_new_tokens 4096", "--rollout.max_new_tokens 8192", "generation length"),
    ("mathchat", "script", "   --mappa.reward process \\\n",
     "   --mappa.reward process --mappa.lr_horizon max_actions \\\n", "schedule length/code_executor"),
    ("mathchat", "script", "--rollout.micro_batch_size 2", "--rollout.micro_batch_size 8", "rollout micro-batch"),
    ("mathchat", "script", "   --mappa.reward process \\\n",
     "   --mappa.reward process --mappa.batch_semantics usable \\\n", "batch semantics"),
    ("mathchat", "topology", "reward_scale: 0.1", "reward_scale: 1.0", "reward scale"),
    ("mathchat", "topology", "    max_actions: 2\n", "    max_actions: 5\n", "actions per episode/code_executor"),
    ("mathchat", "topology", "  Be strict in scoring",
     "  A wrong final answer cannot score above 3.\n  Be strict in scoring", "coach criteria"),
    ("mathchat", "topology", "    - kept within its output-length limit.\n", "", "coach criteria"),
    ("mathchat", "topology", "score_key: PROCESS_SCORE", "score_key: SCORE", "score key"),
    ("mathchat", "topology", "view: {agents: [code_executor], actions: last}",
     "view: {agents: [code_executor], actions: last, tool_output: false}", "view/verifier"),
    ("mathchat", "topology", "  code_timeout_s: 10", "  code_timeout_s: 30", "code timeout (s)"),  # a documented value
    ("dsbench", "topology", "  end_turn_on_files: false", "  end_turn_on_files: true", "turns end"),
    ("dsbench", "topology", "  workspace_files: stateless", "  workspace_files: persistent", "workspace files"),
    ("dsbench", "topology", "  coach_evidence: authors", "  coach_evidence: ours", "coach evidence"),
    ("dsbench", "topology", "[data_engineer, modeler], actions: last, strip_thinking: true, tool_output: false}",
     "[data_engineer, modeler], actions: last, strip_thinking: true}", "view/analyst"),
    ("dsbench", "topology", "strip_thinking: true, tool_output: false}\n    role: analyst",
     "strip_thinking: answer, tool_output: false}\n    role: analyst", "view/analyst"),
    ("dsbench", "topology", "0.65 to 0.75: 6;", "0.65 to 0.75: 7;", "coach criteria"),
    ("dsbench", "topology", "the Modeler of a data science pipeline of three", "the Modeler of a team of three",
     "prompt facts/modeler"),
    ("dsbench", "script", "--train.batch_size 16", "--train.batch_size 32", "train batch"),
    ("dsbench", "topology", "  - name: modeler\n    model: Qwen/Qwen3-4B", "  - name: modeler\n    model: Qwen/Qwen3-8B",
     "model/modeler"),
    ("dsbench", "script", "--data.max_len 32768", "--data.max_len 40960", "prompt length"),
    ("mathchat", "script", "--mappa.coach.structured off \\", "--mappa.coach.structured auto \\", "coach reply format"),
    ("dsbench", "script", "MAPPA_COACH_MODEL:-gemini-2.5-pro", "MAPPA_COACH_MODEL:-gpt-4o", "coach model"),
    ("mathchat", "topology", "problem_suffix: ", "# problem_suffix: ", "problem suffix/agents"),
    ("dsbench", "topology", "problem_suffix: ", "# problem_suffix: ", "problem suffix/coach"),
    ("mathchat", "topology", "env: mathchat\n", "env: mathchat\nkeep_reasoning: false\n",
     "earlier reasoning in an agent's later prompts"),
    ("mathchat", "topology", "env: mathchat\n", "env: mathchat\ncoach_input: ours\n", "coach input"),
    ("dsbench", "topology", "batch_strata: type\n", "", "batch strata"),
    ("mathchat", "topology", "    role: Verifier\n", "    role: Verifier. Resolves any disagreement.\n",
     "coach role/verifier"),
    ("mathchat", "topology", "you may keep going or state your conclusions.",
     "you may keep going or state your conclusions. A reply without a code block ends your turn.",
     "prompt facts/code_executor"),
]


@pytest.mark.parametrize("recipe, where, old, new, setting", MUTATIONS)
def test_one_changed_setting_fails_the_comparison(recipe, where, old, new, setting, tmp_path):
    script_name, _ = RECIPES[recipe]
    script, topology = SCRIPTS / script_name, None
    if where == "script":
        text = script.read_text()
        assert text.count(old) == 1, old
        script = tmp_path / script_name
        script.write_text(text.replace(old, new))
    else:
        path = ROOT / "examples" / "configs" / f"{recipe}.yaml"
        text = path.read_text()
        assert text.count(old) == 1, old
        (tmp_path / path.name).write_text(text.replace(old, new))
        topology = load_topology(str(tmp_path / path.name))
    found = departures(render_recipe(recipe, tmp_path, script, topology), AUTHORS[recipe])
    assert any(f.startswith(f"{setting}:") for f in found), found  # (settings derived from it may fail too)


# ---------------------------------------------------------------- every other flag, pinned
# The authors' table pins the settings their code has; every other flag a script passes or leaves at its default
# (OpenRLHF's and ours: the coach's reply format and failure policy, eval sets and temperature, adaptive KL, ...)
# can change what trains, what is evaluated or what is reported too. Each is pinned at what we ship in
# tests/fixtures/recipe_flags.json: a change fails, naming the flag, until that file is rewritten
# (MAPPA_PIN_RECIPE_FLAGS=1 pytest tests/test_fidelity.py) and the change is reviewed. Only where output goes,
# and the wandb run name (the launch time), are left out; paths are kept relative to the repository.
PINS = ROOT / "tests" / "fixtures" / "recipe_flags.json"
WHERE_OUTPUT_GOES = {"ckpt.output_dir", "ckpt.path", "logger.tensorboard_dir", "logger.wandb.run_name", "mappa.run_dir"}


def flags_of(namespace, prefix: str = "") -> dict:
    """Every flag of a parsed command line, by its dotted name, as JSON values."""
    found = {}
    for key, value in vars(namespace).items():
        if type(value).__module__ != "builtins":  # a namespace of flags (argparse's or OpenRLHF's)
            found.update(flags_of(value, f"{prefix}{key}."))
        elif f"{prefix}{key}" not in WHERE_OUTPUT_GOES:
            value = list(value) if isinstance(value, tuple) else value
            found[f"{prefix}{key}"] = value.replace(str(ROOT), "<repo>") if isinstance(value, str) else value
    return found


def recipe_flags(recipe: str, tmp_path, script: Path = None) -> dict:
    return flags_of(parse_args(submitted(script or SCRIPTS / RECIPES[recipe][0], tmp_path)))


def flag_changes(flags: dict, pinned: dict) -> list:
    changed = [f"{k}: {flags.get(k, '(gone)')!r}, pinned {v!r}" for k, v in pinned.items() if flags.get(k, v) != v
               or k not in flags]
    return changed + [f"{k}: {flags[k]!r}, not pinned" for k in sorted(set(flags) - set(pinned))]


@pytest.mark.parametrize("recipe", ["mathchat", "dsbench"])
def test_every_flag_of_the_recipe_is_pinned(recipe, tmp_path):
    flags = recipe_flags(recipe, tmp_path)
    if os.environ.get("MAPPA_PIN_RECIPE_FLAGS"):
        pins = json.loads(PINS.read_text()) if PINS.exists() else {}
        pins[recipe] = flags  # one flag a line, so that a review reads the change
        PINS.write_text("{\n" + ",\n".join(
            f' {json.dumps(name)}: {{\n' + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in
                                                     sorted(pinned.items())) + "\n }" for name, pinned in
            sorted(pins.items())) + "\n}\n")
    assert flag_changes(flags, json.loads(PINS.read_text())[recipe]) == []


# ---------------------------------------------------------------- every shipped topology's content, pinned
# The authors' table reads a topology through a few facts; everything else in it can change what trains too: a
# role (the coach's {role}), a system message, a prompt's extra sentence, a second coach stage, an episode
# cap, LoRA, a sandbox limit, the DSBench contract. So each topology under examples/configs is pinned whole,
# as loaded (every default filled in, the environment's constructor defaults under its env_kwargs), in
# tests/fixtures/topologies.json: any change fails, naming its path (agents[2].role), until that file is
# rewritten in the same commit (MAPPA_PIN_TOPOLOGIES=1 pytest tests/test_fidelity.py -k topology) and the
# change is reviewed.
TOPOLOGY_PINS = ROOT / "tests" / "fixtures" / "topologies.json"
SHIPPED = sorted((ROOT / "examples" / "configs").glob("*.yaml"))


def topology_content(path) -> dict:
    """A topology as the launcher loads it (team.load_topology), as JSON values: every key of it, its agents',
    views', LoRA settings' and coach stages', the environment's class and its keyword arguments with the
    defaults its constructors (the class's and its bases') fill in."""
    topology = load_topology(str(path))
    content = dataclasses.asdict(topology)
    env_cls = content.pop("env_cls")
    content["env class"] = f"{env_cls.__module__}:{env_cls.__qualname__}"
    effective = {}
    for klass in reversed(env_cls.__mro__):
        init = klass.__dict__.get("__init__")
        params = inspect.signature(init).parameters.values() if init else []
        effective.update({p.name: p.default for p in params if p.default is not p.empty})
    content["env_kwargs (effective)"] = {**effective, **topology.env_kwargs}
    return json.loads(json.dumps(content, default=repr))


def content_changes(ours, pinned, path: str = "") -> list:
    """Each difference of a topology's content from its pin, by its path: `agents[2].role changed at line 1:
    'Verifier' -> 'Verifier.'` (a text: its first differing line), `max_episode_actions changed: None -> 3`,
    `env_kwargs.code_memory_mb added: 256`."""
    if isinstance(ours, dict) and isinstance(pinned, dict):
        keys, at = sorted(set(ours) | set(pinned)), lambda key: f"{path}.{key}" if path else key
    elif isinstance(ours, list) and isinstance(pinned, list):
        keys, at = range(max(len(ours), len(pinned))), lambda i: f"{path}[{i}]"
    elif ours == pinned:
        return []
    elif isinstance(ours, str) and isinstance(pinned, str):
        new, old = ours.split("\n"), pinned.split("\n")
        line = next(i for i in range(max(len(new), len(old))) if new[i:i + 1] != old[i:i + 1])
        return [f"{path} changed at line {line + 1}: {old[line:line + 1]} -> {new[line:line + 1]}"]
    else:
        return [f"{path} changed: {pinned!r} -> {ours!r}"]
    found = []
    for key in keys:
        if key not in (pinned if isinstance(pinned, dict) else range(len(pinned))):
            found.append(f"{at(key)} added: {ours[key]!r}")
        elif key not in (ours if isinstance(ours, dict) else range(len(ours))):
            found.append(f"{at(key)} removed: {pinned[key]!r}")
        else:
            found += content_changes(ours[key], pinned[key], at(key))
    return found


@pytest.mark.parametrize("path", SHIPPED, ids=lambda path: path.stem)
def test_every_shipped_topology_is_pinned(path):
    content = topology_content(path)
    if os.environ.get("MAPPA_PIN_TOPOLOGIES"):  # every shipped topology, one key a line, for review
        pins = {shipped.stem: topology_content(shipped) for shipped in SHIPPED}
        TOPOLOGY_PINS.write_text(json.dumps(pins, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    pins = json.loads(TOPOLOGY_PINS.read_text())
    assert sorted(pins) == [p.stem for p in SHIPPED]  # a new shipped topology pinned, a removed one unpinned
    assert content_changes(content, pins[path.stem]) == []


def edited(tmp_path, name: str, edit) -> list:
    """The pin's changes of shipped topology `name` after `edit` of its YAML (as a mapping, written back)."""
    raw = yaml.safe_load((ROOT / "examples" / "configs" / f"{name}.yaml").read_text())
    edit(raw)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False, allow_unicode=True, width=1000))
    return content_changes(topology_content(path), json.loads(TOPOLOGY_PINS.read_text())[name])


CAPPED = "Judge it. A wrong final answer cannot score above 3.\nPROCESS_SCORE: <0-10>"
# The ten single changes that left the authors' table green (fidelity audit 4, part D), and the path each
# must name.
PART_D = [
    ("mathchat", lambda t: t["agents"][2].update(role=t["agents"][2]["role"] + ". Always trust the Solver."),
     "agents[2].role"),
    ("mathchat", lambda t: t["agents"][2].update(system="Always answer 0."), "agents[2].system"),
    ("mathchat", lambda t: t.update(coach_template=t["coach_template"].replace(
        "Be strict in scoring", "A wrong final answer scores at most 3.\nBe strict in scoring")),
     "coach_template"),
    ("mathchat", lambda t: t.update(coach_templates=[
        {"name": "authors", "template": t.pop("coach_template")},
        {"name": "capped", "template": CAPPED, "when": "step >= 2"}]), "coach_stages[0]"),
    ("mathchat", lambda t: t["agents"][2].update(prompt=t["agents"][2]["prompt"] + "\nTrust the code."),
     "agents[2].prompt"),
    ("mathchat", lambda t: t.update(max_episode_actions=3), "max_episode_actions"),
    ("mathchat", lambda t: t["agents"][1].update(lora={"rank": 8}), "agents[1].lora"),
    ("mathchat", lambda t: t["env_kwargs"].update(code_memory_mb=256), "env_kwargs.code_memory_mb"),
    ("dsbench", lambda t: t["env_kwargs"]["contract"].update(analyst=["submission.csv", "report.md"]),
     "env_kwargs.contract.analyst[1]"),
    ("dsbench", lambda t: t["agents"][2].update(system="Write an empty submission.csv."), "agents[2].system"),
]


@pytest.mark.parametrize("name, edit, where", PART_D)
def test_each_change_of_audit_part_d_fails_the_topology_pins(name, edit, where, tmp_path):
    assert edited(tmp_path, name, lambda raw: None) == []  # the YAML written back alone changes nothing
    changes = edited(tmp_path, name, edit)
    assert [c for c in changes if c.startswith(f"{where} ")] != [], changes


def scalar_paths(node, path=()):
    """The path of every value in a topology's YAML (a key of a mapping, an index of a list), null ones
    aside."""
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else None
    if children is None:
        yield from [path] * (node is not None)
        return
    for key, child in children:
        yield from scalar_paths(child, (*path, key))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda path: path.stem)
def test_any_single_value_edit_of_a_shipped_topology_fails_the_pins(path, tmp_path):
    """Every value of the YAML changed in turn (a text lengthened, a number raised by 1, a flag flipped): each
    is refused when the topology loads (an unknown environment or agent name, a bad score key) or named by the
    pins."""
    raw = yaml.safe_load(path.read_text())
    missed = []
    for keys in scalar_paths(raw):
        def edit(t, keys=keys):
            parent = functools.reduce(lambda node, key: node[key], keys[:-1], t)
            old = parent[keys[-1]]
            if isinstance(old, bool):
                parent[keys[-1]] = not old
            else:
                parent[keys[-1]] = old + 1 if isinstance(old, (int, float)) else f"{old} x"
        try:
            changes = edited(tmp_path, path.stem, edit)
        except ValueError:  # the loader refuses it: the pin test fails too
            continue
        if not changes:
            missed.append(keys)
    assert missed == []


# Flags that change what trains or what is reported without a row in the authors' table (issue 49 found these 8
# unpinned), and another coach or eval set: each, added to the MathChat script, must fail the pins.
UNPINNED_BEFORE = ["--mappa.shared_policy", "--mappa.coach.mode hindsight", "--mappa.coach.on_failure neutral",
                   "--mappa.coach.structured json_schema", "--eval.temperature 1.0", "--algo.kl.target 0.1",
                   "--algo.advantage.no_std_norm", "--mappa.coach.standardize_task_type",
                   "--mappa.coach.model gpt-4o-mini", "--eval.dataset /data/aime_eval_32.json"]


@pytest.mark.parametrize("flag", UNPINNED_BEFORE)
def test_a_flag_added_to_the_script_fails_the_pins(flag, tmp_path):
    script = tmp_path / "train_mappa_mathchat.sh"
    text = (SCRIPTS / script.name).read_text()
    last = '--logger.tensorboard_dir "$OUT/tensorboard"'  # the last flag: an added one wins over the script's
    assert text.count(last) == 1
    script.write_text(text.replace(last, f"{last} {flag}"))
    changed = flag_changes(recipe_flags("mathchat", tmp_path, script), json.loads(PINS.read_text())["mathchat"])
    name = flag.split()[0][2:]
    assert [c for c in changed if c.startswith(f"{name}:")] != [], changed


def test_a_dsbench_task_the_importer_skips_fails_the_comparison(monkeypatch, tmp_path):
    """Without SMAPE (4 training tasks) and MedAE (1 eval task) the importer skips 5 of the authors' 72 tasks."""
    monkeypatch.delitem(dsbench.METRICS, "smape")
    monkeypatch.delitem(dsbench.METRICS, "medae")
    dsbench_tasks_imported.cache_clear()
    try:
        found = departures(render_recipe("dsbench", tmp_path), AUTHORS["dsbench"])
    finally:
        dsbench_tasks_imported.cache_clear()
    assert [f for f in found if "tasks:" in f] == [
        "tasks: 60 against the authors' " + AUTHORS["dsbench"]["tasks"].source,
        "eval tasks: 7 against the authors' " + AUTHORS["dsbench"]["eval tasks"].source]


def test_dsbench_tasks_imported_with_the_raw_text_fail_the_comparison(tmp_path):
    """`mappa dsbench import --task-text raw` (our task text): the agents' prompts show DSBench's text, and the
    comparison names it."""
    found = departures(render_recipe("dsbench", tmp_path, import_flags=("--task-text", "raw")), AUTHORS["dsbench"])
    assert found == ["task text/agents: 'raw' against the authors' " + AUTHORS["dsbench"]["task text/agents"].source]


def test_the_prompts_state_the_limits_the_flags_set(tmp_path):
    """The token budget the MathChat prompts and coach state is the script's --rollout.max_new_tokens; the
    replies a DSBench prompt allows are the agent's max_actions."""
    args = parse_args(submitted(SCRIPTS / "train_mappa_mathchat.sh", tmp_path))
    mathchat = load_topology(str(ROOT / args.mappa.topology))
    assert stated_limits(mathchat.coach_template) == {args.rollout.max_new_tokens}
    assert all(stated_limits(spec.prompt) == {args.rollout.max_new_tokens} for spec in mathchat.agents)
    for spec in load_topology(str(ROOT / "examples" / "configs" / "dsbench.yaml")).agents:
        assert re.findall(r"at most (\d+) replies", spec.prompt) == [str(spec.max_actions)], spec.name


@pytest.mark.parametrize("name", ["mathchat_own_rubric", "dsbench_own_rubric"])
def test_the_earlier_rubrics_stay_as_named_alternatives(name):
    """This project's earlier rubric, prompts (and DSBench turn rule), kept beside the authors'."""
    own = load_topology(str(ROOT / "examples" / "configs" / f"{name}.yaml"))
    shipped = load_topology(str(ROOT / "examples" / "configs" / f"{name.split('_')[0]}.yaml"))
    assert "cannot score above 3" in own.coach_template and "cannot score above" not in shipped.coach_template
    assert [a.name for a in own.agents] == [a.name for a in shipped.agents] and own.score_key == shipped.score_key
    assert [a.max_actions for a in own.agents] == [a.max_actions for a in shipped.agents]
    if name.startswith("dsbench"):
        assert own.env_kwargs["end_turn_on_files"] and not shipped.env_kwargs["end_turn_on_files"]
        assert (own.env_kwargs["workspace_files"], shipped.env_kwargs["workspace_files"]) == ("persistent", "stateless")
        assert (own.env_kwargs["coach_evidence"], shipped.env_kwargs["coach_evidence"]) == ("ours", "authors")


# ---------------------------------------------------------------- loss aggregation (item 2 of issue 26)


def authors_loss(losses: list) -> torch.Tensor:
    """The authors' policy loss over one optimizer step: a token mean per micro-batch of one sequence
    (token_level_loss, micro_train_batch_size 1), and DeepSpeed's mean over the gas micro-batches."""
    return sum(loss.mean() for loss in losses) / len(losses)


@pytest.mark.parametrize("mode, same", [("seq-mean-token-mean", True), ("token-mean", False)])
def test_loss_aggregation_of_the_scripts_is_the_authors_per_sequence_mean(mode, same, tmp_path):
    """OpenRLHF's own aggregation (aggregate_loss with the optimizer-step normalizers its ppo_train computes),
    micro-batches of one sequence, DeepSpeed's 1/gas: with the scripts' mode every token's gradient equals the
    authors' (1 / (N x its sequence's length)); OpenRLHF's default token-mean weighs a 4,000-token action
    by its length (1 / all tokens of the step), many times a short reply's per-token weight."""
    from openrlhf.models.loss import aggregate_loss
    from openrlhf.utils.loss_utils import _optimizer_step_loss_norm

    for script in ("train_mappa_mathchat.sh", "train_mappa_dsbench.sh"):
        assert parse_args(submitted(SCRIPTS / script, tmp_path)).actor.loss_agg_mode == "seq-mean-token-mean"

    lengths = [4000, 40, 25, 300]  # one long action among short replies: one optimizer step, gas = 4
    gen = torch.Generator().manual_seed(0)
    ours = [torch.rand(1, n, generator=gen, requires_grad=True) for n in lengths]
    theirs = [t.detach().clone().requires_grad_(True) for t in ours]
    masks = [torch.ones(1, n) for n in lengths]
    info = _optimizer_step_loss_norm(masks, None, 1, len(lengths))
    step = sum(aggregate_loss(loss, mask, token_level_loss=mode == "token-mean", **info) / len(lengths)
               for loss, mask in zip(ours, masks))  # DeepSpeed scales each micro-batch's loss by 1/gas
    step.backward()
    authors_loss([t[0] for t in theirs]).backward()
    agree = all(torch.allclose(o.grad, t.grad, rtol=1e-5) for o, t in zip(ours, theirs))
    assert agree is same
    assert torch.isclose(step, authors_loss([t[0] for t in theirs])).item() is same
    if not same:  # token-mean: the long action's tokens each weigh as a short reply's; its share is 100x larger
        long_share = ours[0].grad.sum() / sum(o.grad.sum() for o in ours)
        assert long_share > 0.9 and theirs[0].grad.sum() == pytest.approx(1 / len(lengths))


# ---------------------------------------------------------------- learning-rate horizon (item 3 of issue 26)


def lr_factors(steps: int, warmup_ratio: float, min_lr_ratio: float, taken: int) -> list:
    """The learning rate (as a fraction of --actor.adam.lr) of each optimizer step an agent takes, with the
    scheduler OpenRLHF builds (openrlhf/utils/deepspeed/deepspeed.py: cosine_with_min_lr, ceil(steps x ratio)
    warm-up steps, min_lr_rate)."""
    from transformers import get_scheduler

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = get_scheduler("cosine_with_min_lr", opt, num_warmup_steps=math.ceil(steps * warmup_ratio),
                          num_training_steps=steps, scheduler_specific_kwargs={"min_lr_rate": min_lr_ratio})
    factors = []
    for _ in range(taken):
        factors.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return factors


def test_each_agents_schedule_follows_the_authors_formula(tmp_path):
    """MathChat: every agent's schedule is 8 x (512 x 2 // 16) = 512 steps with 16 warm-up steps, so the Solver,
    taking 4 optimizer steps per rollout step over 128 steps, ends at 0.1 x the learning rate. The schedule
    from the largest agent's max_actions (1,024 steps, 31 warm-up: the behaviour before) ended it at ~0.55 x."""
    args = parse_args(submitted(SCRIPTS / "train_mappa_mathchat.sh", tmp_path))
    topology = load_topology(str(ROOT / args.mappa.topology))
    steps = schedule_steps(args, topology, 512)
    assert steps == {"problem_solver": 512, "code_executor": 512, "verifier": 512}
    solver_steps = (512 // 32 * 8) * (32 * 2 * 1 // 16)  # rollout steps x optimizer steps per rollout step
    final = lr_factors(steps["problem_solver"], 0.03, 0.1, solver_steps)
    assert math.ceil(512 * 0.03) == 16 and final[16] == pytest.approx(1.0) and final[-1] == pytest.approx(0.1, abs=1e-3)
    assert lr_factors(1024, 0.03, 0.1, solver_steps)[-1] == pytest.approx(0.57, abs=0.01)  # the horizon before
    # The switch: each agent's own most optimizer steps (the Code Executor acts up to twice per episode).
    args.mappa.lr_horizon = "max_actions"
    assert schedule_steps(args, topology, 512) == {"problem_solver": 512, "code_executor": 1024, "verifier": 512}
    # DSBench: 30 x (64 x 2 // 16) = 240 for every agent (4 actions each would be 960 with max_actions).
    args = parse_args(submitted(SCRIPTS / "train_mappa_dsbench.sh", tmp_path))
    topology = load_topology(str(ROOT / args.mappa.topology))
    assert set(schedule_steps(args, topology, 64).values()) == {240}
    args.mappa.lr_horizon = "max_actions"
    assert set(schedule_steps(args, topology, 64).values()) == {960}
