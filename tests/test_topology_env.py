"""Topology YAML, task files, the local code runner and a scripted MathChat episode (no model, no GPU)."""

import asyncio
import functools
import inspect
import json
import os
import re
import textwrap
import time
from pathlib import Path

import pytest

from openrlhf_mappa.envs import load_env_class
from openrlhf_mappa.envs.base import HistoryEntry, MultiAgentEnv, StepResult, load_tasks
from openrlhf_mappa.envs.mathchat import MathChatEnv, answers_match, extract_boxed
from openrlhf_mappa.episode import Verdict
from openrlhf_mappa.rollout import AgentPolicy, SyncGate, run_episode
from openrlhf_mappa.run_log import behaviour_metrics
from openrlhf_mappa.sandbox import extract_code, run_python
from openrlhf_mappa.team import load_topology, play
from openrlhf_mappa.topology import AgentSpec, Topology

ROOT = Path(__file__).resolve().parents[1]
MATHCHAT_YAML = ROOT / "examples" / "configs" / "mathchat.yaml"
TINY_MATH = ROOT / "examples" / "data" / "tiny_math.jsonl"
BENCH = Path(os.environ.get("MAPPA_BENCH_DIR", ROOT.parent / "shared" / "data" / "mappa-bench"))

GOOD_AGENT = {"name": "solver", "model": "m", "role": "solves", "prompt": "Solve: {task}\n{history}"}
CHECKER = {"name": "checker", "model": "m", "role": "checks", "prompt": "Check: {task}\n{history}"}


def write_topology(tmp_path, **overrides):
    raw = {"name": "t", "env": "mathchat", "agents": [dict(GOOD_AGENT)], "coach_template": "{task} {agent_output} PROCESS_SCORE:"}
    raw.update(overrides)
    path = tmp_path / "topo.yaml"
    path.write_text(json.dumps(raw))  # JSON is valid YAML
    return str(path)


# ---------------------------------------------------------------- topology


def test_mathchat_yaml_loads():
    topo = load_topology(str(MATHCHAT_YAML))
    assert [a.name for a in topo.agents] == ["problem_solver", "code_executor", "verifier"]
    assert [a.max_actions for a in topo.agents] == [1, 2, 1]
    assert [a.runs_code for a in topo.agents] == [False, True, False]
    assert all(a.model == "Qwen/Qwen3-4B" for a in topo.agents)
    assert topo.env_cls is MathChatEnv
    # What the authors' coach is shown of each action (mathchat_with_coach.yaml), and nothing less.
    for field in ("task", "role", "agent_input", "agent_output", "feedback", "ground_truth"):
        assert "{" + field + "}" in topo.coach_template
    assert topo.score_key == "PROCESS_SCORE"
    for agent in topo.agents:  # templates fill without KeyError/IndexError
        agent.prompt.format(task="T", history="H")


@pytest.mark.parametrize("name", ["mathchat", "dsbench", "debate"])
def test_example_coach_templates_end_with_the_score_line(name):
    topo = load_topology(str(ROOT / "examples" / "configs" / f"{name}.yaml"))
    assert topo.score_key == "PROCESS_SCORE"
    # MathChat's is followed by the authors' second key, ANSWER_CORRECT (asked, never a score: coach.parse_score).
    last = topo.coach_template.removesuffix("\nANSWER_CORRECT: <1 or 0, only when a reference answer is given>")
    assert last.endswith("\nPROCESS_SCORE: <integer from 0 to 10>") and (last != topo.coach_template) == (name == "mathchat")


def test_score_key_is_read_and_a_template_without_it_is_warned_about(tmp_path, caplog):
    topo = load_topology(write_topology(tmp_path, score_key="GRADE", coach_template="{agent_output}\nGRADE: <0-10>"))
    assert topo.score_key == "GRADE" and not caplog.records
    path = write_topology(tmp_path, score_key="GRADE")  # the default template asks for PROCESS_SCORE
    assert load_topology(path).score_key == "GRADE"
    assert f"{path}: coach_template never names the score key GRADE" in caplog.text


def test_problem_suffix_ends_every_task_and_a_backslash_slip_is_refused(tmp_path):
    """The suffix follows the task's prompt wherever the task is shown (env.task_text: the agents' {task}, the
    coach's); none by default. In a double-quoted YAML (or JSON) string \\b is a backspace: refused, with the fix."""
    assert load_topology(write_topology(tmp_path)).problem_suffix == ""
    topology = load_topology(write_topology(tmp_path, problem_suffix="\n\nBox it: \\boxed{}."))
    env = topology.make_env({"id": "1", "prompt": "What is 2 + 2?", "answer": "4"}, str(tmp_path / "ws"))
    assert env.task_text == "What is 2 + 2?\n\nBox it: \\boxed{}."
    assert env.observe(topology.agents[0], 0)[-1]["content"].startswith("Solve: What is 2 + 2?\n\nBox it: \\boxed{}.")
    path = tmp_path / "topo.yaml"
    path.write_text(path.read_text().replace("\\\\boxed", "\\boxed"))  # "\boxed": a backspace, then "oxed"
    with pytest.raises(ValueError, match=r"'problem_suffix' holds the control character\(s\) '\\x08'; in a "
                                         r"double-quoted YAML string a backslash is written \\\\"):
        load_topology(str(path))


def test_model_override_replaces_every_model(tmp_path):
    topo = load_topology(str(MATHCHAT_YAML), model_override="tiny/model")
    assert {a.model for a in topo.agents} == {"tiny/model"}
    agent = {k: v for k, v in GOOD_AGENT.items() if k != "model"}
    assert load_topology(write_topology(tmp_path, agents=[agent]), model_override="x").agents[0].model == "x"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"agentz": []}, "unknown key(s) ['agentz']; allowed top-level keys: name, env, agents"),
        ({"agents": [dict(GOOD_AGENT, temperature=1)]}, "unknown key(s) ['temperature']; allowed agent keys"),
        ({"agents": [{k: v for k, v in GOOD_AGENT.items() if k != "model"}]}, "'model' is missing or empty"),
        ({"agents": [GOOD_AGENT, GOOD_AGENT]}, "agent name(s) ['solver'] used more than once"),
        ({"agents": []}, "'agents' must be a non-empty list"),
        ({"agents": [dict(GOOD_AGENT, max_actions=0)]}, "'max_actions' must be an integer >= 1, got 0"),
        ({"agents": [dict(GOOD_AGENT, name="a b")]},
         "agent 'a b': 'name' must be a word of letters, digits, '_' and '-' (names become paths and metric keys), got 'a b'"),
        ({"agents": [dict(GOOD_AGENT, role=" ")]}, "agent 'solver': 'role' is missing or empty; it must be a non-empty string"),
        ({"agents": [dict(GOOD_AGENT, system=None)]}, "agent 'solver': 'system' must be a string, got None"),
        ({"agents": [dict(GOOD_AGENT, max_actions=True)]}, "'max_actions' must be an integer >= 1, got True"),
        ({"agents": [dict(GOOD_AGENT, prompt="{task} {answer}")]}, "unknown field {answer}"),
        ({"agents": [dict(GOOD_AGENT, prompt="\\boxed{}")]}, "unknown field {}"),
        ({"agents": [dict(GOOD_AGENT, runs_code="yes")]}, "'runs_code' must be true or false"),
        ({"agents": [dict(GOOD_AGENT, vllm_num_engines=0)]}, "'vllm_num_engines' must be a positive integer"),
        ({"env": "no_such_pkg.mod:Env"}, "cannot import module 'no_such_pkg.mod'"),
        ({"env": "openrlhf_mappa.envs.mathchat:Nope"}, "has no class 'Nope'"),
        ({"env": "nocolon"}, "expected 'package.module:Class'"),
        ({"coach_template": ""}, "'coach_template' must be a non-empty string (or give coach_templates), got ''"),
        ({"coach_template": "{task} {score}"}, "coach_template: unknown field {score}"),
        ({"review_template": "{trajectory} {agent_output}"}, "review_template: unknown field {agent_output}; allowed fields: task"),
        ({"review_template": "  "}, "'review_template' must be a non-empty string"),
        ({"env_kwargs": {"code_timeout": 3}}, "env_kwargs do not fit mathchat"),
        ({"score_key": "PROCESS SCORE"}, "'score_key' must be a word of letters, digits and '_'"),
        ({"score_key": "SCORE:"}, "'score_key' must be a word"),
        ({"score_key": 7}, "'score_key' must be a word"),
        ({"score_key": ""}, "'score_key' must be a word"),
        ({"problem_suffix": ["Please reason step by step."]}, "'problem_suffix' must be a string (text added after"),
        ({"keep_reasoning": "yes"}, "'keep_reasoning' must be true (an agent's earlier replies as generated, reasoning"),
        # views: agents act once each, in order, so a view names only agents listed before it
        ({"agents": [dict(GOOD_AGENT, view="previous")]}, "agent 'solver': view: 'previous' names nobody: this is the first"),
        ({"agents": [GOOD_AGENT, dict(CHECKER, view=["solvr"])]}, "view: unknown agent 'solvr'; the agents are solver, checker"),
        ({"agents": [GOOD_AGENT, dict(CHECKER, view=["checker"])]}, "agent 'checker': view: names the agent itself"),
        ({"agents": [dict(GOOD_AGENT, view=["checker"]), CHECKER]}, "view: names 'checker', which acts after it"),
        ({"agents": [GOOD_AGENT, dict(CHECKER, view="everyone")]}, "'agents' must be all, previous or a list of agent names"),
        ({"agents": [GOOD_AGENT, dict(CHECKER, view={"agent": "all"})]}, "view: unknown key(s) ['agent']; allowed: agents"),
        ({"agents": [GOOD_AGENT, dict(CHECKER, view={"actions": "first"})]}, "'actions' must be all or last"),
        ({"agents": [GOOD_AGENT, dict(CHECKER, view={"tool_output": "no"})]}, "'tool_output' must be true or false"),
        # LoRA adapters: a rank vLLM's engines cannot serve, and a pool whose agents need two engines
        ({"agents": [dict(GOOD_AGENT, lora={"rank": 1024})]},
         "agent 'solver': lora: rank 1024 is larger than vLLM's engines serve (max_lora_rank at most 512)"),
        ({"agents": [dict(GOOD_AGENT, lora={"alpha": 16})]}, "agent 'solver': lora: 'rank' is missing or empty; it must be an integer >= 1"),
        ({"agents": [dict(GOOD_AGENT, lora={"rank": 0})]}, "agent 'solver': lora: 'rank' must be an integer >= 1, got 0"),
        ({"agents": [dict(GOOD_AGENT, lora={"rank": 8, "alpha": 0})]}, "'alpha' must be a positive number (the update is scaled by alpha / rank), got 0"),
        ({"agents": [dict(GOOD_AGENT, lora={"rank": 8, "dropout": "0.1"})]}, "lora: 'dropout' must be a number in [0, 1), got '0.1'"),
        ({"agents": [dict(GOOD_AGENT, lora={"rank": 8, "pool": "a/b"})]}, "lora: 'pool' must be a word of letters, digits, '_' and '-', got 'a/b'"),
        ({"agents": [dict(GOOD_AGENT, lora=8)]}, "lora must be a mapping with keys rank, alpha, target_modules, dropout, pool"),
        ({"agents": [dict(GOOD_AGENT, lora={"rank": 8, "r": 8})]}, "lora: unknown key(s) ['r']; allowed: rank, alpha"),
        ({"agents": [dict(GOOD_AGENT, lora={"rank": 8, "dropout": 1.5})]}, "lora: 'dropout' must be a number in [0, 1), got 1.5"),
        ({"agents": [dict(GOOD_AGENT, lora={"rank": 8, "target_modules": ["all-linear", "q_proj"]})]},
         "'target_modules' is either all-linear or a list of module names, not both"),
        ({"agents": [dict(GOOD_AGENT, lora={"rank": 8, "pool": "p"}), dict(CHECKER, model="other", lora={"rank": 8, "pool": "p"})]},
         "LoRA engine pool 'p': its agents differ in base model: solver (m), checker (other). One pool's engines serve one "
         "base model with every member's adapter; give them the same base model, or different lora.pool names"),
        ({"agents": [dict(GOOD_AGENT, lora={"rank": 8}), dict(CHECKER, vllm_num_engines=2, lora={"rank": 8})]},
         "LoRA engine pool 'm': its agents differ in vllm_num_engines: solver (None), checker (2)"),
    ],
)
def test_bad_topology_messages(tmp_path, overrides, message):
    path = write_topology(tmp_path, **overrides)
    with pytest.raises(ValueError) as err:
        load_topology(path)
    assert str(err.value).startswith(path + ": ")
    assert message in str(err.value)


def test_independent_mistakes_are_named_together_in_one_refusal(tmp_path):
    """Every problem of a file in one refusal, a line each naming the file: a fix-and-rerun loop per typo is gone.
    A rule reading a value runs only once that value passed: the unreadable agent's view is not looked at."""
    path = write_topology(tmp_path, reward_scale=0, review_template="{agent_output}", keep_reasoning="yes",
                          agents=[dict(GOOD_AGENT, max_actions=0, view="previous"),
                                  dict(CHECKER, lora={"rank": 1024, "dropout": 2}, view=["solvr"])])
    with pytest.raises(ValueError) as err:
        load_topology(path)
    assert str(err.value).split("\n") == [f"{path}: {problem}" for problem in (
        "'reward_scale' must be a positive number (1.0: coach scores as given), got 0",
        "'keep_reasoning' must be true (an agent's earlier replies as generated, reasoning included) or false (as its "
        "chat template renders them), got 'yes'",
        "agent 'solver': 'max_actions' must be an integer >= 1, got 0",
        "agent 'checker': lora: 'dropout' must be a number in [0, 1), got 2",
    )]
    # The same agents read: the rules across them (views, the rank vLLM serves) now run too.
    path = write_topology(tmp_path, review_template="{agent_output}",
                          agents=[dict(GOOD_AGENT, view="previous"), dict(CHECKER, lora={"rank": 1024}, view=["solvr"])])
    with pytest.raises(ValueError) as err:
        load_topology(path)
    assert str(err.value).split("\n") == [f"{path}: {problem}" for problem in (
        "agent 'checker': lora: rank 1024 is larger than vLLM's engines serve (max_lora_rank at most 512)",
        "agent 'solver': view: 'previous' names nobody: this is the first agent (write [] to show no other agent)",
        "agent 'checker': view: unknown agent 'solvr'; the agents are solver, checker",
        "review_template: unknown field {agent_output}; allowed fields: task, task_type, trajectory, outcome, "
        "num_actions (write {{ and }} for literal braces, e.g. \\boxed{{}})",
    )]


def test_lora_agents_share_a_pool_per_base_model_and_targets_are_checked(tmp_path):
    from openrlhf_mappa.team import check_lora

    qwen3 = os.path.join(os.path.dirname(__file__), "fixtures", "qwen3-4b")  # config.json only: no weights read
    agents = [dict(GOOD_AGENT, model=qwen3, lora={"rank": 8, "target_modules": ["q_proj", "v_proj"]}),
              dict(CHECKER, model=qwen3, lora={"rank": 16}), dict(CHECKER, name="full", model=qwen3)]
    topology = load_topology(write_topology(tmp_path, agents=agents))
    solver, checker, full = topology.agents
    assert (solver.lora.rank, solver.lora.alpha, solver.lora.target_modules, solver.lora.dropout) == (8, 16.0, ("q_proj", "v_proj"), 0.0)
    assert checker.lora.target_modules == ("all-linear",) and checker.lora.alpha == 32.0  # defaults: all-linear, 2 x rank
    assert solver.pool == checker.pool == qwen3 and full.pool is None and full.lora is None
    for spec in topology.agents:
        check_lora(spec, f"agent {spec.name!r}")  # targets that exist pass
    bad = load_topology(write_topology(tmp_path, agents=[dict(GOOD_AGENT, model=qwen3, lora={"rank": 8, "target_modules": ["q_proj", "qkv_proj"]})]))
    with pytest.raises(ValueError) as err:
        check_lora(bad.agents[0], "agent 'solver'")
    assert str(err.value) == (f"agent 'solver': lora target_modules ['qkv_proj'] are not linear layers of {qwen3} (qwen3); its "
                              f"linear layers: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj, lm_head (or all-linear)")


def test_coach_template_is_required_only_where_a_coach_is_sent_it(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(yaml_text := "env: mathchat\nagents:\n  - {name: a, model: m, role: r, prompt: '{task}'}\n")
    assert "coach_template" not in yaml_text
    topology = load_topology(str(path))  # read apart from the flags: nothing says yet whether a coach reads it
    assert topology.coach_template is None
    # Never sent: a hindsight review (review_template only), the heuristic coach, an outcome run not scored.
    for kind, mode, scored in (("openai", "hindsight", True), ("heuristic", "per_action", True),
                               ("openai", "per_action", False)):
        topology.check_coach_template(str(path), kind, mode, scored)
    # Sent with every action: refused, naming the file and the mode that sends it.
    for mode in ("per_action", "both"):
        with pytest.raises(ValueError) as err:
            topology.check_coach_template(str(path), "openai", mode)
        assert str(err.value).startswith(f"{path}: 'coach_template' is missing or empty; it must be a non-empty "
                                         f"string (or give coach_templates): coach mode {mode} sends it")
    given = load_topology(write_topology(tmp_path))
    given.check_coach_template("topo.yaml", "openai", "per_action")  # given: accepted in every mode
    assert given.coach_template == "{task} {agent_output} PROCESS_SCORE:"


KWARGS_ENVS = """
from openrlhf_mappa.envs.mathchat import MathChatEnv


class LevelEnv(MathChatEnv):  # its **kwargs go on to MultiAgentEnv (MathChatEnv has no __init__ of its own)
    def __init__(self, topology, task, workspace, level=1, **kwargs):
        super().__init__(topology, task, workspace, **kwargs)
        self.level = level


class Logged:  # a mixin that passes everything on
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)


class LoggedLevelEnv(Logged, LevelEnv):
    pass


class NotAnEnv:  # no MultiAgentEnv: refused by name, not by its constructor
    def __init__(self, topology, task, workspace, **options):
        self.options = options
"""
SANDBOX_KEYS = "code_timeout_s, code_memory_mb, code_cpu_time_s, code_max_file_mb, code_max_processes, sandbox_url"


def test_env_kwargs_through_kwargs_are_checked_against_the_constructors_they_reach(tmp_path, monkeypatch):
    (tmp_path / "kwargs_envs.py").write_text(KWARGS_ENVS)
    monkeypatch.syspath_prepend(str(tmp_path))

    def refusal(env, **env_kwargs):
        path = write_topology(tmp_path, env=env, env_kwargs=env_kwargs)
        with pytest.raises(ValueError) as err:
            load_topology(path)
        return str(err.value).removeprefix(f"{path}: ")

    assert refusal("kwargs_envs:LevelEnv", levle=2) == (
        "env_kwargs do not fit kwargs_envs:LevelEnv: unknown key(s) 'levle' (did you mean 'level'?); LevelEnv takes "
        f"level, {SANDBOX_KEYS} (the __init__ of LevelEnv and, through **kwargs, of MultiAgentEnv)")
    assert refusal("kwargs_envs:LoggedLevelEnv", level=2, code_timout_s=5, colour="red") == (
        "env_kwargs do not fit kwargs_envs:LoggedLevelEnv: unknown key(s) 'code_timout_s' (did you mean "
        f"'code_timeout_s'?), 'colour'; LoggedLevelEnv takes level, {SANDBOX_KEYS} (the __init__ of Logged and, "
        "through **kwargs, of LevelEnv, MultiAgentEnv)")
    # The built-in relay env takes **kwargs too: a misspelt sandbox limit no longer passes.
    assert "unknown key(s) 'code_timout_s' (did you mean 'code_timeout_s'?); RelayEnv takes goals, " in refusal(
        "relay", goals={"solver": "x"}, code_timout_s=5)
    assert refusal("relay", code_timeout_s=5) == "env_kwargs do not fit relay: missing a required argument: 'goals'"

    # Keys some constructor of the chain names pass, and reach it.
    topology = load_topology(write_topology(tmp_path, env="kwargs_envs:LoggedLevelEnv",
                                            env_kwargs={"level": 2, "code_timeout_s": 5}))
    env = topology.make_env({"prompt": "1 + 1?", "answer": "2"}, str(tmp_path))
    assert (env.level, env.code_timeout_s) == (2, 5)
    # Every chain ends at MultiAgentEnv's constructor: a class that is none is refused as such.
    assert refusal("kwargs_envs:NotAnEnv", colour="red") == (
        "env 'kwargs_envs:NotAnEnv': kwargs_envs.NotAnEnv is not a MultiAgentEnv subclass; write it as class "
        "NotAnEnv(openrlhf_mappa.envs.base.MultiAgentEnv) (docs/reference.md, \"Your own environment\")")


def test_reward_scale_is_a_positive_number_set_per_pipeline(tmp_path):
    # Catches the old topology, which had no reward_scale (an unknown key), so MathChat's coach scores trained
    # raw; the example configs now carry the authors' scales: MathChat 0-10 -> 0-1, DSBench as given.
    assert load_topology(str(MATHCHAT_YAML)).reward_scale == 0.1
    assert load_topology(str(ROOT / "examples" / "configs" / "dsbench.yaml")).reward_scale == 1.0
    assert load_topology(write_topology(tmp_path)).reward_scale == 1.0  # left out: scores as given
    assert load_topology(write_topology(tmp_path, reward_scale=2)).reward_scale == 2.0
    for bad in (0, -0.1, "0.1", True, None):
        with pytest.raises(ValueError, match="'reward_scale' must be a positive number"):
            load_topology(write_topology(tmp_path, reward_scale=bad))


def test_load_env_class_builtin_and_dotted():
    assert load_env_class("mathchat") is MathChatEnv
    assert load_env_class("openrlhf_mappa.envs.base:MultiAgentEnv") is MultiAgentEnv


# ---------------------------------------------------------------- tasks


def test_tiny_math_tasks():
    tasks = load_tasks(str(TINY_MATH))
    assert len(tasks) == 16
    assert all(t["type"] == "math" and t["answer"].isdigit() and t["prompt"] for t in tasks)
    assert len({t["id"] for t in tasks}) == 16


def test_load_tasks_normalizes_answers_and_ids(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps([{"prompt": "a", "answer": 18.0}, {"prompt": "b", "answer": 0.5, "id": 7},
                                {"prompt": "c", "answer": 3, "type": "x", "extra": 1}]))  # fmt: skip
    tasks = load_tasks(str(path))
    assert [t["answer"] for t in tasks] == ["18", "0.5", "3"]
    assert [t["id"] for t in tasks] == ["0", "7", "2"]
    assert [t["type"] for t in tasks] == ["", "", "x"] and tasks[2]["extra"] == 1


@pytest.mark.parametrize(
    "lines, where, message",
    [
        (['{"prompt": "a", "answer": 1}', '{"answer": 2}'], "line 2", "missing 'prompt'"),
        (['{"prompt": "a", "answer": 1}', "", '{"prompt": "  ", "answer": 2}'], "line 3", "empty 'prompt'"),
        (['{"prompt": 5, "answer": 1}'], "line 1", "'prompt' must be a string, got int"),
        (['{"prompt": "a", "answer": [1]}'], "line 1", "'answer' must be a string or a number, got list"),
        (['{"prompt": "a", "answer": null}'], "line 1", "'answer' is missing or null"),
        (['{"prompt": "a", "answer": 1}', '{"prompt": "b", "answer": 1'], "line 2", "broken JSON"),
        (['[1, 2]'], "row 0", "a task must be a JSON object"),
    ],
)
def test_load_tasks_bad_rows(tmp_path, lines, where, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as err:
        load_tasks(str(path))
    assert str(err.value).startswith(f"{path}: {where}")
    assert message in str(err.value)


def test_a_rows_problems_and_the_sandbox_limits_are_named_together(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "answer": 1}\n{"prompt": 5, "answer": null, "id": [2]}\n')
    with pytest.raises(ValueError) as err:
        load_tasks(str(path))
    assert str(err.value).split("\n") == [f"{path}: line 2: {problem}" for problem in (
        "'prompt' must be a string, got int",
        "'answer' is missing or null; these tasks need a reference answer (string or number)",
        "'id' must be a string or a number, got list")]
    topology = load_topology(write_topology(tmp_path, env_kwargs={"code_memory_mb": 0, "sandbox_url": "localhost"}))
    with pytest.raises(ValueError) as err:
        topology.make_env({"id": "1", "prompt": "1 + 1?", "answer": "2"}, str(tmp_path))
    assert str(err.value) == ("env_kwargs code_memory_mb must be a positive integer, got 0; env_kwargs sandbox_url must "
                              "be the http(s) URL of a SandboxFusion service, got 'localhost'")


def test_load_tasks_names_the_line_of_a_byte_that_is_not_utf8(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": 1}\n\n{"prompt": "caf\xe9", "answer": 2}\n')
    with pytest.raises(ValueError) as err:
        load_tasks(str(path))
    assert str(err.value) == f"{path}: line 3: byte 0xe9 is not UTF-8; save the file as UTF-8"
    path.write_bytes(b'\xef\xbb\xbf[{"prompt": "caf\xc3\xa9", "answer": 1}]')  # UTF-8 with a byte-order mark
    assert load_tasks(str(path))[0]["prompt"] == "caf\u00e9"


def test_load_tasks_bad_json_list_row(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}, {"prompt": ""}]))
    with pytest.raises(ValueError, match=r"bad\.json: row 2 .*empty 'prompt'"):
        load_tasks(str(path))


@pytest.mark.parametrize("name, rows", [("AIME_1983_2024.json", 933), ("amc.json", 117)])
def test_load_shared_benchmark(name, rows):
    path = BENCH / name
    if not path.exists():
        pytest.skip(f"{path} not present (mappa-bench data is not part of the repo; set MAPPA_BENCH_DIR)")
    tasks = load_tasks(str(path))
    assert len(tasks) == rows
    assert all(isinstance(t["answer"], str) and t["answer"] for t in tasks)
    assert not any(t["answer"].endswith(".0") for t in tasks)


def test_dsbench_rows_are_rejected_clearly():
    path = BENCH / "dsbench_modeling_train.json"
    if not path.exists():
        pytest.skip(f"{path} not present")
    with pytest.raises(ValueError, match="line 1: 'answer' is missing or null"):
        load_tasks(str(path))


# ---------------------------------------------------------------- sandbox


def test_run_python_captures_output_and_files(tmp_path):
    code = "import sys\nprint('hi')\nprint('oops', file=sys.stderr)\nopen('out.txt', 'w').write('x')\nsys.exit(3)"
    fb = run_python(code, str(tmp_path))
    assert fb.stdout == "hi\n" and fb.stderr == "oops\n"
    assert fb.exit_code == 3 and not fb.timed_out and fb.error
    assert fb.files == ["out.txt"]  # the script itself is not listed


def test_run_python_truncates_long_output(tmp_path):
    fb = run_python("print('a' * 5000 + 'END')", str(tmp_path), max_output_chars=100)
    assert len(fb.stdout) < 200 and "characters cut" in fb.stdout
    assert fb.stdout.rstrip().endswith("END")


def test_run_python_hides_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-hidden")
    monkeypatch.setenv("HF_TOKEN", "hf-hidden")
    monkeypatch.setenv("MAPPA_VISIBLE", "yes")
    code = "import os\nprint(sorted(k for k, v in os.environ.items() if 'hidden' in v or k == 'MAPPA_VISIBLE'))"
    assert run_python(code, str(tmp_path)).stdout.strip() == "['MAPPA_VISIBLE']"


def test_run_python_timeout_kills_process_group(tmp_path):
    # The child, in a session of its own, beats into a file; after the timeout the beats must stop. (Its pid
    # is no use: the sandbox gives the code its own pid namespace, so the numbers it sees are not the host's.)
    code = textwrap.dedent("""
        import subprocess, sys
        beat = "import time\\nwhile True:\\n    open('beats', 'a').write('.')\\n    time.sleep(0.02)"
        child = subprocess.Popen([sys.executable, "-c", beat], start_new_session=True)  # out of the group
        print("started", flush=True)
        while True:
            pass
    """)
    fb = run_python(code, str(tmp_path), timeout_s=3.0)  # room for the sandbox to start on a busy machine
    assert fb.timed_out and fb.error and fb.stdout == "started\n"
    beats = (tmp_path / "beats").stat().st_size
    time.sleep(0.5)
    assert beats > 0 and (tmp_path / "beats").stat().st_size == beats, "the code's child process survived the timeout"


def test_extract_code():
    reply = "Plan.\n```python\nx = 1\n```\ntext\n```python\nprint(x)\n```\n```bash\nls\n```"
    assert extract_code(reply) == "x = 1\n\nprint(x)\n"
    assert extract_code("no code here") is None
    assert extract_code("```\nprint(1)\n```") is None  # unlabeled fences are not run
    assert extract_code("```python\nprint(1)") is None  # cut off by the token limit


# ---------------------------------------------------------------- MathChat episode


TASK = {"id": "t1", "prompt": "Tom has 3 boxes of 4 apples and eats 2. How many apples are left?", "answer": "10"}


def scripted_replies(final_answer):
    return {
        "problem_solver": ["3 boxes of 4 apples is 12; eating 2 leaves 10."],
        "code_executor": ["Checking:\n```python\nprint(3 * 4 - 2)\n```", "The program printed 10, as expected."],
        "verifier": [f"Both agree. The answer is \\boxed{{{final_answer}}}."],
    }


def test_scripted_mathchat_episode_succeeds(tmp_path):
    topo = load_topology(str(MATHCHAT_YAML), model_override="tiny")
    replies = scripted_replies("10")
    played = play(topo, dict(TASK), lambda name, turn: replies[name][turn], str(tmp_path))
    env, seen = played.env, played.actions
    assert env.task_type == "math" and env.code_timeout_s == 10
    assert [(a.agent, a.turn, a.round) for a in seen] == [
        ("problem_solver", 0, 0), ("code_executor", 0, 1), ("code_executor", 1, 2), ("verifier", 0, 3),
    ]  # fmt: skip
    code_result = seen[1].result
    assert code_result.feedback.stdout == "10\n" and code_result.feedback.exit_code == 0 and not code_result.done
    assert seen[2].result.done and not seen[2].result.feedback.ran  # no code block: the executor is finished
    # What each agent saw (the authors' MathChat): the Solver the problem; the Executor the problem and the
    # Solver's draft, then its own first code and that code's output as chat turns; the Verifier the
    # Executor's final reply and its last code run, not the Solver's draft.
    solver_msgs, first_look, second_look, verifier_msgs = (a.messages for a in seen)
    assert solver_msgs == [{"role": "user", "content": solver_msgs[0]["content"]}]
    assert TASK["prompt"] in solver_msgs[0]["content"] and "(nothing yet)" not in solver_msgs[0]["content"]
    assert len(first_look) == 1 and "eating 2 leaves 10" in first_look[0]["content"]
    assert [m["role"] for m in second_look] == ["user", "assistant", "user"]
    assert second_look[0] == first_look[0] and second_look[1]["content"] == scripted_replies("10")["code_executor"][0]
    assert second_look[2]["content"] == "#### Output of the code\nstdout:\n10\n"
    assert "code_executor" not in first_look[0]["content"]  # its own actions are not in {history}
    (verifier_input,) = [m["content"] for m in verifier_msgs]
    assert "The program printed 10, as expected." in verifier_input  # the Executor's final reply
    assert "print(3 * 4 - 2)" in verifier_input and "stdout:\n10" in verifier_input  # its last code run
    assert "eating 2 leaves 10" not in verifier_input  # the Solver is not in the Verifier's view
    assert env.history[1].feedback.strip() == "stdout:\n10"
    assert env.outcome() == played.outcome == {"success": True, "answer": "10", "answered": True}
    assert [a.grade and a.grade[0] for a in seen] == [None, None, None, 10.0]  # MathChat's judge: the Verifier's answer
    verifier, solver = topo.agents[-1], topo.agents[0]
    assert env.coach_ground_truth(verifier) == "10" and env.coach_ground_truth(solver) is None


def test_scripted_mathchat_episode_wrong_or_missing_answer(tmp_path):
    topo = load_topology(str(MATHCHAT_YAML), model_override="tiny")
    replies = scripted_replies("12")
    played = play(topo, dict(TASK), [*replies["problem_solver"], *replies["code_executor"], *replies["verifier"]])
    assert played.outcome == {"success": False, "answer": "12", "answered": True}
    replies = scripted_replies("10")
    replies["verifier"] = ["I think it is 10."]  # boxed answers of other agents do not count
    replies["problem_solver"] = ["\\boxed{10}"]
    played = play(topo, dict(TASK), lambda name, turn: replies[name][turn], str(tmp_path / "b"))
    assert played.outcome == {"success": False, "answer": None, "answered": False}


def test_observe_with_system_message(tmp_path):
    agent = AgentSpec(name="a", model="m", role="r", prompt="Q: {task}\nH: {history}", system="Be brief.")
    env = MultiAgentEnv(topology=Topology("t", "mathchat", [agent], None), task={"prompt": "2+2?", "answer": "4"},
                        workspace=str(tmp_path))
    assert env.observe(agent, 0) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Q: 2+2?\nH: (nothing yet)"},
    ]


# ---------------------------------------------------------------- what each agent sees


def view_env(tmp_path, view, prompt="{task}\n{history}", system=""):
    """Agents a, b (3 actions of code) and c with `view`; the history as the env would have recorded it,
    c's own first action last."""
    agents = [dict(GOOD_AGENT, name="a"), dict(GOOD_AGENT, name="b"),
              dict(GOOD_AGENT, name="c", view=view, prompt=prompt, system=system)]  # fmt: skip
    topo = load_topology(write_topology(tmp_path, agents=agents))
    env = MultiAgentEnv(topo, {"prompt": "THE TASK", "answer": "1"}, str(tmp_path))
    env.history = [
        HistoryEntry("a", 0, "<think>a plans</think>A's answer", ""),
        HistoryEntry("b", 0, "B's first code", "stdout:\nfirst run"),
        HistoryEntry("b", 1, "B's second code", "stdout:\nsecond run"),
        HistoryEntry("b", 2, "B's summary", ""),
        HistoryEntry("c", 0, "C's code", "stdout:\nmine"),
    ]
    return topo.agents[-1], env


@pytest.mark.parametrize(
    "view, shown, hidden",
    [
        ("all", ["<think>a plans</think>A's answer", "B's first code", "first run", "second run", "B's summary"], []),
        ("previous", ["B's first code", "first run", "B's second code", "B's summary"], ["A's answer"]),
        (["a"], ["A's answer"], ["B's"]),
        ([], ["(nothing yet)"], ["A's", "B's"]),
        # each agent's final reply and its latest code run (the authors' Verifier)
        ({"agents": ["a", "b"], "actions": "last"}, ["A's answer", "B's second code", "second run", "B's summary"],
         ["B's first code", "first run"]),
        ({"agents": ["b"], "actions": "last", "tool_output": False}, ["B's summary"], ["B's second code", "run", "A's"]),
        ({"tool_output": False}, ["B's first code", "B's second code"], ["first run", "second run"]),
        ({"strip_thinking": True}, ["A's answer", "B's summary"], ["a plans", "think>"]),
        ({"strip_thinking": "answer"}, ["A's answer", "B's summary"], ["a plans", "think>"]),
    ],
)
def test_view_selects_what_an_agent_sees_of_the_others(tmp_path, view, shown, hidden):
    agent, env = view_env(tmp_path, view)
    messages = env.observe(agent, 1)
    history = messages[0]["content"]
    assert history.startswith("THE TASK\n") and "C's code" not in history  # its own actions are chat turns
    assert all(text in history for text in shown), history
    assert not any(text in history for text in hidden), history
    assert messages[1:] == [{"role": "assistant", "content": "C's code"},
                            {"role": "user", "content": "#### Output of the code\nstdout:\nmine"}]  # fmt: skip


def test_default_view_renders_as_before(tmp_path):
    """No view: {history} is every other agent's action with its output, exactly the old history_text."""
    agent, env = view_env(tmp_path, "all")
    env.history = env.history[:-1]  # c has not acted yet: {history} is the whole history
    assert env.observe(agent, 0) == [{"role": "user", "content": "THE TASK\n" + env.history_text()}]
    assert "### b (action 2)\nB's second code\n\n#### Output of the code\nstdout:\nsecond run" in env.history_text()


def test_omit_leaves_out_the_oldest_entries_with_a_marker(tmp_path):
    agent, env = view_env(tmp_path, "all", system="SYSTEM")
    full = env.observe(agent, 1)
    assert env.observe(agent, 1, omit=0) == full and "omitted" not in str(full)
    two = env.observe(agent, 1, omit=2)  # a's answer and b's first code go, oldest first
    assert two[0] == full[0] and two[2:] == full[2:]  # the system message and its own turns stay
    assert two[1]["content"].startswith("THE TASK\n[2 earlier actions omitted to fit the context]\n\n### b (action 2)")
    assert "A's answer" not in two[1]["content"] and "B's first code" not in two[1]["content"]
    four = env.observe(agent, 1, omit=4)  # every other agent's action: {history} is the marker alone
    assert four[1]["content"] == "THE TASK\n[4 earlier actions omitted to fit the context]" and four[2:] == full[2:]
    five = env.observe(agent, 1, omit=5)  # then its own turns
    assert five == [full[0], {"role": "user", "content": "THE TASK\n[5 earlier actions omitted to fit the context]"}]
    assert env.observe(agent, 1, omit=99) == five
    # A prompt without {history} shows no other agent; the marker for its own turns ends the prompt.
    agent, env = view_env(tmp_path, "all", prompt="Only {task}")
    assert env.observe(agent, 1) == [{"role": "user", "content": "Only THE TASK"}, *full[2:]]
    assert env.observe(agent, 1, omit=1) == [
        {"role": "user", "content": "Only THE TASK\n\n[1 earlier action omitted to fit the context]"}]


def test_an_agent_sees_the_episode_in_the_order_it_happened(tmp_path):
    """A loop: each own action is followed by one user turn with its code output and the other's actions up to its
    next one; "(nothing new)" between two own actions; an action of the same round (generated at once) after
    its own; omit=k leaves out the k oldest in that order."""
    agents = [dict(GOOD_AGENT, name="a", prompt="T\n{history}"), dict(GOOD_AGENT, name="b")]
    topo = load_topology(write_topology(tmp_path, agents=agents, env="debate"))
    env = MultiAgentEnv(topo, {"prompt": "THE TASK", "answer": "1"}, str(tmp_path))
    env.history = [
        HistoryEntry("b", 0, "B before", ""),
        HistoryEntry("a", 0, "A code", "stdout:\n1", seen=1),
        HistoryEntry("b", 1, "B after", ""),
        HistoryEntry("a", 1, "A plain", "", seen=3),
        HistoryEntry("a", 2, "A again", "", seen=4),
        HistoryEntry("b", 2, "B same round", "", seen=4),  # generated at the same time as "A again"
    ]
    a = topo.agents[0]

    def said(text):
        return {"role": "assistant", "content": text}

    def told(text):
        return {"role": "user", "content": text}

    assert env.observe(a, 3) == [
        told("T\n### b (action 1)\nB before"), said("A code"),
        told("#### Output of the code\nstdout:\n1\n\n### b (action 2)\nB after"), said("A plain"),
        told("(nothing new)"), said("A again"), told("### b (action 3)\nB same round")]  # fmt: skip
    assert env.observe(a, 3, omit=2) == [
        told("T\n[2 earlier actions omitted to fit the context]\n\n### b (action 2)\nB after"), said("A plain"),
        told("(nothing new)"), said("A again"), told("### b (action 3)\nB same round")]  # fmt: skip
    # step() records what the input could show: the history as observe() found it.
    env.observe(a, 3)
    env.step(a, 3, "A last")
    assert env.history[-1].seen == 6


# ---------------------------------------------------------------- over-long prompts


def test_shorten_finds_the_fewest_entries_to_leave_out(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    agent, env = view_env(tmp_path, "all", system="SYSTEM")
    env.history = [HistoryEntry("b", i, f"step {i} " + "x" * 100, "") for i in range(9)]  # 9 entries
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    probe = AgentPolicy(engines=[], tokenizer=tokenizer, max_new_tokens=10, max_len=10**6)
    length = [len(probe.prompt_ids(env.observe(agent, 0, k))[1]) for k in range(10)]
    assert length == sorted(length, reverse=True)  # each entry left out shortens the prompt

    policy = AgentPolicy(engines=[], tokenizer=tokenizer, max_new_tokens=10, max_len=length[5] + 10)
    calls = []
    measure = policy.prompt_ids
    policy.prompt_ids = lambda messages, keep_reasoning: calls.append(1) or measure(messages, keep_reasoning)
    text, ids, too_long, k = policy.shorten(functools.partial(env.observe, agent, 0), len(env.history))
    assert (too_long, k, len(ids)) == (False, 5, length[5]) and len(calls) <= 1 + 4  # 1 + ceil(log2 9)
    assert text == tokenizer.apply_chat_template(env.observe(agent, 0, 5), tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nSYSTEM<|im_end|>\n<|im_start|>user\nTHE TASK\n[5 earlier actions omitted")
    assert "step 4 " not in text and "step 5 " in text and "step 8 " in text

    # Even with every entry left out (system message, prompt, task and marker) it does not fit.
    policy.max_len = length[9] + 10 - 1
    text, ids, too_long, k = policy.shorten(functools.partial(env.observe, agent, 0), len(env.history))
    assert too_long and k == 9 and len(ids) == length[9] and "THE TASK" in text


def test_prompt_ids_never_cuts(tiny_model):
    from transformers import AutoTokenizer

    policy = AgentPolicy(engines=[], tokenizer=AutoTokenizer.from_pretrained(tiny_model), max_new_tokens=16, max_len=64)
    text, ids, too_long = policy.prompt_ids([{"role": "user", "content": "short"}])
    assert not too_long and len(ids) < 48
    text, ids, too_long = policy.prompt_ids([{"role": "user", "content": "x " * 300 + "THE END"}])
    assert too_long and ids == policy.tokenizer(text, add_special_tokens=False)["input_ids"] and len(ids) > 600


class RecordingCoach:
    def __init__(self):
        self.requests = []

    async def score(self, request):
        self.requests.append(request)
        return Verdict(None, "skipped")


def play_mathchat(tmp_path, tokenizer, replies, max_len, env_class=MathChatEnv):
    """run_episode of MathChat with real policies (chat template, tokenizer, prompt fitting) whose engines are
    scripted: each records the prompt ids it was given. max_len: per agent."""
    topology = load_topology(str(MATHCHAT_YAML), model_override="tiny")
    topology.make_env = lambda task, workspace: env_class(topology, task, workspace)
    policies, given = {}, []
    for spec in topology.agents:
        policy = AgentPolicy(engines=[], tokenizer=tokenizer, max_new_tokens=64, max_len=max_len[spec.name])

        async def generate(prompt_ids, name=spec.name, turns=iter(replies[spec.name])):
            given.append((name, prompt_ids))
            return tokenizer(next(turns), add_special_tokens=False)["input_ids"], False, []

        policy.generate = generate
        policies[spec.name] = policy
    coach = RecordingCoach()
    episode = asyncio.run(run_episode(topology, dict(TASK), policies, coach, str(tmp_path), step=1))
    return episode, given, coach.requests


def test_the_coach_sees_exactly_the_input_the_agent_saw_as_text(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    replies = scripted_replies("10")
    replies["problem_solver"] = ["3 boxes of 4 apples is 12; eating 2 leaves 10. " + "Check. " * 300]
    # The Code Executor's budget cannot hold the Solver's long draft: it is left out, with a marker.
    episode, given, requests = play_mathchat(tmp_path, tokenizer, replies,
                                             {"problem_solver": 4096, "code_executor": 1072, "verifier": 4096})  # fmt: skip
    assert [(a.agent, a.turn, a.prompt_truncated) for a in episode.actions] == [
        ("problem_solver", 0, False), ("code_executor", 0, True), ("code_executor", 1, True), ("verifier", 0, False)]  # fmt: skip
    for action, request, (name, ids) in zip(episode.actions, requests, given):
        assert request.agent == action.agent == name and ids == action.prompt_ids
        assert tokenizer(action.prompt_text, add_special_tokens=False)["input_ids"] == ids
        # The coach reads the same messages without the chat template's special tokens: a lone user message as it
        # is, several each under its role.
        messages = re.findall(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>", action.prompt_text, re.S)
        assert request.agent_input == (messages[0][1] if len(messages) == 1 else
                                       "\n\n".join(f"[{role}]\n{content}" for role, content in messages))
        assert "<|im_" not in request.agent_input and request.agent_input == action.coach_request["agent_input"]
    executor_input, verifier_input = requests[2].agent_input, requests[3].agent_input
    assert "[1 earlier action omitted to fit the context]" in executor_input and "Check." not in executor_input
    assert TASK["prompt"] in executor_input and "print(3 * 4 - 2)" in executor_input  # its own first code
    assert "eating 2 leaves 10" not in verifier_input and "The program printed 10" in verifier_input  # its view
    assert episode.success and episode.skipped_actions == []


def test_an_action_whose_prompt_cannot_fit_is_skipped_and_counted(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    # The Verifier's prompt and task alone exceed its budget: it does not act; the episode ends unanswered.
    episode, given, requests = play_mathchat(tmp_path, AutoTokenizer.from_pretrained(tiny_model), scripted_replies("10"),
                                             {"problem_solver": 4096, "code_executor": 4096, "verifier": 300})  # fmt: skip
    assert [a.agent for a in episode.actions] == ["problem_solver", "code_executor", "code_executor"]
    assert [name for name, _ in given] == [r.agent for r in requests] == [a.agent for a in episode.actions]
    (skipped,) = episode.skipped_actions
    assert (skipped["agent"], skipped["turn"], skipped["budget"]) == ("verifier", 0, 300 - 64)
    assert skipped["prompt_tokens"] > 236  # the shortest prompt it could get: no history at all
    assert episode.outcome == {"success": False, "answer": None, "answered": False}
    assert json.loads(episode.to_json())["skipped_actions"] == [skipped]
    m = behaviour_metrics([episode, episode], ["code_executor", "verifier"])
    assert (m["agent/verifier/prompt_too_long_skipped"], m["agent/verifier/num_actions"]) == (2, 0)
    assert m["agent/code_executor/prompt_too_long_skipped"] == 0


def test_an_env_whose_observe_takes_no_omit_still_works(tiny_model, tmp_path):
    """A custom observe(agent, turn) (the protocol before `omit`): prompts that fit run as before; one that
    does not is skipped, since the rollout cannot tell its history from its task."""
    from transformers import AutoTokenizer

    class OwnObserve(MathChatEnv):
        def observe(self, agent, turn):
            return [{"role": "user", "content": f"{agent.name}: {self.task_text}\n{self.history_text()}"}]

    episode, given, requests = play_mathchat(tmp_path, AutoTokenizer.from_pretrained(tiny_model), scripted_replies("10"),
                                             {"problem_solver": 4096, "code_executor": 4096, "verifier": 200},
                                             env_class=OwnObserve)  # fmt: skip
    assert [a.agent for a in episode.actions] == ["problem_solver", "code_executor", "code_executor"]
    task = TASK["prompt"] + "\n\nPlease reason step by step, and put your final answer within \\boxed{}."  # mathchat.yaml's
    assert requests[2].agent_input.startswith(f"code_executor: {task}\n### problem_solver")  # one message: as it is
    assert [s["agent"] for s in episode.skipped_actions] == ["verifier"]


@pytest.mark.parametrize(
    "text, boxed",
    [
        ("so \\boxed{10}.", "10"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{ {a}+{b} }", "{a}+{b}"),
        ("\\boxed{7} and finally \\boxed{8", "7"),
        ("no box", None),
    ],
)
def test_extract_boxed(text, boxed):
    assert extract_boxed(text) == boxed


@pytest.mark.parametrize(
    "a, b, same",
    [
        ("18.0", "18", True),
        ("023", "23", True),
        (" $ 18 $ ", "18", True),
        ("\\frac{1}{2}", "0.5", True),
        ("\\dfrac{1}{2}", "1/2", True),
        ("1/2", "0.5", True),
        ("1,000", "1000", True),
        ("336^\\circ", "336", True),
        ("-3", "-3.0", True),
        ("17", "18", False),
        ("", "", False),
        ("x+1", "x + 1", True),
        ("\\frac{1}{3}", "0.333", False),
        ("1/0", "0", False),
    ],
)
def test_answers_match(a, b, same):
    assert answers_match(a, b) is same


# ---------------------------------------------------------------- the demo's relay


class CannedPolicy:
    """An agent's engine with a fixed reply (token ids 1 per character) and whether it hit the token limit."""

    def __init__(self, reply, truncated=False):
        self.reply, self.truncated, self.tokenizer, self.max_new_tokens = reply, truncated, self, 16
        self.gate = SyncGate()

    sample = AgentPolicy.sample  # generate() behind the gate, as the real one

    def prompt_ids(self, messages, keep_reasoning=False):
        return messages[-1]["content"], [1, 2, 3], False

    async def generate(self, prompt_ids):
        return [1] * max(1, len(self.reply)), self.truncated, []

    def decode(self, ids, skip_special_tokens=True):
        return self.reply


@pytest.mark.parametrize("replies, success, scores", [
    ({"quantity": ("12", False), "item": ("apples", False), "code": ("XK", False)}, True, [10, 10, 10]),
    # cut off at the limit: nothing for that action, though its text alone matches (the coach sees the cut-off)
    ({"quantity": ("12", False), "item": ("apples", True), "code": ("XK", False)}, True, [10, 0, 10]),
    # 16 capitals cut off at the limit: with an unbounded goal ([A-Z]+) this passed as a success
    ({"quantity": ("12", False), "item": ("apples", False), "code": ("XKQWERTYUIOPASDF", True)}, False, [10, 10, 0]),
    # ended on its own but not only the required text: 5, + 2 when the text contains it; the episode fails
    ({"quantity": ("12 boxes", False), "item": ("Apples!", False), "code": ("", False)}, False, [7, 7, 5]),
])  # fmt: skip
def test_relay_succeeds_only_when_every_agent_meets_its_goal(tmp_path, replies, success, scores):
    from openrlhf_mappa.coach.heuristic import HeuristicCoach
    from openrlhf_mappa.rollout import rollout

    topology = load_topology(str(ROOT / "examples" / "configs" / "relay.yaml"))
    policies = {name: CannedPolicy(*reply) for name, reply in replies.items()}
    tasks = load_tasks(str(ROOT / "examples" / "data" / "relay_train.jsonl"))[:2]
    done = []
    episodes = asyncio.run(rollout(topology, tasks, policies, HeuristicCoach(), str(tmp_path), step=1, progress=done.append))
    assert done == [1, 1]  # the progress bar moves once per finished episode
    ep = episodes[0]
    assert ep.task_type == "relay" and ep.success is success
    assert [a.coach_request["ground_truth"] for a in ep.actions] == ["Required reply: \\d{1,3}", "Required reply: [a-z]{1,8}",
                                                                     "Required reply: [A-Z]{1,4}"]  # fmt: skip
    # the env's grade (RelayEnv.judge) reaches the coach; the readability bonus (up to 0.9) comes on top below 10
    assert [a.coach_request["env_grade"][0] for a in ep.actions] == scores
    assert [int(a.verdict.score) for a in ep.actions] == scores
    assert "Order 1: a customer orders apples." in ep.actions[2].prompt_text and "### item" in ep.actions[2].prompt_text


def test_relay_names_an_agent_without_a_goal(tmp_path):
    topology = load_topology(str(ROOT / "examples" / "configs" / "relay.yaml"))
    with pytest.raises(ValueError, match=r"no goal for agent\(s\) \['code'\]"):
        topology.env_cls(topology, {"prompt": "p", "answer": "-"}, str(tmp_path), goals={"quantity": "1", "item": "a"})


def test_review_template_is_optional_and_checked(tmp_path):
    assert load_topology(write_topology(tmp_path)).review_template is None  # the built-in hindsight prompt
    template = "{task_type}: {task}\n{trajectory}\n{outcome}\nScore the {num_actions} actions as JSON: {{...}}"
    assert load_topology(write_topology(tmp_path, review_template=template)).review_template == template



@pytest.mark.parametrize("strip, shown, hidden", [
    (True, ["A reasons, cut off", "B reasons\n\nB's answer"], ["think>"]),  # their strip_thinking_blocks
    ("answer", ["B's answer"], ["A reasons", "B reasons", "think>"]),
])
def test_strip_thinking_hands_on_a_reply_cut_off_in_its_reasoning_as_theirs(tmp_path, strip, shown, hidden):
    """The authors' strip (dsbench_workflow.py strip_thinking_blocks) drops whole <think> blocks, then stray
    tags: a reply cut off inside its reasoning, or one without the opening tag (Qwen3-4B-Thinking-2507's chat
    template writes it), hands its reasoning on. `strip_thinking: answer` keeps only what follows the last
    </think>."""
    agent, env = view_env(tmp_path, {"agents": ["a", "b"], "actions": "last", "strip_thinking": strip})
    env.history = [HistoryEntry("a", 0, "<think>\nA reasons, cut off", ""),
                   HistoryEntry("b", 0, "B reasons\n\n\n\n</think>\n\nB's answer", "")]
    history = env.observe(agent, 0)[0]["content"]
    assert all(text in history for text in shown), history
    assert not any(text in history for text in hidden), history
