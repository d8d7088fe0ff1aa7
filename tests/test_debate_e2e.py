"""The debate pipeline trained for real on CPU: examples/scripts/train_mappa_debate_tiny_cpu.sh, run as shipped
but for one step (its extra flags: 2 problems x 2 samples, lr 1e-3, token budgets) and colocated per agent, the
authors' setup (--mappa.colocate agent with vLLM and DeepSpeed sleep): three tiny agents, each with its own ZeRO-3
actor, reference model and vLLM engine sharing one logical GPU of its own. The coach, instead of the script's heuristic
one, reviews each episode in hindsight (--mappa.coach.mode hindsight) through the OpenAI-compatible backend,
against a real HTTP server on 127.0.0.1 standing in for a paid coach API (tests/coach_server.py): one review
request per episode and no per-action request, each action trained on the score its episode's review gave it.

The script's python is a wrapper that runs the real CLI's `train` and saves, per agent, the experience tensors
the advantage step leaves (rewards.compute_advantages observed, not replaced). Asserted from those and from
episodes.jsonl: every episode is debater_a, debater_b (round 0), both again (round 1), then the judge (round 2);
every row an agent trained on is one of its own actions, token for token, trained on that action's reward, with
the row's mean advantage recorded for that action, and every action with a reward trained exactly once, so each
debater trained both of its rounds' actions of every episode. With token budgets (--train.dynamic_batch_enable,
1,000 tokens), each agent's experiences came in as many micro-batches as OpenRLHF's first-fit count of their lengths.

From the hybrid engine's call log (patches/hybrid_engine.py, see test_resume_e2e; in the log's order of
events, not by any clock): no agent's engine was awake while its own actor trained, no actor was loaded while
any engine generated, and the agents, on GPUs of their own, were in training at the same time. Each actor's own
plan under the budget (upstream's setup_dynamic_batch, its train line in the log) holds every row of its agent's
batch once, each train batch in its first-fit count of micro-batches, and the optimizer steps the metrics count
(a debater's actor planned for one action an episode would train half its rows). After the sync each agent's
engine holds its actor's weights, which moved.
"""

import itertools
import json
import os
import re
import shutil
import sys

import pytest
import torch

from coach_server import CoachServer, review_reply
from conftest import (REPO, assert_documented_episodes, assert_rows_are_their_actions, hybrid_engine_timeline,
                      local_cluster_env, overlaps, record_experiences, run_training)

TESTS = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(REPO, "examples", "scripts", "train_mappa_debate_tiny_cpu.sh")
AGENTS = ("debater_a", "debater_b", "judge")
BUDGET = 1000  # tokens a micro-batch (--rollout/--train.max_tokens_per_gpu): 3-4 of these actions


def train_recording(argv: list, tensors_path: str, probe_path: str):
    """The script's `python -m openrlhf_mappa.cli.train_mappa_ray ARGS`, with every step's per-agent
    experience tensors saved to tensors_path; then every agent's engine and actor probed (probe_agents)."""
    import ray

    from test_mappa_e2e import probe_agents

    from openrlhf_mappa.cli.train_mappa_ray import parse_args, train

    assert argv[:2] == ["-m", "openrlhf_mappa.cli.train_mappa_ray"], argv[:2]
    record_experiences(tensors_path)
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
                "--mappa.colocate", "agent", "--vllm.enable_sleep", "--ds.enable_sleep",
                "--train.dynamic_batch_enable", "--rollout.max_tokens_per_gpu", str(BUDGET),
                "--train.max_tokens_per_gpu", str(BUDGET)]
    call_log = tmp_path / "calls.jsonl"
    # 3 agents x 1 GPU, each holding the agent's actor, reference and engine
    env = local_cluster_env(3, PY=str(python), OUT=str(out), PYTHONPATH=REPO, MAPPA_CALL_LOG=str(call_log))
    with CoachServer() as server:
        hindsight = ["--mappa.coach.kind", "openai", "--mappa.coach.mode", "hindsight", "--mappa.coach.model",
                     "rule-coach", "--mappa.coach.base_url", server.base_url]  # after the script's: the later wins
        proc = run_training(["bash", SCRIPT, *one_step, *hindsight], tmp_path / "train", timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]

    episodes = [json.loads(line) for line in open(out / "run" / "episodes.jsonl")]
    assert assert_documented_episodes(str(out / "run" / "episodes.jsonl"))["review"] == 4  # the documented record
    assert len(episodes) == 4  # 2 problems x 2 samples, one step
    for ep in episodes:
        assert [(a["agent"], a["turn"], a["round"], a["position"]) for a in ep["actions"]] == [
            ("debater_a", 0, 0, 0), ("debater_b", 0, 0, 1), ("debater_a", 1, 1, 2), ("debater_b", 1, 1, 3),
            ("judge", 0, 2, 4)]  # fmt: skip
        assert ep["action_limit"] == "" and all(a["reward"] is not None for a in ep["actions"])

    from transformers import AutoTokenizer

    steps = torch.load(tensors_path)
    assert len(steps) == 1 and set(steps[0]) == set(AGENTS)
    # Each row an agent trained on is one of its own actions, on that action's reward, with that action's advantage
    # recorded; and every action of this agent trained once: for a debater, both rounds of each of the 4 episodes.
    rows = assert_rows_are_their_actions(steps, episodes, AutoTokenizer.from_pretrained(str(out / "tiny-model")))
    for name in AGENTS:
        rounds = (0, 1) if name != "judge" else (2,)
        assert sorted((i, episodes[i]["actions"][j]["round"]) for i, j in rows[1, name]) == [(i, r) for i in range(4) for r in rounds]
        assert all(torch.isfinite(b["advantages"]).all() for b in steps[0][name])
    # Token budgets: each agent's experiences came in as many micro-batches as its actions' lengths need (OpenRLHF's
    # first-fit count), not in --rollout.micro_batch_size rows (2) each.
    from openrlhf.utils.seqlen_balancing import get_minimum_num_micro_batch_size

    lengths = {n: [int(x) for b in steps[0][n] for x in b["attention_mask"].sum(1)] for n in AGENTS}
    counts = [len(steps[0][n]) for n in AGENTS]
    assert counts == [get_minimum_num_micro_batch_size(lengths[n], BUDGET, 1, 1) for n in AGENTS], lengths
    assert counts != [len(lengths[n]) // 2 for n in AGENTS], lengths

    (metrics,) = [json.loads(line) for line in open(out / "run" / "metrics.jsonl")]
    assert [metrics[f"agent/{n}/trained_actions"] for n in AGENTS] == [8, 8, 4]
    assert all(metrics[f"agent/{n}/updated"] == 1 for n in AGENTS)
    assert metrics["outcome/action_limit_episodes"] == 0

    # Hindsight: the 4 episodes (5 actions each) cost 4 coach requests, all reviews, each action's reward its score.
    assert (metrics["coach/requests"], metrics["coach/reviews_ok"], metrics["coach/verdicts_ok"]) == (4, 4, 20)
    prompts = [r["prompt"] for r in server.requests]
    assert len(prompts) == 4 and all("=== Action 1 of 5: agent debater_a" in p for p in prompts)  # no per-action one
    for ep in episodes:
        outputs = [f"Output:\n{a['response_text']}" for a in ep["actions"]]
        # This episode's review request: its outputs in its order (another episode may hold the same ones swapped).
        in_order = re.compile(".*".join(map(re.escape, outputs)), re.DOTALL)
        prompt = next(p for p in prompts if in_order.search(p))
        assert f'"success": {str(ep["outcome"]["success"]).lower()}' in prompt  # it saw the outcome
        reply = json.loads(review_reply(prompt, ()))
        review = ep["review"]
        assert (review["status"], review["coach"], review["responsible"]) == ("ok", "openai:rule-coach", reply["responsible"] - 1)
        assert review["scores"] == [e["score"] for e in reply["actions"]]
        for a, score in zip(ep["actions"], review["scores"]):
            assert (a["verdict"]["source"], a["verdict"]["score"]) == ("hindsight", score)
            assert a["reward"] == pytest.approx(0.1 * score)  # debate.yaml's reward_scale, on the review's score

    timeline = hybrid_engine_timeline(str(call_log), str(out / "run" / "processes.json"))
    assert set(timeline) == set(AGENTS)
    for name, t in timeline.items():
        assert len(t["train"]) == 1 and len(t["loaded"]) == 1 and t["generate"], name
        assert overlaps(t["awake"], t["train"]) == [], name  # its engine slept while its actor trained
    assert overlaps([s for t in timeline.values() for s in t["loaded"]], [s for t in timeline.values() for s in t["generate"]]) == []
    trains = [timeline[n]["train"][0] for n in AGENTS]
    # On GPUs of their own, the agents trained at once: one agent's training began (its line in the log) before
    # another's ended, and the other's began before the first's ended.
    assert overlaps(trains[:1], trains[1:]), trains
    # What each actor trained, from its own plan (the metrics count the rows handed over, trained or not): every row
    # of its batch in one micro-batch; each train batch of 4 rows (the script's --train.batch_size), whole, in as
    # many micro-batches as the first-fit count of its lengths; one optimizer step per train batch.
    for name in AGENTS:
        (plan,) = timeline[name]["plans"]
        assert plan is not None and sorted(sum(plan, [])) == sorted(lengths[name]), (name, plan, lengths[name])
        ends = list(itertools.accumulate(map(len, plan)))  # rows planned up to each micro-batch's end
        assert set(range(4, len(lengths[name]) + 1, 4)) <= set(ends), (name, plan)
        for start in range(0, len(lengths[name]), 4):
            batch = [mb for mb, end in zip(plan, ends) if start < end <= start + 4]
            assert len(batch) == get_minimum_num_micro_batch_size(sum(batch, []), BUDGET, 1, 1), (name, plan)
        assert metrics[f"agent/{name}/optimizer_steps"] == len(lengths[name]) // 4, name

    from test_openrlhf_cpu_e2e import hf_probe_logprobs

    probe = json.load(open(probe_path))
    init = torch.tensor(hf_probe_logprobs(str(out / "tiny-model"), probe["probe"]))
    for name in AGENTS:
        engine, actor = torch.tensor(probe["engine"][name]), torch.tensor(probe["actor"][name])
        assert (engine - actor).abs().max() < 0.02, name  # the sync reached this agent's engine
        # and the weights moved: 0.02-0.03 nats at the script's lr 1e-4 (measured), about the bf16 noise; hence 1e-3
        assert (actor - init).abs().mean() > 0.05, name
