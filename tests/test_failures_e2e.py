"""A component dying mid-run, for real: a tiny two-agent MAPPA run on CPU (Ray, vLLM, DeepSpeed ZeRO-3) whose
second agent's vLLM engine process is SIGKILLed after the first step. The run must end on its own within a
bounded time, non-zero, with a message naming that agent and component, keeping the step it had logged."""

import json
import os
import signal
import sys
import time

import pytest

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
        "--ckpt.path", str(tmp_path / "ckpt"),
        "--ckpt.output_dir", str(tmp_path / "final"),
    ]  # fmt: skip
    metrics = run_dir / "metrics.jsonl"
    cmd = [sys.executable, "-m", "openrlhf_mappa.cli.train_mappa_ray", *argv]
    with training(cmd, tmp_path / "train", cwd=tmp_path, env=local_cluster_env(4)) as proc:
        wait_for(proc, lambda: metrics.exists() and metrics.read_text().endswith("\n"), 600, "first step")
        pid = json.loads((run_dir / "processes.json").read_text())["verifier/vLLM engine 0"]
        os.kill(pid, signal.SIGKILL)
        killed_at = time.time()
        wait_for(proc, lambda: proc.poll() is not None, 180, "stop after the engine's death")
        stopped_after = time.time() - killed_at
    log = (tmp_path / "train.err").read_text()
    assert proc.returncode != 0
    assert "agent 'verifier': vLLM engine 0 died" in log, log[-4000:]
    assert "agent 'problem_solver'" not in log.split("[mappa] run stopped:")[-1].split("\n")[0]  # only the dead one
    assert stopped_after < 120
    assert json.loads(metrics.read_text().splitlines()[0])["step"] == 1  # what it had is kept
