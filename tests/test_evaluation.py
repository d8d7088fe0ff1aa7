"""Evaluation and baselines, their pure parts: grading, pass@1 and DSBench summaries, behaviour metrics,
GRPO-style group normalization, the shared-policy topology check."""

import os
import threading
from types import SimpleNamespace

import pytest
import torch

from openrlhf_mappa import rewards
from openrlhf_mappa.envs.mathchat import MathChatEnv, answers_match, grade
from openrlhf_mappa.episode import Action, Episode, ToolFeedback
from openrlhf_mappa.evaluation import format_table, summarize
from openrlhf_mappa.run_log import behaviour_metrics
from openrlhf_mappa.team import load_topology

MATHCHAT_YAML = os.path.join(os.path.dirname(__file__), "..", "examples", "configs", "mathchat.yaml")


@pytest.mark.parametrize(
    "predicted, reference, right",
    [
        ("\\frac{1}{2}", "0.5", True),
        ("0.5", "\\frac{1}{2}", True),
        ("336^\\circ", "336", True),
        ("18.0", "18", True),
        ("18", "18.0", True),
        ("\\dfrac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}", True),
        ("2^{10}", "1024", True),
        ("2\\sqrt{2}", "\\sqrt{8}", True),
        ("17", "18", False),
        ("\\frac{1}{3}", "0.333", False),
        ("x", "18", False),
        (None, "18", False),
    ],
)
def test_grade(predicted, reference, right):
    assert grade(predicted, reference) is right


def test_grade_sees_equal_expressions_that_string_matching_misses():
    for predicted, reference in [("2^{10}", "1024"), ("\\dfrac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}"), ("2\\sqrt{2}", "\\sqrt{8}")]:
        assert not answers_match(predicted, reference) and grade(predicted, reference)


def test_grade_off_the_main_thread_still_judges():
    # math-verify's SIGALRM timeout cannot be set off the main thread; it must not turn into a silent False.
    out = {}
    t = threading.Thread(target=lambda: out.update(right=grade("2^{10}", "1024"), wrong=grade("2^{10}", "1000")))
    t.start(), t.join()
    assert out == {"right": True, "wrong": False}


def mathchat_env(tmp_path, answer):
    topology = load_topology(MATHCHAT_YAML, model_override="m")
    return topology, MathChatEnv(topology, {"id": "1", "prompt": "p", "answer": answer}, str(tmp_path))


def test_boxed_answer_inside_prose_is_graded(tmp_path):
    topology, env = mathchat_env(tmp_path, "0.5")
    verifier = topology.agents[-1]
    env.step(topology.agents[0], 0, "I think it is \\boxed{3}.")  # an earlier agent's box does not count
    env.step(verifier, 0, "Checking both: the code agrees, so the answer is \\boxed{\\dfrac{1}{2}} as shown.")
    assert env.outcome() == {"success": True, "answer": "\\dfrac{1}{2}", "answered": True}
    assert env.answer_formatted(verifier, "so \\boxed{2}") is True
    assert env.answer_formatted(verifier, "so 2") is False
    assert env.answer_formatted(topology.agents[0], "so \\boxed{2}") is None  # not asked of the solver


def action(agent, turn=0, n_tokens=3, exit_code=None, truncated=False, formatted=None, reward=None):
    return Action("e", agent, turn, [1], list(range(n_tokens)), feedback=ToolFeedback(exit_code=exit_code),
                  truncated=truncated, formatted=formatted, reward=reward)  # fmt: skip


def test_behaviour_metrics_per_agent():
    episodes = [
        Episode("e1", "1", actions=[action("solver", n_tokens=4, truncated=True), action("coder", exit_code=1),
                                    action("coder", 1, exit_code=0), action("verifier", formatted=True)]),
        Episode("e2", "1", actions=[action("solver", n_tokens=2), action("coder", n_tokens=5),
                                    action("verifier", formatted=False)]),
    ]  # fmt: skip
    m = behaviour_metrics(episodes, ["solver", "coder", "verifier"])
    assert m["agent/solver/action_length"] == 3.0 and m["agent/solver/truncated_rate"] == 0.5
    assert m["agent/solver/tool_use_rate"] == 0.0 and m["agent/solver/code_error_rate"] is None
    assert m["agent/coder/num_actions"] == 3 and m["agent/coder/tool_use_rate"] == pytest.approx(2 / 3)
    assert m["agent/coder/code_error_rate"] == 0.5 and m["agent/coder/tool_error_rate"] == pytest.approx(1 / 3)
    assert m["agent/verifier/answer_format_rate"] == 0.5
    assert "agent/solver/answer_format_rate" not in m and "agent/coder/answer_format_rate" not in m


def test_summarize_math_pass_at_1():
    tasks = [{"id": "a", "answer": "1"}, {"id": "b", "answer": "2"}, {"id": "c", "answer": "3"}]
    wins = {"a": [True, True, False, False], "b": [False] * 4, "c": [True] * 4}
    episodes = [Episode(f"{t}{i}", t, "math", outcome={"success": w, "answered": w or i == 0})
                for t, ws in wins.items() for i, w in enumerate(ws)]  # fmt: skip
    summary, problems = summarize(episodes, [], tasks)
    assert [p["pass1"] for p in problems] == [0.5, 0.0, 1.0]
    assert summary["accuracy"] == pytest.approx(0.5) and summary["n_problems"] == 3 and summary["n_samples"] == 4
    assert summary["answered_rate"] == pytest.approx(7 / 12)  # the successes, plus every first sample
    assert problems[0]["reference"] == "1" and len(problems[0]["samples"]) == 4
    assert "relative_score" not in summary


def test_summarize_dsbench_splits_by_task_type_and_counts_invalid_as_zero():
    def ep(task, kind, valid, metric_name=None, metric=None, rel=None):
        outcome = {"success": valid, "metric_name": metric_name, "metric": metric, "relative_score": rel}
        return Episode(task, task, kind, outcome=outcome)

    episodes = [
        ep("r1", "regression", True, "rmse", 2.0, 0.5), ep("r1", "regression", False),
        ep("c1", "classification", True, "accuracy", 0.9, 0.8), ep("c1", "classification", True, "accuracy", 0.7, 0.4),
    ]  # fmt: skip
    tasks = [{"id": "r1", "answer": "d1", "type": "regression"}, {"id": "c1", "answer": "d2", "type": "classification"}]
    summary, _ = summarize(episodes, [], tasks)
    assert summary["accuracy"] == pytest.approx(0.75)
    assert summary["relative_score"] == pytest.approx((0.5 + 0 + 0.8 + 0.4) / 4)
    assert summary["metric/rmse"] == 2.0 and summary["metric/accuracy"] == pytest.approx(0.8)
    assert summary["regression/success_rate"] == 0.5 and summary["regression/relative_score"] == 0.25
    assert summary["classification/success_rate"] == 1.0 and summary["classification/relative_score"] == pytest.approx(0.6)
    table = format_table({"dsbench_eval": summary})
    assert table.startswith("dsbench_eval: accuracy 0.750") and "regression/relative_score 0.250" in table


def test_group_normalize_compares_samples_of_the_same_prompt():
    # Catches the old population std: two samples 2, 6 have mean 4 and sample std |6 - 2| / √2 = 2.8284271
    # (the authors' and OpenRLHF's torch .std()), so R' = ±2 / 2.8284271 = ±0.7071068, not ±1.
    def ep(task, r_solver, r_verifier, step=1):
        return Episode(task, task, step=step, actions=[action("solver", reward=r_solver), action("verifier", reward=r_verifier)])

    episodes = [ep("a", 2.0, 7.0), ep("a", 6.0, 7.0), ep("b", 1.0, None), ep("b", 3.0, 9.0), ep("a", 9.0, 9.0, step=2)]
    rewards.group_normalize(episodes)
    solver = [e.actions[0].reward for e in episodes]
    verifier = [e.actions[1].reward for e in episodes]
    assert solver[:4] == pytest.approx([-0.7071068, 0.7071068, -0.7071068, 0.7071068], abs=1e-6)
    assert verifier[:2] == [0.0, 0.0]  # equal rewards: nothing to learn
    assert verifier[2] is None and verifier[3] == 0.0  # a left-out action stays out; a group of one gets 0, not NaN
    assert solver[4] == 0.0  # another step is another group


def test_group_scope_is_the_authors_group_norm_on_hand_computed_numbers():
    # Catches the old "group" scope, which used A = G unwhitened; the authors' group_norm (their
    # experience_maker.py) whitens the returns after the per-prompt normalization, per agent.
    # Coach scores with reward_scale 0.1: task a 3, 7 -> 0.3, 0.7; task b 5, 5 -> 0.5, 0.5.
    # Group-normalized (sample std, scale-free): a -> ∓0.7071068, b -> 0, 0.
    # Two tokens each, KL 1 per token, β = 0.1: r = -0.1, -0.1 + R'; G = R' - 0.2, R' - 0.1:
    #   a: -0.9071068, -0.8071068 | 0.5071068, 0.6071068     b: -0.2, -0.1 | -0.2, -0.1
    # Whitened over the 8 tokens: mean -1.2 / 8 = -0.15; deviations ∓0.7571068, ∓0.6571068, ∓0.05;
    # variance (2 · (0.7571068² + 0.6571068²) + 4 · 0.05²) / 8 = 2.02 / 8 = 0.2525, std 0.5024938:
    #   a: -1.5066988, -1.3076914 | 1.3076914, 1.5066988     b: -0.0995037, 0.0995037 (twice)
    # (b's equal rewards no longer give exactly 0 once KL enters and the batch is whitened, as the authors'.)
    from openrlhf_mappa.episode import Verdict

    episodes = [Episode(f"{t}{i}", t, step=1, outcome={"success": False},
                        actions=[Action(f"{t}{i}", "solver", 0, [1], [2], verdict=Verdict(c, "ok"))])
                for t, scores in (("a", (3.0, 7.0)), ("b", (5.0, 5.0))) for i, c in enumerate(scores)]  # fmt: skip
    rewards.assign_rewards(episodes, "process", scale=0.1, norm_scope="group")  # the scope's R step, in one call
    R_B = torch.tensor([e.actions[0].reward for e in episodes])
    torch.testing.assert_close(R_B, torch.tensor([-0.7071068, 0.7071068, 0.0, 0.0]), rtol=0, atol=1e-6)

    batch = SimpleNamespace(rewards=R_B, kl=torch.ones(4, 2), action_mask=torch.ones(4, 2, dtype=torch.bool))
    advantage_of = rewards.compute_advantages({"solver": [batch]}, kl_coef=0.1, scope="group")
    expected = [[-1.5066988, -1.3076914], [1.3076914, 1.5066988], [-0.0995037, 0.0995037], [-0.0995037, 0.0995037]]
    torch.testing.assert_close(batch.advantages, torch.tensor(expected), rtol=0, atol=1e-5)
    # Each row's mean advantage over its tokens, as the action's record shows it.
    assert advantage_of["solver"] == pytest.approx([-1.4071951, 1.4071951, 0.0, 0.0], abs=1e-5)
    torch.testing.assert_close(batch.returns[0], torch.tensor([-0.9071068, -0.8071068]), rtol=0, atol=1e-6)


def test_shared_policy_needs_one_model(tmp_path):
    from openrlhf_mappa.placement import trainee_specs

    topology = load_topology(MATHCHAT_YAML)
    args = SimpleNamespace(mappa=SimpleNamespace(shared_policy=True))
    assert [s.name for s in trainee_specs(args, load_topology(MATHCHAT_YAML, model_override="m"))] == ["problem_solver"]
    assert len(trainee_specs(SimpleNamespace(mappa=SimpleNamespace(shared_policy=False)), topology)) == 3
    topology.agents[1].model = "other/model"
    with pytest.raises(SystemExit, match="one model for every role"):
        trainee_specs(args, topology)
