"""The README's "your own environment" examples, run exactly as written there."""

import re
import sys

from openrlhf_mappa.coach import render_prompt
from openrlhf_mappa.topology import load_topology
from conftest import REPO


def readme_example(name):
    text = open(f"{REPO}/README.md", encoding="utf-8").read()
    match = re.search(rf"<!-- example: {re.escape(name)} -->\n```\w+\n(.*?)```", text, re.S)
    assert match, f"README.md has no example block for {name}"
    return match.group(1)


def test_readme_environment_example_runs(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(readme_example("my_envs.py"))
    (tmp_path / "keyword.yaml").write_text(readme_example("keyword.yaml"))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_envs", None)

    topology = load_topology(str(tmp_path / "keyword.yaml"))
    assert [a.name for a in topology.agents] == ["writer", "editor"]

    def play(final_text):
        env = topology.make_env({"id": "t1", "prompt": "the moon", "answer": "crater"}, str(tmp_path / "ws"))
        writer, editor = topology.agents
        assert "the moon" in env.observe(writer, 0)[-1]["content"]
        assert env.step(writer, 0, "The moon is grey.").done
        assert "The moon is grey." in env.observe(editor, 0)[-1]["content"]  # the editor sees the draft
        env.step(editor, 0, final_text)
        assert env.coach_ground_truth(editor) == "crater" and env.coach_ground_truth(writer) is None
        return env.outcome()

    assert play("The moon is grey and every Crater shows it.") == {"success": True}
    assert play("The moon is grey.") == {"success": False}


def test_readme_loop_example_runs_until_agreement(tmp_path, monkeypatch, tiny_model):
    """The README's solver/checker loop, through the real rollout with scripted engines (no model): they
    alternate until the checker agrees, or stop after max_actions rounds each without counting as a limit."""
    from test_workflows import Script, order, play
    from transformers import AutoTokenizer

    (tmp_path / "loop_envs.py").write_text(readme_example("loop_envs.py"))
    (tmp_path / "loop.yaml").write_text(readme_example("loop.yaml"))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("loop_envs", None)
    topology = load_topology(str(tmp_path / "loop.yaml"))
    assert topology.agents[0].view.agents == ("checker",)  # a view of a later agent: this env is no chain
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    task = {"id": "t1", "prompt": "3 boxes of 4 apples, 2 eaten: how many left?", "answer": "10"}

    script = Script(tokenizer, {"solver": ["\\boxed{12}", "\\boxed{10}"], "checker": ["No: 2 were eaten.", "AGREE"]})
    episode, requests = play(topology, script, tmp_path / "a", task)
    assert order(episode) == [("solver", 0, 0, 0), ("checker", 0, 1, 1), ("solver", 1, 2, 2), ("checker", 1, 3, 3)]
    assert "No: 2 were eaten." in script.calls[2]["prompt"]  # the solver revises after the review
    assert episode.outcome == {"success": True, "answer": "10"} and episode.action_limit == ""
    assert render_prompt(topology.coach_template, requests[2]).startswith(f"Task: {task['prompt']}\nRound 2 (action 2 of")

    script = Script(tokenizer, {"solver": ["\\boxed{12}"] * 3, "checker": ["No."] * 3})  # never agrees
    episode, _ = play(topology, script, tmp_path / "b", task)
    assert [a.agent for a in episode.actions] == ["solver", "checker"] * 3
    assert episode.outcome == {"success": False, "answer": "12"} and episode.action_limit == ""
