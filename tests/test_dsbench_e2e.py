"""A real DSBench MAPPA run on CPU: three tiny agents (Data Engineer, Modeler, Analyst), each with its own
ZeRO-3 actor and vLLM engine (Ray, vLLM, DeepSpeed for real), on one task of the offline pack, coached by
the offline heuristic coach, for 3 steps trained asynchronously (--train.async_enable: each step's rollout runs
while the team trains on the one before) with OpenRLHF's off-policy correction. Tiny untrained agents cannot solve
the task; the run must still complete, with a verdict for every action of all three agents and the DSBench outcome
fields in every episode.

It trains on the default path (no --mappa.train_truncated): the agents' model is the tiny one made to end its
replies on its own (ending_model), so its actions are not cut off at the token limit and train. Asserted from
episodes.jsonl: every action that ended and was scored trains on its score (DSBench's scale 1), each agent on a
whole number of batches of its actions, its advantages ordered as its rewards; the cut-off ones (if any) are
zero-loss rows of those batches (advantage 0) and counted. From episodes.jsonl and the sync log (syncs.jsonl): step t + 1's rollout overlapped step t's
training; every action's own weight version is the one its agent's engines had while its episode ran; none more
than the staleness bound behind trained; the correction ran (its vLLM KL and filter ratio logged)."""

import glob
import json
import os
import subprocess
import sys
from fnmatch import fnmatchcase

import pytest
import torch
import yaml

from conftest import MAPPA, REPO, local_cluster_env, run_training
from openrlhf_mappa.envs.dsbench import ARTIFACTS, SUBMISSIONS

AGENTS = ["data_engineer", "modeler", "analyst"]


def ending_model(src: str, out: str) -> str:
    """`src` (a tiny model) made to end its replies on its own: a constant added to every input embedding dominates
    the residual stream, so the last hidden state points about the same way for any input, and the output layer's
    EOS row is set along it, at the logit that gives EOS about 0.6 of the probability at each token. A random
    tiny model seldom ends a reply within 16 tokens; this one all but never runs to the limit (0.4^16)."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32), AutoTokenizer.from_pretrained(src)
    eos = tokenizer.eos_token_id
    with torch.no_grad():
        model.get_input_embeddings().weight += torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
        ids = tokenizer("Data Engineer: load train.csv, then save X_train.pkl; " * 8, return_tensors="pt").input_ids
        h_TD = model.model(ids).last_hidden_state[0]  # after the final norm
        head = model.get_output_embeddings().weight
        head[eos] = 0.0
        others_T = torch.logsumexp(h_TD @ head.T, -1)  # the EOS logit at p = 0.6 is log(0.6 / 0.4) above these
        direction = h_TD.mean(0)
        head[eos] = direction * (others_T.mean() + torch.log(torch.tensor(1.5))) / direction.dot(direction)
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    shutil.copy(os.path.join(src, "generation_config.json"), out)  # vLLM stops at <|im_end|>
    return out


@pytest.mark.e2e
def test_dsbench_mappa_run_trains_on_replies_that_ended(tmp_path, tiny_model):
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
        "--mappa.model", ending_model(tiny_model, str(tmp_path / "ending-model")),
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
        "--train.num_episodes", "3",  # 3 steps of the one task
        "--train.async_enable",
        "--algo.advantage.is_correction_level", "token",
        "--ckpt.path", str(tmp_path / "ckpt"),
        "--ckpt.output_dir", str(tmp_path / "final"),
    ]  # fmt: skip
    # 3 agents x (actor + vLLM engine); no reference model with KL 0.
    env = local_cluster_env(6, VLLM_CPU_KVCACHE_SPACE="1")
    proc = run_training([sys.executable, "-m", "openrlhf_mappa.cli.train_mappa_ray", *argv], tmp_path / "train",
                        timeout=1200, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]

    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    episodes = [json.loads(line) for line in open(run_dir / "episodes.jsonl")]
    syncs = [json.loads(line) for line in open(run_dir / "syncs.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2, 3] and len(episodes) == 6 and "--mappa.train_truncated" not in argv
    ended = 0
    for m in metrics:
        mine = [ep for ep in episodes if ep["step"] == m["step"]]
        ended += assert_trained_on_scores(m, mine)
        assert "agent/modeler/vllm_kl" in m and 0 <= m["agent/modeler/is_filter_ratio"] <= 1  # the correction ran
    assert ended == 18, "the replies ran to the token limit: the default path trained nothing"
    assert_async(episodes, syncs, metrics)
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

    # each workspace has its store of fetched files beside it (WS.kept)
    workspaces = [w for w in glob.glob(str(run_dir / "workspaces" / "*" / "*")) if not w.endswith(".kept")]
    assert len(workspaces) == 6
    for ws in workspaces:  # dsbench.yaml's stateless workspace: what the authors upload and their fetched kinds
        files = os.listdir(ws)
        assert {"train.csv", "test.csv"} <= set(files) and "sample_submission.csv" not in files
        assert all(f in ("train.csv", "test.csv") or any(fnmatchcase(f, p) for p in ARTIFACTS + SUBMISSIONS)
                   for f in files), files


def assert_trained_on_scores(m: dict, episodes: list) -> int:
    """One step's metrics `m` and its episodes on the default path: an action that ended on its own trains on its
    score; one cut off at the token limit is a zero-loss row (--mappa.batch_semantics authors: its score in the
    whitening statistics, advantage 0) and counted. Each agent trains on whole batches (--train.batch_size 2) of all
    its actions. Returns how many actions trained with a loss."""
    ended = 0
    for name in AGENTS:
        own = [a for ep in episodes for a in ep["actions"] if a["agent"] == name]
        trainable = [a for a in own if not a["truncated"]]
        assert m[f"agent/{name}/coach_score"] == pytest.approx(sum(a["verdict"]["score"] for a in own) / len(own))
        assert all(a["reward"] == a["verdict"]["score"] for a in own)  # DSBench's reward_scale 1, cut-off ones too
        assert [a["zero_loss"] for a in own] == [a["truncated"] for a in own]
        assert m[f"agent/{name}/truncated_left_out"] == len(own) - len(trainable)
        assert m[f"agent/{name}/trained_actions"] == len(own) // 2 * 2
        assert m[f"agent/{name}/updated"] == int(len(own) >= 2)
        rows = [a for a in own if a["advantage"] is not None]
        assert len(rows) == m[f"agent/{name}/trained_actions"]
        assert m[f"agent/{name}/zero_loss_rows"] == sum(a["zero_loss"] for a in rows)
        assert all(a["advantage"] == 0.0 for a in rows if a["zero_loss"])
        trained = [a for a in rows if not a["zero_loss"]]
        for a in trained:  # KL 0: each row's return is its reward, whitened over the agent's batch
            for b in trained:
                assert (a["reward"] > b["reward"]) == (a["advantage"] > b["advantage"] + 1e-6), name
        ended += len(trained)
    return ended


def assert_async(episodes: list, syncs: list, metrics: list, agents: list = AGENTS, queue: int = 1,
                 partial: bool = False, runs: tuple = ((1, 3),)):
    """Async training with --train.async_queue_size `queue`, from the records: (1) the queue was used: step t +
    queue's rollout began before step t's last sync ended (it would wait for step t's update otherwise), for each t
    whose t + queue ran in the same process (`runs`: each process's first and last step); (2) each action's own
    version is one its agent's engines had while its episode ran (no fewer than that agent's syncs ended before the
    episode began, no more than those begun before it ended), ending on the same one, or with partial rollouts
    (`partial`) on a later one no later than that, and every other agent's in it is that agent's action's before it;
    (3) no action more than `queue` versions behind when its step trained (the syncs of earlier steps) trained, some
    exactly `queue` behind (the queue was full), and the logged staleness is the one recomputed."""
    of = lambda name, step: [s for s in syncs if s["agent"] == name and s["step"] < step]  # synced before step trains
    for first, last in runs:
        for t in range(first, last - queue + 1):
            last_sync = max(s["end"] for s in syncs if s["step"] == t)
            assert min(ep["timings"]["start"] for ep in episodes if ep["step"] == t + queue) < last_sync, t
    for ep in episodes:
        for k, a in enumerate(ep["actions"]):
            mine = [s for s in syncs if s["agent"] == a["agent"]]
            v, most = a["versions"][a["agent"]], sum(s["start"] < ep["timings"]["end"] for s in mine)
            assert sum(s["end"] < ep["timings"]["start"] for s in mine) <= v <= most, (ep["step"], a["agent"])
            # without partial rollouts a sync waits for the generation in flight
            assert v <= a["version_end"] <= most if partial else a["version_end"] == v, (ep["step"], a["agent"])
            earlier = [b for b in ep["actions"][:k] if b["agent"] != a["agent"] and b["round"] < a["round"]]
            # reversed: an agent that acted twice counts at its oldest version (rollout.py's rule)
            assert {b["agent"]: b["versions"][b["agent"]] for b in reversed(earlier)} == {
                j: u for j, u in a["versions"].items() if j != a["agent"]}
    stale = []
    for m in metrics:
        for name in agents:
            lags = [len(of(name, m["step"])) - a["versions"][name] for ep in episodes if ep["step"] == m["step"]
                    for a in ep["actions"] if a["agent"] == name]
            assert m[f"agent/{name}/staleness_max"] == max(lags) and m[f"agent/{name}/stale_left_out"] == 0
            assert m[f"agent/{name}/staleness_mean"] == pytest.approx(sum(lags) / len(lags)), (m["step"], name)
            stale += lags
    assert max(stale) == queue, f"no action was made by weights {queue} updates old: the queue was never full"
    for ep in episodes:
        for a in ep["actions"]:
            lag = max(len(of(j, ep["step"])) - u for j, u in a["versions"].items())
            assert a["reward"] is None or lag <= queue, (ep["step"], a["agent"], lag)
