"""Topology YAML, task files, the local code runner and a scripted MathChat episode (no model, no GPU)."""

import json
import os
import textwrap
import time
from pathlib import Path

import pytest

from openrlhf_mappa.envs.base import MultiAgentEnv, StepResult, load_env_class, load_tasks
from openrlhf_mappa.envs.mathchat import MathChatEnv, answers_match, extract_boxed
from openrlhf_mappa.sandbox import extract_code, run_python
from openrlhf_mappa.topology import AgentSpec, load_topology

ROOT = Path(__file__).resolve().parents[1]
MATHCHAT_YAML = ROOT / "examples" / "configs" / "mathchat.yaml"
TINY_MATH = ROOT / "examples" / "data" / "tiny_math.jsonl"
BENCH = Path(os.environ.get("MAPPA_BENCH_DIR", ROOT.parent / "shared" / "data" / "mappa-bench"))

GOOD_AGENT = {"name": "solver", "model": "m", "role": "solves", "prompt": "Solve: {task}\n{history}"}


def write_topology(tmp_path, **overrides):
    raw = {"name": "t", "env": "mathchat", "agents": [dict(GOOD_AGENT)], "coach_template": "{task} {agent_output}"}
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
    assert topo.env_class() is MathChatEnv
    for field in ("task", "role", "agent", "turn", "task_type", "agent_input", "agent_output", "feedback",
                  "ground_truth"):  # fmt: skip
        assert "{" + field + "}" in topo.coach_template
    assert "SCORE:" in topo.coach_template
    for agent in topo.agents:  # templates fill without KeyError/IndexError
        agent.prompt.format(task="T", history="H")


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
        ({"agents": [dict(GOOD_AGENT, name="a b")]}, "names may only use letters, digits"),
        ({"agents": [dict(GOOD_AGENT, prompt="{task} {answer}")]}, "unknown field {answer}"),
        ({"agents": [dict(GOOD_AGENT, prompt="\\boxed{}")]}, "unknown field {}"),
        ({"agents": [dict(GOOD_AGENT, runs_code="yes")]}, "'runs_code' must be true or false"),
        ({"agents": [dict(GOOD_AGENT, vllm_num_engines=0)]}, "'vllm_num_engines' must be a positive integer"),
        ({"env": "no_such_pkg.mod:Env"}, "cannot import module 'no_such_pkg.mod'"),
        ({"env": "openrlhf_mappa.envs.mathchat:Nope"}, "has no class 'Nope'"),
        ({"env": "nocolon"}, "expected 'package.module:Class'"),
        ({"coach_template": ""}, "'coach_template' is missing or empty"),
        ({"coach_template": "{task} {score}"}, "coach_template: unknown field {score}"),
        ({"env_kwargs": {"code_timeout": 3}}, "env_kwargs do not fit mathchat"),
    ],
)
def test_bad_topology_messages(tmp_path, overrides, message):
    path = write_topology(tmp_path, **overrides)
    with pytest.raises(ValueError) as err:
        load_topology(path)
    assert str(err.value).startswith(path + ": ")
    assert message in str(err.value)


def test_missing_coach_template(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(yaml_text := "env: mathchat\nagents:\n  - {name: a, model: m, role: r, prompt: '{task}'}\n")
    assert "coach_template" not in yaml_text
    with pytest.raises(ValueError, match="'coach_template' is missing"):
        load_topology(str(path))


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
    t0 = time.monotonic()
    fb = run_python(code, str(tmp_path), timeout_s=3.0)  # room for the sandbox to start on a busy machine
    assert time.monotonic() - t0 < 12
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


def run_scripted_episode(topology, env, replies):
    """Drive env as the rollout does, with canned replies per agent; returns (messages, StepResult) pairs."""
    seen = []
    for agent in topology.agents:
        for turn in range(agent.max_actions):
            messages = env.observe(agent, turn)
            result = env.step(agent, turn, replies[agent.name][turn])
            assert isinstance(result, StepResult)
            seen.append((agent.name, turn, messages, result))
            if result.done:
                break
    return seen


TASK = {"id": "t1", "prompt": "Tom has 3 boxes of 4 apples and eats 2. How many apples are left?", "answer": "10"}


def scripted_replies(final_answer):
    return {
        "problem_solver": ["3 boxes of 4 apples is 12; eating 2 leaves 10."],
        "code_executor": ["Checking:\n```python\nprint(3 * 4 - 2)\n```", "The program printed 10, as expected."],
        "verifier": [f"Both agree. The answer is \\boxed{{{final_answer}}}."],
    }


def test_scripted_mathchat_episode_succeeds(tmp_path):
    topo = load_topology(str(MATHCHAT_YAML), model_override="tiny")
    env = topo.make_env(dict(TASK), str(tmp_path))
    assert env.task_type == "math" and env.code_timeout_s == 10
    seen = run_scripted_episode(topo, env, scripted_replies("10"))
    assert [(name, turn) for name, turn, _, _ in seen] == [
        ("problem_solver", 0), ("code_executor", 0), ("code_executor", 1), ("verifier", 0),
    ]  # fmt: skip
    code_result = seen[1][3]
    assert code_result.feedback.stdout == "10\n" and code_result.feedback.exit_code == 0 and not code_result.done
    assert seen[2][3].done and not seen[2][3].feedback.ran  # no code block: the executor is finished
    second_look = seen[2][2][-1]["content"]  # the executor's second turn sees its code's output
    assert "print(3 * 4 - 2)" in second_look and "stdout:\n10" in second_look
    assert seen[0][2][-1]["role"] == "user" and TASK["prompt"] in seen[0][2][-1]["content"]
    assert env.history[1].feedback.strip() == "stdout:\n10"
    assert env.outcome() == {"success": True, "answer": "10", "answered": True}
    verifier, solver = topo.agents[-1], topo.agents[0]
    assert env.coach_ground_truth(verifier) == "10" and env.coach_ground_truth(solver) is None


def test_scripted_mathchat_episode_wrong_or_missing_answer(tmp_path):
    topo = load_topology(str(MATHCHAT_YAML), model_override="tiny")
    env = topo.make_env(dict(TASK), str(tmp_path / "a"))
    run_scripted_episode(topo, env, scripted_replies("12"))
    assert env.outcome() == {"success": False, "answer": "12", "answered": True}
    env = topo.make_env(dict(TASK), str(tmp_path / "b"))
    replies = scripted_replies("10")
    replies["verifier"] = ["I think it is 10."]  # boxed answers of other agents do not count
    replies["problem_solver"] = ["\\boxed{10}"]
    run_scripted_episode(topo, env, replies)
    assert env.outcome() == {"success": False, "answer": None, "answered": False}


def test_observe_with_system_message(tmp_path):
    agent = AgentSpec(name="a", model="m", role="r", prompt="Q: {task}\nH: {history}", system="Be brief.")
    env = MultiAgentEnv(topology=None, task={"prompt": "2+2?", "answer": "4"}, workspace=str(tmp_path))
    assert env.observe(agent, 0) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Q: 2+2?\nH: (nothing yet)"},
    ]


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
