"""Crash-safe resume, for real: a tiny two-agent MAPPA run on CPU (Ray, vLLM, DeepSpeed ZeRO-3) is killed with
SIGKILL (its whole process group: driver, Ray, engines) right after its first team checkpoint, a cut-off line
is left at the end of metrics.jsonl, and the same command resumes it.

Asserted: every agent's resumed actor equals its checkpoint (log-probs of a fixed sequence against the
checkpoint's HF export), its engine got those weights before the first resumed rollout, and metrics.jsonl /
episodes.jsonl end with every step exactly once. The topology's coach criteria switch after step 1 and the
coach is shown its running bias: the resumed run goes on with the switched template, and the figures its
first resumed step shows cover the steps before the checkpoint.
"""

import json
import os
import sys

import pytest
import torch
import yaml

from conftest import TINY_RUN_FLAGS, local_cluster_env, run_training, training, two_agent_mathchat, wait_for


AGENTS = ("problem_solver", "verifier")
TESTS = os.path.dirname(os.path.abspath(__file__))


def resume_and_probe(argv: list, out_path: str, end_path: str = None):
    """In a child process: resume training with `argv`; before the first resumed step, probe every agent's
    actor and engine (test_mappa_e2e.probe_agents); with `end_path`, after the last step too, with the kind of
    each agent's reference."""
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
    agents = train(parse_args(argv))
    if end_path:
        with open(end_path, "w") as f:
            json.dump(dict(probe_agents(agents), references=[type(ag.ref).__name__ for ag in agents]), f)
    ray.shutdown()


@pytest.mark.e2e
def test_sigkilled_run_resumes_with_weights_and_logs_intact(tmp_path, tiny_model):
    from test_openrlhf_cpu_e2e import hf_probe_logprobs

    topology, tasks = two_agent_mathchat(tmp_path, num_tasks=6)  # 3 steps of 2 tasks
    raw = yaml.safe_load(open(topology))
    raw["coach_templates"] = [{"name": "first", "template": raw.pop("coach_template")},
                              {"name": "later", "template": "Later criteria.\n{agent_output}", "when": "step >= 1"}]  # fmt: skip
    open(topology, "w").write(yaml.safe_dump(raw))
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
        "--mappa.coach.show_bias",
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
    assert "'first' -> 'later', in use from step 2" in open(tmp_path / "train1.out").read()
    assert "resuming with coach template 'later' (in use since step 2)" in proc.stdout
    assert "coach criteria: after step" not in proc.stdout  # no second switch

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
    assert [m["coach/template_stage"] for m in metrics] == [0, 1, 1]
    episodes = [json.loads(line) for line in open(run_dir / "episodes.jsonl")]
    assert sorted(ep["step"] for ep in episodes) == [1] * 4 + [2] * 4 + [3] * 4
    assert json.loads(marker.read_text()) == {"step": 3, "coach_cost_usd": 0.0,
                                              "coach_template": {"name": "later", "since_step": 2}}  # fmt: skip
    # The figures shown in the first resumed step: the steps up to the checkpoint, rebuilt from episodes.jsonl.
    shown = {a["coach_request"]["coach_bias"] for ep in episodes if ep["step"] == saved + 1 for a in ep["actions"]}
    (figures,) = shown
    assert figures.startswith(f"Your recent scoring in this run (the last {saved} training step"), figures
    assert f"{saved * 8} scored actions" in figures  # 4 episodes x 2 agents per step
