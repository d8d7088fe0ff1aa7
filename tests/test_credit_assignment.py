"""The credit-assignment benchmark's pure parts (benchmarks/credit_assignment.py): the chain environment's
success and per-agent coach ground truth, the heuristic coach's verdicts on them, and the threshold crossing.
No training here; the benchmark itself runs the real trainer."""

import asyncio
import os
import sys

from openrlhf_mappa.coach import CoachRequest, build_coach
from openrlhf_mappa.topology import AgentSpec, Topology

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from credit_assignment import GOALS, ChainEnv, steps_to_threshold  # noqa: E402


def play(upstream: str, downstream: str):
    agents = [AgentSpec(name=n, model="m", role=n, prompt="{task}\n{history}") for n in GOALS]
    topology = Topology(name="t", env="credit_assignment:ChainEnv", agents=agents, coach_template="{agent_output}")
    env = ChainEnv(topology, {"prompt": "Request 0.", "answer": "-"}, "/nonexistent", goals=GOALS)
    for agent, reply in zip(agents, (upstream, downstream)):
        env.step(agent, 0, reply)
    verdicts = [
        asyncio.run(build_coach("heuristic").score(CoachRequest(
            "e", a.name, 0, a.role, "Request 0.", "chain", "", reply, "", ground_truth=env.coach_ground_truth(a)
        )))  # fmt: skip
        for a, reply in zip(agents, (upstream, downstream))
    ]
    return env.outcome(), [v.score for v in verdicts]


def test_success_needs_both_agents_and_the_coach_judges_each_alone():
    outcome, scores = play("7\x01", "ok")
    assert outcome == {"success": True, "upstream_hit": True, "downstream_hit": True}
    assert scores == [10.0, 10.0]
    # the downstream agent cannot repair an upstream miss: the episode fails, its own action still scores 10
    outcome, scores = play("\x01x", "5 ok")
    assert outcome["success"] is False and outcome["upstream_hit"] is False and outcome["downstream_hit"] is True
    assert scores[0] < 1.0 and scores[1] == 10.0
    outcome, scores = play("12", "AB!")
    assert (outcome["success"], scores[0]) == (False, 10.0) and scores[1] < 1.0


def test_steps_to_threshold_uses_a_full_trailing_window():
    assert steps_to_threshold([0.0, 0.9, 0.9, 0.5], 0.8, 3) is None  # trailing means 0.6, 0.77
    assert steps_to_threshold([0.0, 0.9, 0.9, 0.9], 0.8, 3) == 4
    assert steps_to_threshold([1.0, 1.0], 0.8, 3) is None  # the window is never full
    assert steps_to_threshold([0.5, 0.8, 0.9], 0.8, 1) == 2
    assert steps_to_threshold([], 0.8, 3) is None
