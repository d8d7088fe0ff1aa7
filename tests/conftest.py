import json
import os
import subprocess
import sys

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAPPA = os.path.join(os.path.dirname(sys.executable), "mappa")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny model built by the real `mappa tiny-model` console script."""
    out = str(tmp_path_factory.mktemp("models") / "tiny")
    subprocess.run([MAPPA, "tiny-model", out, "--seed", "0"], check=True, capture_output=True, timeout=300)
    return out


def local_cluster_env(num_gpus: int, **extra) -> dict:
    """The environment of a training subprocess: a new local Ray cluster with `num_gpus` logical GPUs, never
    a cluster that RAY_ADDRESS happens to name."""
    env = dict(os.environ, MAPPA_CPU_NUM_GPUS=str(num_gpus), **extra)
    env.pop("RAY_ADDRESS", None)
    return env


# The tiny MAPPA runs of the e2e tests: per agent one actor GPU and one eager vLLM engine, ZeRO-3 with SDPA
# (no flash-attn on CPU), no reference model; per step 2 tasks x 2 samples, trained as one batch of 4.
TINY_RUN_FLAGS = [
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
]  # fmt: skip


def two_agent_mathchat(tmp_path, num_tasks: int):
    """MathChat's Problem Solver and Verifier (one action each) and `num_tasks` sums; returns their paths."""
    topology = yaml.safe_load(open(os.path.join(REPO, "examples", "configs", "mathchat.yaml")))
    topology["agents"] = [dict(a, max_actions=1) for a in topology["agents"] if a["name"] in ("problem_solver", "verifier")]
    (tmp_path / "topology.yaml").write_text(yaml.safe_dump(topology))
    with open(tmp_path / "tasks.jsonl", "w") as f:
        for i in range(num_tasks):
            f.write(json.dumps({"id": i, "prompt": f"What is {i} + 2?", "answer": str(i + 2)}) + "\n")
    return str(tmp_path / "topology.yaml"), str(tmp_path / "tasks.jsonl")
