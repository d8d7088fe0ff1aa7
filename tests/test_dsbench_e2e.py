"""A real DSBench MAPPA run on CPU: three tiny agents (Data Engineer, Modeler, Analyst), each with its own
ZeRO-3 actor and vLLM engine (Ray, vLLM, DeepSpeed for real), on one task of the offline pack, coached by
the offline heuristic coach. Tiny untrained agents cannot solve the task; the run must still complete, with
a verdict for every action of all three agents and the DSBench outcome fields in every episode."""

import glob
import json
import os
import subprocess
import sys

import pytest
import yaml

from conftest import MAPPA, REPO, local_cluster_env, run_training

AGENTS = ["data_engineer", "modeler", "analyst"]


@pytest.mark.e2e
def test_dsbench_mappa_run_completes_with_verdicts(tmp_path, tiny_model):
    pack = tmp_path / "pack"
    subprocess.run([MAPPA, "dsbench", "make-pack", str(pack)], check=True, capture_output=True, timeout=300)
    task = next(json.loads(line) for line in open(pack / "tasks.jsonl") if '"sk-diabetes"' in line)
    (tmp_path / "tasks.jsonl").write_text(json.dumps(task) + "\n")
    topology = yaml.safe_load(open(os.path.join(REPO, "examples", "configs", "dsbench.yaml")))
    for agent in topology["agents"]:
        agent["max_actions"] = 1
    (tmp_path / "dsbench.yaml").write_text(yaml.safe_dump(topology))

    run_dir = tmp_path / "run"
    argv = [
        "--mappa.topology", str(tmp_path / "dsbench.yaml"),
        "--mappa.model", tiny_model,
        "--mappa.coach.kind", "heuristic",
        "--mappa.run_dir", str(run_dir),
        "--data.prompt_dataset", str(tmp_path / "tasks.jsonl"),
        "--actor.num_gpus_per_node", "1",
        "--vllm.num_engines", "1",
        "--vllm.sync_backend", "gloo",
        "--vllm.enforce_eager",
        "--vllm.gpu_memory_utilization", "0.2",
        "--ds.zero_stage", "3",
        "--ds.attn_implementation", "sdpa",
        "--algo.kl.init_coef", "0",
        "--actor.adam.lr", "1e-4",
        "--actor.lr_warmup_ratio", "0",
        "--rollout.batch_size", "1",
        "--rollout.n_samples_per_prompt", "2",
        "--rollout.micro_batch_size", "1",
        "--rollout.max_new_tokens", "16",
        "--data.max_len", "3072",  # the prompts alone are ~2,500 (byte) tokens; history is shortened to fit
        "--train.batch_size", "2",
        "--train.micro_batch_size", "1",
        "--train.num_episodes", "1",
        "--ckpt.path", str(tmp_path / "ckpt"),
        "--ckpt.output_dir", str(tmp_path / "final"),
    ]  # fmt: skip
    # 3 agents x (actor + vLLM engine); no reference model with KL 0.
    env = local_cluster_env(6, VLLM_CPU_KVCACHE_SPACE="1")
    proc = run_training([sys.executable, "-m", "openrlhf_mappa.cli.train_mappa_ray", *argv], tmp_path / "train",
                        timeout=1200, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]

    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1]
    for name in AGENTS:
        assert metrics[0][f"agent/{name}/coach_score"] is not None

    episodes = [json.loads(line) for line in open(run_dir / "episodes.jsonl")]
    assert len(episodes) == 2
    for ep in episodes:
        assert ep["task_id"] == "sk-diabetes" and ep["task_type"] == "regression"
        agents = [a["agent"] for a in ep["actions"]]
        assert sorted(set(agents), key=AGENTS.index) == AGENTS and agents == sorted(agents, key=AGENTS.index)
        for a in ep["actions"]:
            v = a["verdict"]
            assert v["status"] == "ok" and v["score"] is not None and v["coach"] == "heuristic"
            assert "contract rule" in v["rationale"]  # the env's workspace check reached the coach
        out = ep["outcome"]
        assert out["success"] is False and out["status"] == "missing_file" and out["error"]
        assert out["metric_name"] == "rmse" and out["task_type"] == "regression"
        assert {"metric", "baseline", "best", "relative_score"} <= set(out)
        assert "analyst" in out["missing_files"]

    workspaces = glob.glob(str(run_dir / "workspaces" / "*" / "*"))
    assert len(workspaces) == 2
    for ws in workspaces:
        files = os.listdir(ws)
        assert {"train.csv", "test.csv", "sample_submission.csv"} <= set(files) and "test_answer.csv" not in files
