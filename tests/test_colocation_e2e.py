"""OpenRLHF's hybrid engine for a team, for real on CPU: three tiny agents (the relay, heuristic coach), each
with its own weights, colocated on ONE set of 2 logical GPUs (--mappa.colocate team) with vLLM and DeepSpeed
sleep, 2 steps, ZeRO-3. Each agent's actor has 2 ranks and 2 engines, one on each GPU, so each GPU holds all three
agents' actor ranks and engines, each asking Ray for a third of it.

On CPU sleep frees nothing, so the order of the calls is what is tested: patches/hybrid_engine.py logs every
engine's sleep / wake_up / generate and every actor's reload / offload / training from the process that ran it
(MAPPA_CALL_LOG). Asserted from that log: no agent's engine was awake (weights or KV cache) while any actor
trained; no actor's states were loaded while any engine generated; the agents trained one after another; each
agent's engines started and slept before the next agent's started (vLLM's memory profiling). And,
as in test_mappa_e2e: every agent's weights moved, and after the sync both engines of each agent hold its own
actor's weights and not another agent's (log-probs of a fixed sequence; the engines woken up to answer).
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from conftest import MAPPA, REPO, TINY_RUN_FLAGS, hybrid_engine_timeline, local_cluster_env, overlaps, run_training

TESTS = os.path.dirname(os.path.abspath(__file__))
AGENTS = ("quantity", "item", "code")


def run_and_probe(argv: list, out_path: str):
    """In a child process: train, then probe every agent's engines and actor (test_mappa_e2e.probe_agents)."""
    import ray

    from openrlhf_mappa.cli.train_mappa_ray import parse_args, train
    from test_mappa_e2e import probe_agents

    agents = train(parse_args(argv))
    with open(out_path, "w") as f:
        json.dump(probe_agents(agents), f)
    ray.shutdown()


@pytest.mark.e2e
def test_team_colocated_on_two_gpus_sleeps_engines_while_actors_train(tmp_path):
    models = {}
    for seed, name in enumerate(AGENTS):  # different initial weights: whose weights an engine holds is visible
        models[name] = str(tmp_path / f"model-{name}")
        subprocess.run([MAPPA, "tiny-model", models[name], "--seed", str(seed)], check=True, capture_output=True)
    topology = yaml.safe_load(open(os.path.join(REPO, "examples", "configs", "relay.yaml")))
    for agent in topology["agents"]:
        agent["model"] = models[agent["name"]]
    (tmp_path / "topology.yaml").write_text(yaml.safe_dump(topology))
    run_dir, call_log, probe_path = tmp_path / "run", tmp_path / "calls.jsonl", str(tmp_path / "probe.json")
    argv = [
        "--mappa.topology", str(tmp_path / "topology.yaml"),
        "--data.prompt_dataset", os.path.join(REPO, "examples", "data", "relay_train.jsonl"),
        "--data.max_samples", "4",  # 2 steps of 2 tasks x 2 samples
        "--mappa.run_dir", str(run_dir),
        *TINY_RUN_FLAGS,
        "--actor.num_gpus_per_node", "2", "--vllm.num_engines", "2",  # after TINY_RUN_FLAGS' 1: the later flag wins
        "--mappa.colocate", "team", "--vllm.enable_sleep", "--ds.enable_sleep",
        "--actor.adam.lr", "1e-2", "--actor.lr_warmup_ratio", "0",
        "--ckpt.path", str(tmp_path / "ckpt"), "--ckpt.output_dir", str(tmp_path / "final"),
    ]  # fmt: skip
    env = local_cluster_env(2, MAPPA_CALL_LOG=str(call_log))
    child = (f"import sys; sys.path.insert(0, {TESTS!r}); from test_colocation_e2e import run_and_probe; "
             f"run_and_probe({argv!r}, {probe_path!r})")  # fmt: skip
    proc = run_training([sys.executable, "-c", child], tmp_path / "train", timeout=1500, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert "placement plan for 2 GPUs" in proc.stdout

    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m[f"agent/{n}/updated"] == 1 and m[f"agent/{n}/trained_actions"] == 4 for m in metrics for n in AGENTS)

    timeline = hybrid_engine_timeline(str(call_log), str(run_dir / "processes.json"))
    assert set(timeline) == set(AGENTS)
    every = lambda kind: [s for t in timeline.values() for s in t[kind]]
    for name, t in timeline.items():
        assert len(t["train"]) == 2 * 2, (name, t["train"])  # 2 steps x 2 actor ranks
        assert len(t["loaded"]) == 2 * 2 and len(t["generate"]) > 0, name
        # Each fit ran between a reload and the next offload of its own rank's states.
        assert all(any(l0 <= t0 and t1 <= l1 for l0, l1 in t["loaded"]) for t0, t1 in t["train"]), name
    assert overlaps(every("awake"), every("train")) == []  # no engine awake while an actor trained
    assert overlaps(every("loaded"), every("generate")) == []  # no actor loaded while an engine generated
    for a in AGENTS:  # one agent at a time on the team's GPUs
        for b in AGENTS:
            assert a == b or overlaps(timeline[a]["loaded"], timeline[b]["loaded"]) == [], (a, b)
    # vLLM sizes its KV cache from the GPU's free memory while it starts: each agent's two engines started, and both
    # slept, before the next agent's began (engines starting at once would count each other's memory as their own).
    started = sorted(AGENTS, key=lambda n: min(timeline[n]["init"]))
    for a, b in zip(started, started[1:]):
        assert len(timeline[a]["init"]) == 2, (a, timeline[a]["init"])
        asleep = max(t1 for _, t1 in sorted(timeline[a]["sleep"])[:2])  # its engines' first sleeps: at start-up
        assert asleep <= min(t0 for t0, _ in timeline[b]["init"]), (a, b)

    result = json.load(open(probe_path))
    from test_openrlhf_cpu_e2e import hf_probe_logprobs

    actor = {n: torch.tensor(v) for n, v in result["actor"].items()}
    for n in AGENTS:
        init = torch.tensor(hf_probe_logprobs(models[n], result["probe"]))
        assert (actor[n] - init).abs().mean() > 0.05, n  # trained: its weights moved
        for engine in result["engines"][n]:  # both engines of agent n hold its actor's weights, no one else's
            engine = torch.tensor(engine)
            assert (engine - actor[n]).abs().max() < 0.02, n
            assert all((engine - actor[o]).abs().mean() > 0.1 for o in AGENTS if o != n), n
