"""A user's own environment written wrong (issue 64, the second new-user trial): each hook's return is checked
where it is called, by the real rollout (an episode's environment error, naming the hook and the value), by
team.play and by the launch checks (tests/test_bad_input.py); and the hooks' `agent`, an AgentSpec, compares
equal to its name. Scripted policies stand in for vLLM (no model generates)."""

import asyncio
import re

import pytest

from test_coach import ScriptedPolicy

from openrlhf_mappa.coach.heuristic import HeuristicCoach
from openrlhf_mappa.envs.base import StepResult, returned_problem
from openrlhf_mappa.envs.mathchat import MathChatEnv
from openrlhf_mappa.episode import ToolFeedback
from openrlhf_mappa.rollout import run_episode
from openrlhf_mappa.team import load_topology, play

YAML = """name: gift
env: test_env_hooks:GiftEnv
coach_template: 'Judge {agent_output}. End with PROCESS_SCORE: <0-10>'
agents:
  - {name: planner, model: model, role: plans, prompt: '{task}'}
  - {name: writer, model: model, role: writes, prompt: '{task} {history}'}
"""
TASK = {"id": "g1", "prompt": "A tag for Ana.", "answer": "cake", "type": ""}
JUDGE = "expected None or a tuple (score: a number in [0, 10], why: str, failed: bool)"


class GiftEnv(MathChatEnv):
    """The trial's planner -> writer environment: its judge as a user writes it, `agent == "planner"`."""

    grade_cut_off = (0.0, "cut off", True)

    def judge(self, agent, response, feedback, truncated_at):
        if truncated_at is not None:
            return self.grade_cut_off
        if agent == "planner":
            return 10.0, "plan", False
        return 4.0, "tag", False

    def outcome(self):
        return {"success": "cake" in self.history[-1].response}


@pytest.fixture
def gift(tmp_path):
    (tmp_path / "gift.yaml").write_text(YAML)
    return load_topology(str(tmp_path / "gift.yaml"))


def test_a_hook_return_of_another_shape_is_named():
    assert returned_problem("judge", None) == "" and returned_problem("judge", (0, "", True)) == ""
    for grade in (0.0, 0.5, (11.0, "why", False), (5.0, "why"), (5.0, None, False), (True, "why", False),
                  [5.0, "why", False]):
        assert returned_problem("judge", grade) == JUDGE, grade
    assert returned_problem("outcome", {"success": 1}) == "expected a dict {'success': bool, ...}"
    assert returned_problem("outcome", {"success": True, "answer": "4"}) == ""
    assert returned_problem("coach_ground_truth", 4) == "expected a str or None"
    assert returned_problem("answer_formatted", "yes") == "expected True, False or None"
    assert returned_problem("step", None).startswith("expected a StepResult(feedback: ToolFeedback, done: "
                                                     "bool)")
    assert returned_problem("step", StepResult(ToolFeedback())) == ""
    assert returned_problem("observe", "2 + 2?") == "expected a non-empty list of chat messages {'role': " \
                                                    "str, 'content': str}"
    assert returned_problem("observe", [{"role": "user", "content": "2 + 2?"}]) == ""
    assert returned_problem("next_agents", "anything") == ""  # rollout.check_round's


def test_agent_compares_equal_to_its_name(gift):
    planner, writer = gift.agents
    assert planner == "planner" and "planner" == planner and planner != "writer" and writer != planner
    assert planner in {"planner"} and planner in ["x", "planner"] and hash(planner) == hash("planner")
    played = play(gift, TASK, ["ana cake", "For Ana: cake!"])
    # The natural `agent == "planner"` picks each agent's own branch (it never matched an AgentSpec before).
    assert [(a.agent, a.grade) for a in played.actions] == [("planner", (10.0, "plan", False)),
                                                            ("writer", (4.0, "tag", False))]


@pytest.mark.parametrize("grade", [0.0, 0.5])
def test_a_bare_number_from_judge_is_refused_by_play_naming_the_hook(gift, grade, monkeypatch):
    monkeypatch.setattr(GiftEnv, "grade_cut_off", grade)
    # whole replies: its tuple branch
    assert play(gift, TASK, ["ana cake", "cake"]).outcome == {"success": True}
    with pytest.raises(ValueError, match=re.escape(f"GiftEnv.judge returned {grade}: {JUDGE}")):
        play(gift, TASK, ["ana cake", "cake"], truncated_at=16)


@pytest.mark.parametrize("grade", [0.0, 0.5])
def test_a_bare_number_from_judge_is_that_episodes_environment_error(gift, grade, monkeypatch, tmp_path):
    # The old rollout passed it on: 0.0 was read as "no grade" (the heuristic coach's generic rules scored the
    # action), 0.5 raised a TypeError inside the heuristic coach that stopped the run.
    monkeypatch.setattr(GiftEnv, "grade_cut_off", grade)
    policies = {"planner": ScriptedPolicy("ana cake"), "writer": ScriptedPolicy("cake")}

    async def truncated(prompt_ids):
        return [4, 5], True, []  # cut off at the token limit: the judge's bare-number branch

    policies["planner"].generate = truncated
    for policy in policies.values():
        policy.max_new_tokens, policy.max_len = 16, 4096
    episode = asyncio.run(run_episode(gift, dict(TASK), policies, HeuristicCoach(), str(tmp_path / "ws"),
                                      step=1))
    assert episode.env_error == f"GiftEnv.judge returned {grade}: {JUDGE}"
    assert episode.outcome == {"success": False} and episode.actions == []
