"""Crash-safe resume, for real: a tiny two-agent MAPPA run on CPU (Ray, vLLM, DeepSpeed ZeRO-3) is killed with
SIGKILL (its whole process group: driver, Ray, engines) right after its first team checkpoint, a cut-off line
is left at the end of metrics.jsonl, and the same command resumes it.

Asserted: every agent's resumed actor equals its checkpoint (log-probs of a fixed sequence against the
checkpoint's HF export), its engine got those weights before the first resumed rollout, and metrics.jsonl /
episodes.jsonl end with every step exactly once.
"""

import json
import os
import sys

import pytest
import torch

from conftest import TINY_RUN_FLAGS, local_cluster_env, run_training, training, two_agent_mathchat, wait_for


AGENTS = ("problem_solver", "verifier")
TESTS = os.path.dirname(os.path.abspath(__file__))


def resume_and_probe(argv: list, out_path: str):
    """In a child process: resume training with `argv`; before the first resumed step, probe every agent's
    actor and engine (test_mappa_e2e.probe_agents)."""
    import ray

    from openrlhf_mappa.cli.train_mappa_ray import parse_args, train
    from openrlhf_mappa.trainer import MappaTrainer
    from test_mappa_e2e import probe_agents

    fit = MappaTrainer.fit

    def probe_then_fit(self, start_step=0):
        with open(out_path, "w") as f:
            json.dump(dict(probe_agents(self.agents), start=start_step), f)
        return fit(self, start_step)

    MappaTrainer.fit = probe_then_fit
    train(parse_args(argv))
    ray.shutdown()


@pytest.mark.e2e
def test_sigkilled_run_resumes_with_weights_and_logs_intact(tmp_path, tiny_model):
    from test_openrlhf_cpu_e2e import hf_probe_logprobs

    topology, tasks = two_agent_mathchat(tmp_path, num_tasks=6)  # 3 steps of 2 tasks
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    argv = [
        "--mappa.topology", topology,
        "--mappa.model", tiny_model,
        "--mappa.run_dir", str(run_dir),
        "--data.prompt_dataset", tasks,
        *TINY_RUN_FLAGS,
        "--actor.adam.lr", "1e-2",
        "--actor.lr_warmup_ratio", "0",
        "--ckpt.save_steps", "1",
        "--ckpt.save_hf",
        "--ckpt.load_enable",  # the same command starts and resumes
        "--ckpt.path", str(ckpt),
        "--ckpt.output_dir", str(tmp_path / "final"),
    ]  # fmt: skip
    env = local_cluster_env(4)

    # Run 1: its whole process group SIGKILLed (at the end of the `training` block) once the first team checkpoint exists.
    marker = ckpt / "mappa_checkpoint.json"
    with training([sys.executable, "-m", "openrlhf_mappa.cli.train_mappa_ray", *argv], tmp_path / "train1", cwd=tmp_path, env=env) as run1:
        wait_for(run1, marker.exists, 600, "first team checkpoint")
    saved = json.loads(marker.read_text())["step"]
    assert saved in (1, 2)  # the kill may land after step 2's save, never before step 1's
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "agent/solver/kl": 0.1')  # a line cut off by the kill

    # Run 2: the same command resumes; probe every agent right before its first resumed step.
    child = f"import sys; sys.path.insert(0, {TESTS!r}); from test_resume_e2e import resume_and_probe; resume_and_probe({argv!r}, {str(tmp_path / 'probe.json')!r})"
    proc = run_training([sys.executable, "-c", child], tmp_path / "train2", timeout=900, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert f"resuming after step {saved}" in proc.stdout

    result = json.load(open(tmp_path / "probe.json"))
    assert result["start"] == saved
    initial = hf_probe_logprobs(tiny_model, result["probe"])
    for name in AGENTS:
        checkpointed = hf_probe_logprobs(str(ckpt / name / f"global_step{saved}_hf"), result["probe"])
        actor, engine = torch.tensor(result["actor"][name]), torch.tensor(result["engine"][name])
        assert (actor - checkpointed).abs().max() < 0.02, name  # the resumed actor is the checkpoint ...
        assert (engine - actor).abs().max() < 0.02, name  # ... and so is its engine, before any rollout
        assert (checkpointed - initial).abs().mean() > 0.1, name  # (training had moved it: a real check)

    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    steps = [json.loads(line)["step"] for line in open(run_dir / "episodes.jsonl")]
    assert sorted(steps) == [1] * 4 + [2] * 4 + [3] * 4
    assert json.loads(marker.read_text())["step"] == 3
