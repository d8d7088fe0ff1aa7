"""The README's "your own environment" examples, run exactly as written there; the docs' links and flags."""

import os
import re
import subprocess
import sys

from openrlhf_mappa.cli.flags import RENAMED
from openrlhf_mappa.coach import render_prompt
from openrlhf_mappa.team import load_topology, play
from conftest import REPO

DOCS = ("README.md", "docs/reference.md", "benchmarks/README.md", "tests/README.md")


def prose(path) -> str:
    """A markdown file without its code blocks (a `#` line in a shell block is no heading)."""
    return re.sub(r"^```.*?^```", "", open(path, encoding="utf-8").read(), flags=re.S | re.M)


def readme_example(name):
    """An example block of the README or, for longer ones the README links to, of docs/reference.md."""
    text = "".join(open(f"{REPO}/{doc}", encoding="utf-8").read() for doc in DOCS[:2])
    match = re.search(rf"<!-- example: {re.escape(name)} -->\n```\w+\n(.*?)```", text, re.S)
    assert match, f"README.md and docs/reference.md have no example block for {name}"
    return match.group(1)


def test_readme_environment_example_runs(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(readme_example("my_envs.py"))
    (tmp_path / "keyword.yaml").write_text(readme_example("keyword.yaml"))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_envs", None)

    topology = load_topology(str(tmp_path / "keyword.yaml"))
    assert [a.name for a in topology.agents] == ["writer", "editor"]

    def outcome(final_text):
        task = {"id": "t1", "prompt": "the moon", "answer": "crater"}
        played = play(topology, task, ["The moon is grey.", final_text])
        (writer, written), (editor, edited) = ((a.agent, a.messages[-1]["content"]) for a in played.actions)
        assert (writer, editor) == ("writer", "editor") and "the moon" in written
        assert "The moon is grey." in edited  # the editor sees the draft
        assert [played.env.coach_ground_truth(agent) for agent in topology.agents] == [None, "crater"]
        return played.outcome

    assert outcome("The moon is grey and every Crater shows it.") == {"success": True}
    assert outcome("The moon is grey.") == {"success": False}


def test_every_link_between_the_docs_resolves():
    # GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens.
    def anchors(path):
        return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", prose(path), re.M)}

    checked = 0
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(f"{REPO}/{doc}")):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            file = os.path.normpath(os.path.join(REPO, os.path.dirname(doc), path)) if path else f"{REPO}/{doc}"
            assert os.path.exists(file), f"{doc}: link to {target}: no such file"
            assert not anchor or anchor in anchors(file), f"{doc}: link to {target}: no such heading"
            checked += 1
    assert checked > 40


def test_every_dotted_flag_in_the_docs_is_accepted_by_the_launcher():
    # OpenRLHF's and MAPPA's dotted flags as the real launcher's parser lists them, and `mappa coach distill`'s own.
    # A merged flag's old spelling (RENAMED) may be named too, as history: the launcher refuses it naming its successor.
    accepted = set(RENAMED)
    for command in (["openrlhf_mappa.cli.train_mappa_ray", "--help"],
                    ["openrlhf_mappa.tools.mappa", "coach", "distill", "--help"]):
        proc = subprocess.run([sys.executable, "-m", *command], capture_output=True, text=True, timeout=120, cwd=REPO)
        assert proc.returncode == 0, proc.stderr[-2000:]
        accepted |= set(re.findall(r"--[a-z_]+(?:\.[a-z0-9_]+)+", proc.stdout))
    named = {f for doc in DOCS for f in re.findall(r"--[a-z_]+(?:\.[a-z0-9_]+)+(?:\.?\*)?", open(f"{REPO}/{doc}", encoding="utf-8").read())}
    assert "--mappa.coach.on_failure" in named and "--mappa.coach.on_failure" in accepted
    # A family written with a "*" (`--reward.overlong_*`, `--ds.lora.*`): some accepted flag must start so.
    unknown = [f for f in named - accepted if not (f.endswith("*") and any(a.startswith(f[:-1]) for a in accepted))]
    assert sorted(unknown) == []


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


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def test_readme_loop_example_reads_in_episode_order(tmp_path, monkeypatch, tiny_model):
    """Each agent's input in the loop, for each of its rounds, rendered exactly: its prompt, then its own earlier
    replies each followed by what happened next (the other's review, or the next answer), as it happened; the
    rollout's scripted run gives the agents the same messages (chat-templated) and the coach the same as text."""
    from test_workflows import Script, play as rollout_play
    from transformers import AutoTokenizer

    (tmp_path / "loop_envs.py").write_text(readme_example("loop_envs.py"))
    (tmp_path / "loop.yaml").write_text(readme_example("loop.yaml"))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("loop_envs", None)
    task = {"id": "t1", "prompt": "3 boxes of 4 apples, 2 eaten: how many left?", "answer": "10"}
    replies = ["\\boxed{12}", "No: 2 were eaten.", "\\boxed{10}", "AGREE"]
    played = play(str(tmp_path / "loop.yaml"), task, replies)
    solve = f"Solve, and give the answer as \\boxed{{...}}: {task['prompt']}"
    check = (f"Problem: {task['prompt']}\nReview the latest answer; write AGREE if it is right, else say what is "
             "wrong.\n")
    assert [(a.agent, a.turn, a.round, a.messages) for a in played.actions] == [
        ("solver", 0, 0, [user(solve)]),
        ("checker", 0, 1, [user(check + "### solver (action 1)\n\\boxed{12}")]),
        ("solver", 1, 2, [user(solve), assistant("\\boxed{12}"), user("### checker (action 1)\nNo: 2 were eaten.")]),
        ("checker", 1, 3, [user(check + "### solver (action 1)\n\\boxed{12}"), assistant("No: 2 were eaten."),
                           user("### solver (action 2)\n\\boxed{10}")]),
    ]  # fmt: skip
    assert played.outcome == {"success": True, "answer": "10"} and played.action_limit == ""
    assert [a.grade for a in played.actions] == [None] * 4  # no judge: the heuristic coach's generic rules
    monkeypatch.chdir(tmp_path)
    exec(readme_example("test_loop.py"), {})  # the docs' unit test of the loop, as written there

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    topology = load_topology(str(tmp_path / "loop.yaml"))
    script = Script(tokenizer, {"solver": replies[0::2], "checker": replies[1::2]})
    episode, requests = rollout_play(topology, script, tmp_path / "rollout", task)
    for action, call, request in zip(played.actions, script.calls, requests):
        templated = tokenizer.apply_chat_template(action.messages, tokenize=False, add_generation_prompt=True)
        assert call["prompt"] == templated
        shown = [f"[{m['role']}]\n{m['content']}" for m in action.messages]
        assert request.agent_input == (action.messages[0]["content"] if len(shown) == 1 else "\n\n".join(shown))


def test_the_gpu_quick_start_is_on_the_first_screen_and_runs_as_far_as_it_can_here(tmp_path):
    """The README's first 40 lines say what has run on a GPU and hold the GPU quick start, at most six commands. Run
    here as written, with what cannot exist here stood in: the authors' repository (no network) by the shared copy
    of its data/Bench (byte-identical), `ray` by a stub that records the submission (no cluster), and the dry run
    `mappa check` by a stub `python3` (the recipe's Qwen3-4B and Gemini coach are out of reach; tests/test_check.py
    runs the real one). The data check runs for real: the files the quick start fetched are the authors'."""
    from test_paper_eval import BENCH

    if not os.path.exists(os.path.join(BENCH, "AIME_1983_2024.json")):
        import pytest

        pytest.skip(f"the shared mappa-bench data is not at {BENCH}")
    first = "".join(open(f"{REPO}/README.md", encoding="utf-8").readlines()[:40])
    assert "Nothing has run on a GPU yet" in first and "<!-- example: gpu-quick-start -->" in first
    commands = [line for line in readme_example("gpu-quick-start").splitlines() if line.strip()]
    assert len(commands) <= 6
    (data_step,) = [c for c in commands if c.startswith("git clone https://github.com/ltjed/multiagent-coaching")]
    clone = f"mkdir -p multiagent-coaching/data && cp -r {BENCH} multiagent-coaching/data/Bench"
    subprocess.run(["bash", "-c", data_step.replace("git clone https://github.com/ltjed/multiagent-coaching", clone)],
                   cwd=tmp_path, check=True, timeout=60)
    (launch,) = [c for c in commands if c.startswith("bash examples/scripts/train_mappa_mathchat.sh ")]
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, record in (("ray", "submitted"), ("python3", "checked")):
        (stubs / name).write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / record}\n")
        (stubs / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{stubs}:/usr/bin:/bin", MAPPA_DATA=str(tmp_path / "data"),
               MAPPA_OUT=str(tmp_path / "out"))
    proc = subprocess.run(["bash", "-c", launch.split("#")[0]], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    checked = (tmp_path / "checked").read_text()
    assert checked.startswith("-m openrlhf_mappa.tools.mappa check --mappa.topology")
    submitted = (tmp_path / "submitted").read_text()
    assert f"--data.prompt_dataset {tmp_path}/data/AIME_1983_2024.json" in submitted
    assert f"--eval.dataset {tmp_path}/data/aime_2025.json,{tmp_path}/data/amc_eval_32.json" in submitted
