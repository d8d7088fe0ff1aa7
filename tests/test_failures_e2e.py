"""A component dying mid-run, for real: a tiny two-agent MAPPA run on CPU (Ray, vLLM, DeepSpeed ZeRO-3) whose
second agent's vLLM engine process is SIGKILLed after the first step. The run must end on its own within a
bounded time, non-zero, with a message naming that agent and component, keeping the step it had logged."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.e2e
def test_a_dead_engine_stops_the_run_naming_its_agent(tmp_path, tiny_model):
    topology = yaml.safe_load(open(os.path.join(os.path.dirname(TESTS), "examples", "configs", "mathchat.yaml")))
    topology["agents"] = [dict(a, max_actions=1) for a in topology["agents"] if a["name"] in ("problem_solver", "verifier")]
    (tmp_path / "topology.yaml").write_text(yaml.safe_dump(topology))
    with open(tmp_path / "tasks.jsonl", "w") as f:
        for i in range(8):  # 4 steps of 2 tasks: the kill lands long before the end
            f.write(json.dumps({"id": i, "prompt": f"What is {i} + 2?", "answer": str(i + 2)}) + "\n")
    run_dir = tmp_path / "run"
    argv = [
        "--mappa.topology", str(tmp_path / "topology.yaml"),
        "--mappa.model", tiny_model,
        "--mappa.run_dir", str(run_dir),
        "--data.prompt_dataset", str(tmp_path / "tasks.jsonl"),
        "--actor.num_gpus_per_node", "1",
        "--vllm.num_engines", "1",
        "--vllm.enforce_eager",
        "--vllm.gpu_memory_utilization", "0.2",
        "--ds.zero_stage", "3",
        "--ds.attn_implementation", "sdpa",
        "--algo.kl.init_coef", "0",
        "--rollout.batch_size", "2",
        "--rollout.n_samples_per_prompt", "2",
        "--rollout.micro_batch_size", "2",
        "--rollout.max_new_tokens", "12",
        "--data.max_len", "512",
        "--train.batch_size", "4",
        "--train.micro_batch_size", "2",
        "--train.num_episodes", "1",
        "--ckpt.path", str(tmp_path / "ckpt"),
        "--ckpt.output_dir", str(tmp_path / "final"),
    ]  # fmt: skip
    env = dict(os.environ, MAPPA_CPU_NUM_GPUS="4")
    env.pop("RAY_ADDRESS", None)
    out = open(tmp_path / "run.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "openrlhf_mappa.cli.train_mappa_ray", *argv], cwd=tmp_path, env=env,
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 600
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().endswith("\n")):
            assert proc.poll() is None, (tmp_path / "run.log").read_text()[-4000:]
            assert time.time() < deadline, "no step within 10 minutes"
            time.sleep(0.2)
        pid = json.loads((run_dir / "processes.json").read_text())["verifier/vLLM engine 0"]
        os.kill(pid, signal.SIGKILL)
        killed_at = time.time()
        try:
            returncode = proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            pytest.fail("the run did not stop within 3 minutes of its engine's death")
        stopped_after = time.time() - killed_at
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the run's processes
        except ProcessLookupError:
            pass
        out.close()
    log = (tmp_path / "run.log").read_text()
    assert returncode != 0
    assert "agent 'verifier': vLLM engine 0 died" in log, log[-4000:]
    assert "agent 'problem_solver'" not in log.split("[mappa] run stopped:")[-1].split("\n")[0]  # only the dead one
    assert stopped_after < 120
    assert json.loads(metrics.read_text().splitlines()[0])["step"] == 1  # what it had is kept
