"""The credit-assignment benchmark's pure parts (benchmarks/credit_assignment.py): the chain environment's
success and per-agent grade (2- and 3-agent chains), the heuristic coach's verdicts and hindsight reviews on them,
and the threshold crossing.
No training here; the benchmark itself runs the real trainer."""

import asyncio
import os
import sys

from openrlhf_mappa.coach import CoachRequest
from openrlhf_mappa.coach.heuristic import HeuristicCoach
from openrlhf_mappa.episode import ToolFeedback
from openrlhf_mappa.topology import AgentSpec, Topology

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from credit_assignment import CHAINS, GOALS, ChainEnv, steps_to_threshold  # noqa: E402


def play(*replies, goals=GOALS, mode="per_action"):
    """One chain episode with these replies, judged by the heuristic coach: (outcome, scores) in per_action
    mode, (outcome, scores, the responsible action's index) in hindsight mode."""
    from openrlhf_mappa.coach import judge_episode

    agents = [AgentSpec(name=n, model="m", role=n, prompt="{task}\n{history}") for n in goals]
    topology = Topology(name="t", env="credit_assignment:ChainEnv", agents=agents, coach_template="{agent_output}")
    env = ChainEnv(topology, {"prompt": "Request 0.", "answer": "-"}, "/nonexistent", goals=goals)
    for agent, reply in zip(agents, replies):
        env.step(agent, 0, reply)
    coach = HeuristicCoach()
    requests = [CoachRequest("e", a.name, 0, a.role, "Request 0.", "chain", "", reply, "", ground_truth=env.coach_ground_truth(a),
                             env_grade=env.judge(a, reply, ToolFeedback(), None))
                for a, reply in zip(agents, replies)]  # fmt: skip

    async def judge():
        pending = [asyncio.ensure_future(coach.score(r)) for r in requests] if mode == "per_action" else []
        return await judge_episode(coach, mode, requests, env.outcome(), pending)

    verdicts, _, review = asyncio.run(judge())
    scores = [v.score for v in verdicts]
    return (env.outcome(), scores) if mode == "per_action" else (env.outcome(), scores, review.responsible)


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


def test_three_agent_chain_and_the_hindsight_review_blame_the_first_broken_goal():
    goals = CHAINS[3]
    assert list(goals) == ["upstream", "middle", "downstream"]
    outcome, scores = play("7", "Bo", "ok", goals=goals)
    assert outcome["success"] is True and scores == [10.0, 10.0, 10.0]
    # the middle agent misses its goal: the episode fails, whatever the others did
    outcome, scores, responsible = play("7", "bo", "ok", goals=goals, mode="hindsight")
    assert outcome["success"] is False and (scores[0], scores[2]) == (10.0, 10.0) and scores[1] < 1.0
    assert responsible == 1
    # two goals missed: the first one is held responsible; the scores are the per-action rules' own
    outcome, scores, responsible = play("x", "bo", "ok", goals=goals, mode="hindsight")
    assert responsible == 0 and scores == play("x", "bo", "ok", goals=goals)[1]
    assert play("7", "Bo", "ok", goals=goals, mode="hindsight")[2] == 2  # a solved episode: its last action
