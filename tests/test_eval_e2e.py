"""Evaluation for real on CPU: `mappa eval` with Ray + vLLM engines over per-agent checkpoints, and
evaluation during training together with two baselines (one shared policy for every role, GRPO-style
group normalization) in a real MAPPA run (Ray, vLLM, DeepSpeed ZeRO-3)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import MAPPA, TINY_RUN_FLAGS, local_cluster_env, run_training, two_agent_mathchat
from openrlhf_mappa.envs.mathchat import grade

AGENTS = ("problem_solver", "verifier")
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.e2e
def test_mappa_eval_over_per_agent_checkpoints(tmp_path):
    topology, tasks = two_agent_mathchat(tmp_path, num_tasks=3)
    for seed, name in enumerate(AGENTS):  # the layout of a run's HF exports: one model per agent
        subprocess.run([MAPPA, "tiny-model", str(tmp_path / "final" / name), "--seed", str(seed)], check=True)
    out = tmp_path / "eval.json"
    proc = run_training(
        [MAPPA, "eval", "--topology", topology, "--data", tasks, "--checkpoint", str(tmp_path / "final"),
         "--n-samples", "2", "--max-new-tokens", "12", "--max-len", "512", "--enforce-eager",
         "--gpu-memory-utilization", "0.2", "--out", str(out)],
        tmp_path / "eval", timeout=600, cwd=tmp_path, env=local_cluster_env(2),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.load(open(out))
    assert result["models"] == {n: str(tmp_path / "final" / n) for n in AGENTS}
    data = result["datasets"]["tasks"]
    problems, summary = data["problems"], data["summary"]
    assert [p["id"] for p in problems] == ["0", "1", "2"] and all(len(p["samples"]) == 2 for p in problems)
    for p in problems:  # every sample graded against its own problem's reference
        for s in p["samples"]:
            assert s["success"] == grade(s["answer"], p["reference"])
        assert p["pass1"] == sum(s["success"] for s in p["samples"]) / 2
    assert summary["accuracy"] == sum(p["pass1"] for p in problems) / 3
    assert summary["n_problems"] == 3 and summary["n_samples"] == 2
    assert summary["agent/problem_solver/num_actions"] == 6 and summary["agent/verifier/num_actions"] == 6
    assert 0.0 <= summary["agent/verifier/answer_format_rate"] <= 1.0
    assert "tasks: accuracy" in proc.stdout and "problem_solver" in proc.stdout
    episodes = [json.loads(line) for line in open(str(out) + ".episodes.jsonl")]
    assert len(episodes) == 6 and all(a["verdict"]["status"] == "skipped" for ep in episodes for a in ep["actions"])


@pytest.mark.e2e
def test_shared_policy_group_norm_run_evaluates_before_and_after(tmp_path, tiny_model):
    topology, tasks = two_agent_mathchat(tmp_path, num_tasks=2)
    run_dir = tmp_path / "run"
    argv = [
        "--mappa.topology", topology,
        "--mappa.model", tiny_model,
        "--mappa.run_dir", str(run_dir),
        "--mappa.shared_policy",
        "--mappa.norm_scope", "group",
        "--data.prompt_dataset", tasks,
        "--eval.dataset", tasks,
        "--eval.n_samples_per_prompt", "2",
        *TINY_RUN_FLAGS,
        "--actor.adam.lr", "1e-2",
        "--actor.lr_warmup_ratio", "0",
        "--ckpt.path", str(tmp_path / "ckpt"),
        "--ckpt.output_dir", str(tmp_path / "final"),
    ]  # fmt: skip
    child = (f"import sys; sys.path.insert(0, {TESTS_DIR!r}); from test_mappa_e2e import run_and_probe; "
             f"run_and_probe({argv!r}, {str(tmp_path / 'probe.json')!r})")  # fmt: skip
    proc = run_training([sys.executable, "-c", child], tmp_path / "train", timeout=900, cwd=tmp_path, env=local_cluster_env(2))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]

    # One policy: one engine and one actor (2 logical GPUs sufficed), playing and training both roles.
    assert sorted(json.load(open(run_dir / "processes.json"))) == ["problem_solver/actor rank 0", "problem_solver/vLLM engine 0"]
    probe = json.load(open(tmp_path / "probe.json"))
    engine = {n: torch.tensor(v) for n, v in probe["engine"].items()}
    actor = torch.tensor(probe["actor"]["problem_solver"])
    from test_openrlhf_cpu_e2e import hf_probe_logprobs

    assert torch.equal(engine["problem_solver"], engine["verifier"])
    assert (engine["verifier"] - actor).abs().max() < 0.02  # synced after training
    assert (actor - hf_probe_logprobs(tiny_model, probe["probe"])).abs().mean() > 0.1  # trained
    m = json.loads(open(run_dir / "metrics.jsonl").readline())
    assert m["agent/problem_solver/trained_actions"] == 8  # 4 episodes x 2 roles, in one batch
    assert "agent/verifier/trained_actions" not in m and m["agent/verifier/num_actions"] == 4

    # Group normalization: within each prompt's 2 samples per role, rewards are ±1/√2 (sample std) or 0 when
    # equal; with no KL every token's return is that reward, whitened over the policy's batch (the authors'
    # group_norm): one increasing affine map from reward to advantage for all actions.
    episodes = [json.loads(line) for line in open(run_dir / "episodes.jsonl")]
    groups = {}
    for ep in episodes:
        for a in ep["actions"]:
            groups.setdefault((ep["task_id"], a["agent"]), []).append(a)
    for acts in groups.values():
        assert sum(a["reward"] for a in acts) == pytest.approx(0.0, abs=1e-5)
        assert all(abs(a["reward"]) == pytest.approx(2**-0.5, abs=1e-3) or a["reward"] == 0.0 for a in acts)
    assert any(a["reward"] != 0.0 for acts in groups.values() for a in acts)
    pairs = [(a["reward"], a["advantage"]) for acts in groups.values() for a in acts]
    (r0, a0), (r1, a1) = min(pairs), max(pairs)
    slope = (a1 - a0) / (r1 - r0)
    assert slope > 0 and all(adv == pytest.approx(a0 + slope * (r - r0), abs=1e-4) for r, adv in pairs)

    # Evaluation before training (the base model) and after the last step.
    evals = [json.loads(line) for line in open(run_dir / "eval.jsonl")]
    assert [(e["step"], e["dataset"], e["n_problems"], e["n_samples"]) for e in evals] == [(0, "tasks", 2, 2), (1, "tasks", 2, 2)]
    assert all(0.0 <= e["accuracy"] <= 1.0 and e["agent/verifier/num_actions"] == 4 for e in evals)
    detail = json.load(open(run_dir / "eval" / "tasks-step1.json"))
    assert [p["id"] for p in detail["problems"]] == ["0", "1"] and detail["summary"] == {k: v for k, v in evals[1].items() if k not in ("step", "dataset")}
