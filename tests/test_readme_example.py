"""The README's "your own environment" example, run exactly as written there."""

import re
import sys

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
