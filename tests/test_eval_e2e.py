"""Evaluation for real on CPU: `mappa eval` with Ray + vLLM engines over per-agent checkpoints, one a full model and
one a LoRA adapter in PEFT format (served by an engine of its base with vLLM's LoRA); and what a real
MAPPA run (Ray, vLLM, DeepSpeed ZeRO-3) with evaluation during training and two baselines (one shared policy for
every role, GRPO-style group normalization) must leave, checked on test_startup_e2e's second run, which is one."""

import json
import shutil

import pytest

from conftest import MAPPA, assert_documented_episodes, local_cluster_env, run_training, two_agent_mathchat
from openrlhf_mappa.envs.mathchat import grade

AGENTS = ("problem_solver", "verifier")


@pytest.mark.e2e
def test_mappa_eval_over_per_agent_checkpoints(tmp_path, tiny_model):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    topology, tasks = two_agent_mathchat(tmp_path, num_tasks=3)
    # The layout of a run's HF exports, one per agent: the Problem Solver's a full model, the Verifier's (a LoRA
    # agent) its adapter on the tiny base, as peft saves it (test_lora_e2e checks a run's LoRA exports are so).
    solver, adapter = tmp_path / "final" / AGENTS[0], tmp_path / "final" / AGENTS[1]
    shutil.copytree(tiny_model, solver)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)  # B != 0
    get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), lora).save_pretrained(adapter)
    out = tmp_path / "eval.json"
    proc = run_training(
        [MAPPA, "eval", "--mappa.topology", topology, "--eval.dataset", tasks, "--checkpoint", str(tmp_path / "final"),
         "--eval.n_samples_per_prompt", "2", "--rollout.max_new_tokens", "12", "--data.max_len", "512",
         "--vllm.enforce_eager", "--vllm.gpu_memory_utilization", "0.2", "--out", str(out)],
        tmp_path / "eval", timeout=600, cwd=tmp_path, env=local_cluster_env(2),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.load(open(out))
    assert result["models"] == {AGENTS[0]: str(solver), AGENTS[1]: tiny_model}  # the adapter's base, from its config
    assert result["adapters"] == {AGENTS[1]: str(adapter)}  # the Verifier served with its adapter
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
    assert "tasks: accuracy" in proc.stdout and "problem_solver" in proc.stdout
    # Ray's and vLLM's output in eval.json.log, as the launcher's in train.log: the terminal keeps the
    # results.
    assert f"[mappa] eval: Ray's and vLLM's output goes to {out}.log" in proc.stdout
    said = (proc.stdout + proc.stderr).splitlines()
    assert len(said) < 40 and "INFO" in open(f"{out}.log").read(), said  # ~100 lines of logs before
    episodes = [json.loads(line) for line in open(str(out) + ".episodes.jsonl")]
    assert assert_documented_episodes(str(out) + ".episodes.jsonl")["episode"] == 6  # the documented record
    assert len(episodes) == 6 and all(a["verdict"]["status"] == "skipped" for ep in episodes for a in ep["actions"])
    formatted = [a["formatted"] for ep in episodes for a in ep["actions"] if a["agent"] == "verifier"]
    assert None not in formatted and summary["agent/verifier/answer_format_rate"] == sum(formatted) / 6  # the \boxed{} rate


def assert_shared_policy_group_norm_run(run_dir):
    """A run of two_agent_mathchat's 2 tasks x 2 samples, one step, with --mappa.shared_policy --mappa.norm_scope group
    --eval.dataset (its tasks, 2 samples each), as test_startup_e2e's second run makes it: one actor and one engine
    play both roles (2 logical GPUs suffice) and train on both roles' 8 actions in one batch; each prompt's rewards
    are ±1/√2 (sample std) or 0 per role, and the advantages one increasing affine map of them (the authors'
    whitening); eval.jsonl has the step-0 (base model) and final evaluations, each recomputed from its problems."""
    assert sorted(json.load(open(run_dir / "processes.json"))) == ["problem_solver/actor rank 0", "problem_solver/vLLM engine 0"]
    m = json.loads(open(run_dir / "metrics.jsonl").readline())
    assert (m["agent/problem_solver/trained_actions"], m["agent/problem_solver/updated"]) == (8, 1)  # 4 episodes x 2 roles
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

    # Evaluation before training (the base model) and after the last step, each the mean pass@1 of its problems.
    evals = [json.loads(line) for line in open(run_dir / "eval.jsonl")]
    assert [(e["step"], e["dataset"], e["n_problems"], e["n_samples"]) for e in evals] == [(0, "tasks", 2, 2), (1, "tasks", 2, 2)]
    for e in evals:
        detail = json.load(open(run_dir / "eval" / f"tasks-step{e['step']}.json"))
        assert [p["id"] for p in detail["problems"]] == ["0", "1"] and detail["summary"] == {
            k: v for k, v in e.items() if k not in ("step", "dataset", "grader")}
        for p in detail["problems"]:  # every sample graded against its own problem's reference
            assert all(s["success"] == grade(s["answer"], p["reference"]) for s in p["samples"])
            assert p["pass1"] == sum(s["success"] for s in p["samples"]) / 2
        assert e["accuracy"] == sum(p["pass1"] for p in detail["problems"]) / 2 and e["agent/verifier/num_actions"] == 4
        # Graded by the coach too (the run's heuristic one asks no ANSWER_CORRECT: its score, no fallback);
        # the eval set is the training file, allowed by --mappa.allow_eval_overlap and counted. `accuracy`
        # heads as math-verify.
        assert (e["train_overlap"], e["coach/requests"], e["accuracy_coach/score"]) == (2, 8, 4)
        assert (e["accuracy_coach/score_fallback"], e["grader"]) == (0, "math-verify")
        assert e["accuracy_coach"] == sum(p["pass1_coach"] for p in detail["problems"]) / 2
