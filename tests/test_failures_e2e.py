"""A component dying mid-run, for real: a tiny two-agent MAPPA run on CPU (Ray, vLLM, DeepSpeed ZeRO-3) whose
second agent's vLLM engine process is SIGKILLed after the first step. The run must end on its own, stopped on that
death (not by a collective's timeout), non-zero, with a message naming that agent and component, keeping the step
it had logged.

The run is coached in hindsight mode (--mappa.coach.mode hindsight) through the OpenAI-compatible backend,
against a real HTTP server on 127.0.0.1 standing in for a paid coach API (tests/coach_server.py): the step it
keeps must show one review request per episode and no per-action request, each action trained on the score
the server gave it in its episode's review."""

import json
import os
import re
import signal
import sys

import pytest

from coach_server import CoachServer, review_reply
from conftest import TINY_RUN_FLAGS, local_cluster_env, training, two_agent_mathchat, wait_for


@pytest.mark.e2e
def test_a_dead_engine_stops_the_run_naming_its_agent(tmp_path, tiny_model):
    topology, tasks = two_agent_mathchat(tmp_path, num_tasks=8)  # 4 steps of 2 tasks: the kill lands long before the end
    run_dir = tmp_path / "run"
    argv = [
        "--mappa.topology", topology,
        "--mappa.model", tiny_model,
        "--mappa.run_dir", str(run_dir),
        "--data.prompt_dataset", tasks,
        *TINY_RUN_FLAGS,
        "--mappa.coach.kind", "openai",
        "--mappa.coach.mode", "hindsight",
        "--mappa.coach.model", "rule-coach",
        "--ckpt.path", str(tmp_path / "ckpt"),
        "--ckpt.output_dir", str(tmp_path / "final"),
    ]  # fmt: skip
    metrics = run_dir / "metrics.jsonl"
    cmd = [sys.executable, "-m", "openrlhf_mappa.cli.train_mappa_ray", *argv]
    with CoachServer() as server, training(cmd + ["--mappa.coach.base_url", server.base_url], tmp_path / "train",
                                           cwd=tmp_path, env=local_cluster_env(4)) as proc:
        wait_for(proc, lambda: metrics.exists() and metrics.read_text().endswith("\n"), 600, "first step")
        pid = json.loads((run_dir / "processes.json").read_text())["verifier/vLLM engine 0"]
        os.kill(pid, signal.SIGKILL)
        # A bound on the wait, below the weight broadcast's 10-minute collective timeout that a hung run waits out.
        wait_for(proc, lambda: proc.poll() is not None, 300, "stop after the engine's death")
    log = (tmp_path / "train.err").read_text()
    assert proc.returncode != 0
    # Stopped on the engine's death, named (by the watchdog or the failed call), not by a collective's timeout.
    assert "[mappa] run stopped: agent 'verifier': vLLM engine 0 died" in log, log[-4000:]
    assert "agent 'problem_solver'" not in log.split("[mappa] run stopped:")[-1].split("\n")[0]  # only the dead one
    step1 = json.loads(metrics.read_text().splitlines()[0])
    assert step1["step"] == 1  # what it had is kept

    # Hindsight: step 1's 4 episodes (2 tasks x 2 samples, 2 actions each) cost 4 coach requests, all reviews.
    assert (step1["coach/requests"], step1["coach/reviews_ok"], step1["coach/verdicts_ok"]) == (4, 4, 8)
    prompts = [r["prompt"] for r in server.requests]
    assert prompts and all("=== Action 1 of 2: agent problem_solver" in p for p in prompts)  # no per-action request
    episodes = [json.loads(line) for line in open(run_dir / "episodes.jsonl")]
    assert [ep["step"] for ep in episodes] == [1] * 4
    for ep in episodes:
        outputs = [f"Output:\n{a['response_text']}" for a in ep["actions"]]
        # This episode's review request: its outputs in its order (another episode may hold the same two swapped).
        in_order = re.compile(".*".join(map(re.escape, outputs)), re.DOTALL)
        prompt = next(p for p in prompts if in_order.search(p))
        assert f'"success": {str(ep["outcome"]["success"]).lower()}' in prompt  # it saw the outcome
        reply = json.loads(review_reply(prompt, ()))
        review = ep["review"]
        assert (review["status"], review["coach"], review["responsible"]) == ("ok", "openai:rule-coach", reply["responsible"] - 1)
        assert review["scores"] == [e["score"] for e in reply["actions"]]
        for a, score in zip(ep["actions"], review["scores"]):
            assert (a["verdict"]["source"], a["verdict"]["score"]) == ("hindsight", score)
            assert a["reward"] == pytest.approx(0.1 * score)  # MathChat's reward_scale, on the review's score
