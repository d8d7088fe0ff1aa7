"""The debate pipeline trained for real on CPU: examples/scripts/train_mappa_debate_tiny_cpu.sh, run as shipped
but for one step (its extra flags: 2 problems x 2 samples, lr 1e-3) and colocated per agent, the authors' setup
(--mappa.colocate agent with vLLM and DeepSpeed sleep): three tiny agents, each with its own ZeRO-3 actor,
reference model and vLLM engine sharing one logical GPU of its own, and the heuristic coach.

The script's python is a wrapper that runs the real CLI's `train` and saves, per agent, the experience tensors
the advantage step leaves (rewards.compute_advantages observed, not replaced). Asserted from those and from
episodes.jsonl: every episode is debater_a, debater_b (round 0), both again (round 1), then the judge (round 2);
every row an agent trained on is one of its own actions, token for token, and every action with a reward
trained exactly once, so each debater trained both of its rounds' actions of every episode.

From the hybrid engine's call log (patches/hybrid_engine.py, see test_colocation_e2e): no agent's engine was
awake while its own actor trained, no actor was loaded while any engine generated, and the agents, on GPUs of
their own, trained at the same time. After the sync each agent's engine holds its actor's weights, which moved.
"""

import json
import os
import shutil
import sys

import pytest
import torch

from conftest import REPO, hybrid_engine_timeline, local_cluster_env, overlaps, run_training

TESTS = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(REPO, "examples", "scripts", "train_mappa_debate_tiny_cpu.sh")
AGENTS = ("debater_a", "debater_b", "judge")


def train_recording(argv: list, tensors_path: str, probe_path: str):
    """The script's `python -m openrlhf_mappa.cli.train_mappa_ray ARGS`, with every step's per-agent
    experience tensors saved to tensors_path; then every agent's engine and actor probed (probe_agents)."""
    import ray

    from test_mappa_e2e import probe_agents

    from openrlhf_mappa import rewards
    from openrlhf_mappa.cli.train_mappa_ray import parse_args, train

    assert argv[:2] == ["-m", "openrlhf_mappa.cli.train_mappa_ray"], argv[:2]
    steps, compute = [], rewards.compute_advantages

    def recording(batches_by_agent, kl_coef, scope="agent"):
        compute(batches_by_agent, kl_coef, scope)
        steps.append({name: [{k: getattr(b, k).clone() for k in ("sequences", "action_mask", "advantages")} for b in batches]
                      for name, batches in batches_by_agent.items()})  # fmt: skip
        torch.save(steps, tensors_path)

    rewards.compute_advantages = recording
    agents = train(parse_args(argv[2:]))
    with open(probe_path, "w") as f:
        json.dump(probe_agents(agents), f)
    ray.shutdown()


@pytest.mark.e2e
def test_debate_pipeline_trains_every_round_of_every_agent_on_its_own(tmp_path, tiny_model):
    out, tensors_path, probe_path = tmp_path / "out", str(tmp_path / "tensors.pt"), str(tmp_path / "probe.json")
    shutil.copytree(tiny_model, out / "tiny-model")  # the script builds it when missing; this one is built already
    python = tmp_path / "python"
    python.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {TESTS!r})\n"
                      f"from test_debate_e2e import train_recording\ntrain_recording(sys.argv[1:], {tensors_path!r}, {probe_path!r})\n")
    python.chmod(0o755)
    one_step = ["--data.max_samples", "2", "--rollout.batch_size", "2", "--actor.adam.lr", "1e-3",
                "--mappa.colocate", "agent", "--vllm.enable_sleep", "--ds.enable_sleep"]
    call_log = tmp_path / "calls.jsonl"
    # 3 agents x 1 GPU, each holding the agent's actor, reference and engine
    env = local_cluster_env(3, PY=str(python), OUT=str(out), PYTHONPATH=REPO, MAPPA_CALL_LOG=str(call_log))
    proc = run_training(["bash", SCRIPT, *one_step], tmp_path / "train", timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]

    episodes = [json.loads(line) for line in open(out / "run" / "episodes.jsonl")]
    assert len(episodes) == 4  # 2 problems x 2 samples, one step
    for ep in episodes:
        assert [(a["agent"], a["turn"], a["round"], a["position"]) for a in ep["actions"]] == [
            ("debater_a", 0, 0, 0), ("debater_b", 0, 0, 1), ("debater_a", 1, 1, 2), ("debater_b", 1, 1, 3),
            ("judge", 0, 2, 4)]  # fmt: skip
        assert ep["action_limit"] == "" and all(a["reward"] is not None for a in ep["actions"])

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out / "tiny-model"))
    (step,) = torch.load(tensors_path)
    assert set(step) == set(AGENTS)
    for name in AGENTS:
        own = {(tuple(tokenizer(a["prompt_text"], add_special_tokens=False)["input_ids"]), a["response_text"]): (i, a["round"])
               for i, ep in enumerate(episodes) for a in ep["actions"] if a["agent"] == name}  # fmt: skip
        trained = []
        for b in step[name]:
            for seq, mask in zip(b["sequences"].tolist(), b["action_mask"].bool()):
                response = [t for t, m in zip(seq[1:], mask.tolist()) if m]
                start = mask.tolist().index(True) + 1  # the action mask is shifted by one, as OpenRLHF's
                key = (tuple(seq[:start]), tokenizer.decode(response, skip_special_tokens=True))
                assert key in own, f"{name} trained on a row that is not one of its own actions"
                trained.append(own[key])
        # every action of this agent trained exactly once: for a debater, both rounds of each of the 4 episodes
        rounds = (0, 1) if name != "judge" else (2,)
        assert sorted(trained) == [(i, r) for i in range(4) for r in rounds], name
        assert all(torch.isfinite(b["advantages"]).all() for b in step[name])

    (metrics,) = [json.loads(line) for line in open(out / "run" / "metrics.jsonl")]
    assert [metrics[f"agent/{n}/trained_actions"] for n in AGENTS] == [8, 8, 4]
    assert all(metrics[f"agent/{n}/updated"] == 1 for n in AGENTS)
    assert metrics["outcome/action_limit_episodes"] == 0

    timeline = hybrid_engine_timeline(str(call_log), str(out / "run" / "processes.json"))
    assert set(timeline) == set(AGENTS)
    for name, t in timeline.items():
        assert len(t["train"]) == 1 and len(t["loaded"]) == 1 and t["generate"], name
        assert overlaps(t["awake"], t["train"]) == [], name  # its engine slept while its actor trained
    assert overlaps([s for t in timeline.values() for s in t["loaded"]], [s for t in timeline.values() for s in t["generate"]]) == []
    trains = [timeline[n]["train"][0] for n in AGENTS]
    assert overlaps(trains[:1], trains[1:]), trains  # on GPUs of their own, the agents trained at once

    from test_openrlhf_cpu_e2e import hf_probe_logprobs

    probe = json.load(open(probe_path))
    init = torch.tensor(hf_probe_logprobs(str(out / "tiny-model"), probe["probe"]))
    for name in AGENTS:
        engine, actor = torch.tensor(probe["engine"][name]), torch.tensor(probe["actor"][name])
        assert (engine - actor).abs().max() < 0.02, name  # the sync reached this agent's engine
        # and the weights moved: 0.02-0.03 nats at the script's lr 1e-4 (measured), about the bf16 noise; hence 1e-3
        assert (actor - init).abs().mean() > 0.05, name
