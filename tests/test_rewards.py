"""Rewards and advantages checked against numbers worked out by hand (each expected tensor is explained)."""

from types import SimpleNamespace

import pytest
import torch

from openrlhf_mappa.episode import Action, Episode, Verdict
from openrlhf_mappa.rewards import (
    assign_rewards,
    compute_advantages,
    merge_counts,
    returns_to_go,
    token_rewards,
    whiten,
)


def close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=0, atol=1e-5)


def action(agent, turn, verdict=None, reward=None):
    return Action("e0", agent, turn, prompt_ids=[1], response_ids=[2], verdict=verdict, reward=reward)


def ok(score):
    return Verdict(score=score, status="ok")


# ── assign_rewards ──


@pytest.mark.parametrize("norm_scope,on_failure", [("agent", "skip"), ("group", "neutral")])
def test_rewards_assigned_one_agent_at_a_time_are_the_whole_steps(norm_scope, on_failure):
    # The trainer assigns each agent's rewards as soon as its own verdicts are in, on a view of the episodes holding
    # only its actions: every reward and every count must be what one call over the whole step gives. The
    # standardisation per task type, the group normalisation and dynamic filtering all group within an agent.
    import dataclasses

    def step():
        def ep(i, task, kind):
            scores = {"solver": [3, 7, None, 8][i], "verifier": [9, 2, 6, None][i]}
            failed = {"solver": Verdict(None, "timeout"), "verifier": Verdict(None, "parse_error")}
            acts = [Action(f"e{i}", agent, 0, [1], [2], verdict=Verdict(s, "ok") if s is not None else failed[agent],
                           truncated=(i == 2 and agent == "verifier")) for agent, s in scores.items()]
            return Episode(f"e{i}", task, kind, actions=acts, outcome={"success": i % 2 == 0}, step=1)
        return [ep(0, "t0", "a"), ep(1, "t0", "a"), ep(2, "t1", "b"), ep(3, "t1", "b")]

    flags = dict(mode="process", on_failure=on_failure, scale=0.1, standardize_task_type=True, norm_scope=norm_scope,
                 filter_range=(0.52, 0.9))
    whole, parts = step(), step()
    expected = assign_rewards(whole, **flags)
    counts = merge_counts([assign_rewards([dataclasses.replace(ep, actions=[a for a in ep.actions if a.agent == name])
                                           for ep in parts], **flags) for name in ("solver", "verifier")])
    assert counts == expected and expected["truncated_left_out"] == {"verifier": 1}
    assert expected["filtered"]["solver"][0] == 2 and expected["left_out"] + expected["fallback"] == 2
    assert [a.reward for ep in parts for a in ep.actions] == [a.reward for ep in whole for a in ep.actions]
    assert any(a.reward is not None for ep in whole for a in ep.actions)


def test_process_mode_multi_action_agent_gets_one_reward_per_action():
    # The executor acts twice; each action is scored on its own and keeps its own reward.
    episode = Episode("e0", "t0", actions=[action("solver", 0, ok(6)), action("executor", 0, ok(3)),
                                           action("executor", 1, ok(8)), action("verifier", 0, ok(10))])
    counts = assign_rewards([episode], "process")
    assert [a.reward for a in episode.actions] == [6.0, 3.0, 8.0, 10.0]
    assert counts == {"trainable": 4, "left_out": 0, "left_out_by_status": {}, "fallback": 0, "truncated_left_out": {},
                      "filtered": {}, "stale_left_out": {}}


def test_process_mode_leaves_out_actions_without_a_valid_score():
    broken_ok = ok(5.0)
    broken_ok.score = None  # an "ok" verdict that lost its score (bypassing validation) must not train either
    episode = Episode("e0", "t0", outcome={"success": True}, actions=[
        action("a", 0, ok(7.5)),
        action("a", 1, ok(0.0)),  # 0 is a real score: it trains, it is not "missing"
        action("b", 0, Verdict(score=None, status="parse_error"), reward=5.0),  # stale reward must be cleared
        action("b", 1, Verdict(score=None, status="api_error")),
        action("c", 0, Verdict(score=None, status="timeout")),
        action("c", 1, None),
        action("c", 2, broken_ok),
    ])
    counts = assign_rewards([episode], "process")
    assert [a.reward for a in episode.actions] == [7.5, 0.0, None, None, None, None, None]
    assert counts == {
        "trainable": 2,
        "left_out": 5,
        "left_out_by_status": {"parse_error": 1, "api_error": 1, "timeout": 1, "missing": 1, "ok": 1},
        "fallback": 0,
        "truncated_left_out": {},
        "filtered": {},
        "stale_left_out": {},
    }


def test_outcome_mode_pays_every_action_the_episode_outcome():
    # Success -> 10 (the default --mappa.outcome_score) for all its actions, failure -> 0; coach verdicts (or their
    # absence) are ignored.
    won = Episode("e1", "t1", outcome={"success": True},
                  actions=[action("a", 0, None), action("a", 1, Verdict(None, "api_error"))])
    lost = Episode("e2", "t2", outcome={"success": False}, actions=[action("a", 0, ok(9))])
    counts = assign_rewards([won, lost], "outcome")
    assert [a.reward for a in won.actions] == [10.0, 10.0]
    assert [a.reward for a in lost.actions] == [0.0]
    assert counts == {"trainable": 3, "left_out": 0, "left_out_by_status": {}, "fallback": 0, "truncated_left_out": {},
                      "filtered": {}, "stale_left_out": {}}
    # Another outcome score, times the reward scale; the coach-failure fallback pays the same outcome R.
    assign_rewards([won, lost], "outcome", scale=0.1, outcome_score=4.0)
    assert [a.reward for a in won.actions + lost.actions] == pytest.approx([0.4, 0.4, 0.0])
    assign_rewards([won], "process", on_failure="outcome", outcome_score=4.0)
    assert [a.reward for a in won.actions] == [4.0, 4.0]


def test_truncated_actions_are_left_out_and_counted_per_agent():
    # Catches the old behaviour: an action cut off at the token limit trained on its full score (or outcome).
    # Default (--mappa.batch_semantics authors): zero-loss rows, the truncated ones with their reward (whitening);
    # tests/test_batch_semantics.py follows them into the batch and the loss.
    def episodes():
        return [Episode("e0", "t0", outcome={"success": True}, actions=[
            Action("e0", "solver", 0, [1], [2], truncated=True, verdict=ok(9.0), reward=3.0),  # stale reward cleared
            Action("e0", "executor", 0, [1], [2], verdict=ok(4.0)),
            Action("e0", "executor", 1, [1], [2], truncated=True, verdict=Verdict(None, "timeout")),
        ])]  # fmt: skip

    for mode, kept in (("process", 4.0), ("outcome", 10.0)):
        eps = episodes()
        counts = assign_rewards(eps, mode, on_failure="neutral")
        assert [a.zero_loss for a in eps[0].actions] == [True, False, True]
        assert [a.reward for a in eps[0].actions] == ([9.0, 4.0, 5.0] if mode == "process" else [10.0] * 3)
        assert counts["truncated_left_out"] == {"solver": 1, "executor": 1}
        assert (counts["trainable"], counts["left_out"], counts["fallback"]) == (1, 0, 0)
        eps = episodes()
        counts = assign_rewards(eps, mode, on_failure="neutral", batch_semantics="usable")
        assert [a.reward for a in eps[0].actions] == [None, kept, None]  # even a fallback does not revive it
        assert counts["truncated_left_out"] == {"solver": 1, "executor": 1}
        assert (counts["trainable"], counts["left_out"], counts["fallback"]) == (1, 0, 0)  # not coach failures
    eps = episodes()
    counts = assign_rewards(eps, "process", train_truncated=True)  # --mappa.train_truncated: as before
    assert [a.reward for a in eps[0].actions] == [9.0, 4.0, None] and eps[0].actions[2].zero_loss  # unscored
    assert counts["truncated_left_out"] == {} and counts["left_out_by_status"] == {"timeout": 1}


def test_reward_scale_applies_to_scores_outcome_and_both_fallbacks():
    # Catches the old behaviour: coach scores trained raw (0-10) whatever the pipeline (the authors divide
    # MathChat's by 10), and an outcome run had no scale to share with them.
    # s = 0.1: score 7 -> 0.7; outcome 10 x success x s = 1.0 / 0.0; neutral 5 x s = 0.5; outcome fallback 1.0.
    def episode(success):
        return Episode("e", "t", outcome={"success": success},
                       actions=[action("a", 0, ok(7.0)), action("a", 1, Verdict(None, "parse_error"))])

    won, lost = episode(True), episode(False)
    assign_rewards([won, lost], "process", on_failure="neutral", neutral_score=5.0, scale=0.1)
    assert [a.reward for a in won.actions] == pytest.approx([0.7, 0.5])
    won = episode(True)
    assign_rewards([won], "process", on_failure="outcome", scale=0.1)
    assert [a.reward for a in won.actions] == pytest.approx([0.7, 1.0])
    won, lost = episode(True), episode(False)
    assign_rewards([won, lost], "outcome", scale=0.1)
    assert [a.reward for a in won.actions + lost.actions] == pytest.approx([1.0, 1.0, 0.0, 0.0])
    assert won.actions[0].verdict.score == 7.0  # the verdict keeps the coach's own 0-10 score


@pytest.mark.parametrize("flag, value, choices", [
    ("--mappa.reward", "outcomes", "'process', 'outcome'"),
    ("--mappa.norm_scope", "team", "'agent', 'global', 'group'"),
    ("--mappa.coach.on_failure", "zero", "'skip', 'outcome', 'neutral'"),
])  # fmt: skip
def test_an_unknown_mode_scope_or_policy_is_refused_by_its_flag(flag, value, choices, capsys):
    # assign_rewards and compute_advantages trust these values: the flags' choices refuse any other, naming them.
    from openrlhf_mappa.cli.train_mappa_ray import parse_args

    with pytest.raises(SystemExit) as refused:
        parse_args(["--mappa.topology", "t.yaml", flag, value])
    assert refused.value.code == 2
    assert f"argument {flag}: invalid choice: '{value}' (choose from {choices})" in capsys.readouterr().err


# ── token_rewards / returns_to_go ──

# Three rows of width 4: row 0 has 3 action tokens (EOS at column 2), row 1 is truncated (its mask
# runs to the last column), row 2 has a single token. KL outside the mask is garbage (9, 5) that
# must not leak in.
REWARD_B = torch.tensor([10.0, 7.0, 3.0])
KL_BA = torch.tensor([[-1.0, -2.0, 0.5, 9.0], [1.0, 1.0, 1.0, 1.0], [-2.0, 5.0, 5.0, 5.0]])
MASK_BA = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])


def test_token_rewards_kl_on_every_token_reward_on_the_last():
    # r_t = -0.1·KL_t, plus R at the last action token:
    #   row 0: 0.1, 0.2, -0.05 + 10 = 9.95, 0 (off mask)
    #   row 1: -0.1, -0.1, -0.1, -0.1 + 7 = 6.9 (truncated: R sits on its last generated token)
    #   row 2: 0.2 + 3 = 3.2, 0, 0, 0
    r_BA = token_rewards(REWARD_B, KL_BA, MASK_BA, kl_coef=0.1)
    close(r_BA, [[0.1, 0.2, 9.95, 0.0], [-0.1, -0.1, -0.1, 6.9], [3.2, 0.0, 0.0, 0.0]])


def test_returns_of_a_ten_with_negative_kl_exceed_ten_unclipped():
    # Reverse cumulative sums of the rewards above:
    #   row 0: 0.1 + 0.2 + 9.95 = 10.25, 0.2 + 9.95 = 10.15, 9.95, 0  (> 10: nothing clamps a 10 + KL bonus)
    #   row 1: 6.6, 6.7, 6.8, 6.9
    #   row 2: 3.2, 0, 0, 0
    G_BA = returns_to_go(token_rewards(REWARD_B, KL_BA, MASK_BA, kl_coef=0.1), MASK_BA)
    close(G_BA, [[10.25, 10.15, 9.95, 0.0], [6.6, 6.7, 6.8, 6.9], [3.2, 0.0, 0.0, 0.0]])


def test_reward_above_ten_is_not_clamped():
    # A sum of two coach scores (8 + 7 = 15) on a 2-token action: r = 0, 15; G = 15, 15.
    r_BA = token_rewards(torch.tensor([15.0]), torch.zeros(1, 2), torch.ones(1, 2), kl_coef=0.01)
    close(r_BA, [[0.0, 15.0]])
    close(returns_to_go(r_BA, torch.ones(1, 2)), [[15.0, 15.0]])


@pytest.mark.parametrize("kl_coef", [0.0, -0.1])
def test_no_kl_term_when_kl_coef_not_positive(kl_coef):
    # Only R at each row's last token: G = 10, 10, 10, 0 / 7, 7, 7, 7 / 3, 0, 0, 0.
    r_BA = token_rewards(REWARD_B, KL_BA, MASK_BA, kl_coef)
    close(r_BA, [[0.0, 0.0, 10.0, 0.0], [0.0, 0.0, 0.0, 7.0], [3.0, 0.0, 0.0, 0.0]])
    close(returns_to_go(r_BA, MASK_BA), [[10.0, 10.0, 10.0, 0.0], [7.0, 7.0, 7.0, 7.0], [3.0, 0.0, 0.0, 0.0]])


def test_row_with_empty_mask_gets_nothing():
    # A row with no action token has nowhere to put R: it stays all zero.
    r_BA = token_rewards(torch.tensor([4.0, 6.0]), torch.ones(2, 2), torch.tensor([[0, 0], [1, 0]]), kl_coef=0.5)
    close(r_BA, [[0.0, 0.0], [5.5, 0.0]])  # row 1: -0.5·1 + 6


def test_returns_to_go_ignores_values_off_the_mask():
    # Within the mask: 1+2+3 = 6, 2+3 = 5, 3; the 100 off the mask neither counts nor shows.
    G_BA = returns_to_go(torch.tensor([[1.0, 2.0, 3.0, 100.0]]), torch.tensor([[1, 1, 1, 0]]))
    close(G_BA, [[6.0, 5.0, 3.0, 0.0]])


# ── whiten ──


def test_whiten_is_global_over_tensors_of_different_widths():
    # Masked values across both tensors: 1, 2, 3, 6 -> mean 3, deviations -2, -1, 0, 3,
    # population variance (4 + 1 + 0 + 9) / 4 = 3.5 (not the sample 14/3), std √3.5 = 1.8708287.
    # -2/√3.5 = -1.0690450, -1/√3.5 = -0.5345225, 3/√3.5 = 1.6035675; off-mask (99, -7, 50) -> 0.
    a = torch.tensor([[1.0, 2.0, 99.0]])
    b = torch.tensor([[3.0, -7.0], [6.0, 50.0]])
    wa, wb = whiten([a, b], [torch.tensor([[1, 1, 0]]), torch.tensor([[1, 0], [1, 0]])])
    close(wa, [[-1.0690450, -0.5345225, 0.0]])
    close(wb, [[0.0, 0.0], [1.6035675, 0.0]])


def test_whiten_constant_values_give_zeros_not_nan():
    (w,) = whiten([torch.tensor([[5.0, 5.0, 5.0]])], [torch.tensor([[1, 1, 0]])])
    close(w, [[0.0, 0.0, 0.0]])


def test_whiten_without_masked_tokens_gives_zeros():
    (w,) = whiten([torch.tensor([[5.0, -3.0]])], [torch.tensor([[0, 0]])])
    close(w, [[0.0, 0.0]])


# ── compute_advantages ──


def batch(rewards, kl, mask):
    return SimpleNamespace(rewards=torch.tensor(rewards), kl=torch.tensor(kl), action_mask=torch.tensor(mask), info={})


def test_compute_advantages_multi_action_agent_with_kl():
    # The executor's two actions are two rows; row 0 ends at column 1, row 1 is truncated (all 3 tokens).
    # r (β = 0.1): row 0: -0.05, -0.05 + 3 = 2.95, 0     row 1: -0.1, 0.1, -0.2 + 8 = 7.8
    # G:           row 0: 2.9, 2.95, 0                   row 1: 7.8, 7.9, 7.8
    # The turn-0 action's return does not include the turn-1 score: each action is credited on its own.
    # Whitening over the executor's 5 tokens: mean 29.35 / 5 = 5.87, population variance 5.7836,
    # std 2.4049116 -> (2.9, 2.95, 7.8, 7.9, 7.8) become -1.2349726, -1.2141818, 0.8025243, 0.8441059, 0.8025243.
    # The solver's single action has a constant return (6, 6) -> advantages 0 under the "agent" scope.
    executor = batch([3.0, 8.0], [[0.5, 0.5, 0.0], [1.0, -1.0, 2.0]], [[1, 1, 0], [1, 1, 1]])
    solver = batch([6.0], [[0.0, 0.0]], [[1, 1]])
    compute_advantages({"executor": [executor], "solver": [solver]}, kl_coef=0.1, scope="agent")
    close(executor.returns, [[2.9, 2.95, 0.0], [7.8, 7.9, 7.8]])
    close(executor.advantages, [[-1.2349726, -1.2141818, 0.0], [0.8025243, 0.8441059, 0.8025243]])
    close(executor.info["return"], [2.9, 7.8])  # G at the first action token
    close(solver.returns, [[6.0, 6.0]])
    close(solver.advantages, [[0.0, 0.0]])
    close(solver.info["return"], [6.0])


def test_agent_and_global_scopes_differ():
    # One-token actions, no KL, so G = R.  solver: 10, 0   verifier: 4, 6.
    # "agent":  solver mean 5, std 5 -> 1, -1;  verifier mean 5, std 1 -> -1, 1.
    # "global": mean (10 + 0 + 4 + 6) / 4 = 5, variance (25 + 25 + 1 + 1) / 4 = 13, std √13 = 3.6055513
    #           -> solver ±5/√13 = ±1.3867505, verifier ∓1/√13 = ∓0.2773501.
    def batches():
        return {"solver": [batch([10.0, 0.0], [[0.3], [0.3]], [[1], [1]])],
                "verifier": [batch([4.0, 6.0], [[0.3], [0.3]], [[1], [1]])]}

    per_agent, overall = batches(), batches()
    compute_advantages(per_agent, kl_coef=0.0, scope="agent")
    compute_advantages(overall, kl_coef=0.0, scope="global")
    close(per_agent["solver"][0].advantages, [[1.0], [-1.0]])
    close(per_agent["verifier"][0].advantages, [[-1.0], [1.0]])
    close(overall["solver"][0].advantages, [[1.3867505], [-1.3867505]])
    close(overall["verifier"][0].advantages, [[-0.2773501], [0.2773501]])


def test_agent_scope_whitens_all_batches_of_an_agent_together():
    # Two batches of one agent, widths 1 and 2, no KL: G = 2 | 4, 4 (R on the last token flows back).
    # Together: 2, 4, 4 -> mean 10/3, population variance (16/9 + 4/9 + 4/9) / 3 = 8/9, std 0.9428090
    # -> (2 - 10/3) / 0.9428090 = -1.4142136, (4 - 10/3) / 0.9428090 = 0.7071068.
    # (Whitened separately, each batch would be constant and give zeros.) b2 has no `info`: fine too.
    b1 = batch([2.0], [[0.0]], [[1]])
    b2 = SimpleNamespace(rewards=torch.tensor([4.0]), kl=torch.zeros(1, 2), action_mask=torch.ones(1, 2).bool())
    compute_advantages({"a": [b1, b2]}, kl_coef=0.0)
    close(b1.advantages, [[-1.4142136]])
    close(b2.advantages, [[0.7071068, 0.7071068]])


# ── OpenRLHF's algorithm flags, against OpenRLHF's own code ──


def upstream_advantages(rows, kl_coef, gamma, no_std_norm):
    """OpenRLHF 0.11.2's compute_advantages_and_returns (estimator reinforce, one sample per prompt) on `rows`
    (rewards_B, kl_BA, mask_BA): what its trainer computes for one agent's batch, with these flags."""
    from openrlhf.trainer.ppo_utils.experience import Experience
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

    from openrlhf_mappa.cli.train_mappa_ray import parse_args

    args = parse_args(["--mappa.topology", "t.yaml", "--algo.advantage.gamma", str(gamma), "--algo.kl.init_coef",
                       str(kl_coef), "--rollout.n_samples_per_prompt", "1"] + ["--algo.advantage.no_std_norm"] * no_std_norm)
    maker = RemoteExperienceMaker.__new__(RemoteExperienceMaker)
    maker.strategy, maker.kl_ctl, maker.advantage_estimator = SimpleNamespace(args=args), FixedKLController(kl_coef), "reinforce"
    starts = [sum(len(R_B) for R_B, _, _ in rows[:i]) for i in range(len(rows))]  # each row's prompt index
    exps = [Experience(rewards=torch.tensor(R_B), kl=torch.tensor(kl_BA), action_mask=torch.tensor(mask_BA).bool(),
                       index=list(range(start, start + len(R_B))), info={})
            for start, (R_B, kl_BA, mask_BA) in zip(starts, rows)]
    return maker.compute_advantages_and_returns(exps)


ROWS = [([3.0, -1.5], [[0.2, -0.1, 0.4, 0.0], [0.3, 0.1, -0.2, 0.5]], [[1, 1, 1, 0], [1, 1, 1, 1]]),
        ([7.0], [[0.05, 0.5, -0.3, 0.1]], [[1, 1, 0, 0]])]  # fmt: skip


@pytest.mark.parametrize("gamma, no_std_norm", [(1.0, False), (0.9, False), (0.5, True), (1.0, True)])
def test_returns_and_advantages_are_openrlhfs_for_gamma_and_no_std_norm(gamma, no_std_norm):
    # --algo.advantage.gamma discounts the return-to-go, --algo.advantage.no_std_norm whitens by the mean alone:
    # MAPPA's rewards.py gives OpenRLHF's numbers on every action token (upstream leaves values off the mask, and its
    # logged "return" sums KL terms off the mask too, where ours does not).
    ours = [batch(*row) for row in ROWS]
    compute_advantages({"a": ours}, kl_coef=0.1, gamma=gamma, std_norm=not no_std_norm)
    theirs = upstream_advantages(ROWS, 0.1, gamma, no_std_norm)
    for b, e in zip(ours, theirs):
        mask = b.action_mask.bool()
        torch.testing.assert_close(b.returns[mask], e.returns.float()[mask], rtol=0, atol=1e-5)
        torch.testing.assert_close(b.advantages[mask], e.advantages.float()[mask], rtol=0, atol=1e-5)
    if gamma < 1:  # and the discount is real: the first token of row 0 sees 3.0 · γ² (plus its KL terms)
        assert abs(ours[0].returns[0, 0].item() - (-0.02 + gamma * (0.01 + gamma * (3.0 - 0.04)))) < 1e-5


def test_each_agent_gets_its_own_kl_coefficient():
    # An adaptive KL controller (--algo.kl.target) moves each agent's β apart: {agent: β} gives each agent's
    # batch its own, the same as computing that agent alone with its β.
    both = {"a": [batch(*ROWS[0])], "b": [batch(*ROWS[1])]}
    compute_advantages(both, kl_coef={"a": 0.3, "b": 0.02})
    for name, row, beta in (("a", ROWS[0], 0.3), ("b", ROWS[1], 0.02)):
        alone = batch(*row)
        compute_advantages({name: [alone]}, kl_coef=beta)
        torch.testing.assert_close(both[name][0].returns, alone.returns)


def test_adaptive_kl_controller_is_openrlhfs_per_agent():
    # AgentTrainer is OpenRLHF's BasePPOTrainer: --algo.kl.target gives each agent upstream's adaptive controller,
    # which upstream's train_step updates from the agent's own KL; the trainer reads its value for the rewards.
    from openrlhf.trainer.ppo_utils.kl_controller import AdaptiveKLController

    from openrlhf_mappa.agent_trainer import AgentTrainer
    from openrlhf_mappa.cli.train_mappa_ray import parse_args

    args = parse_args(["--mappa.topology", "t.yaml", "--algo.kl.init_coef", "0.05", "--algo.kl.target", "0.1",
                       "--algo.kl.horizon", "1000"])
    a, b = (AgentTrainer(SimpleNamespace(args=args), None, None, None, None) for _ in range(2))
    assert isinstance(a.kl_ctl, AdaptiveKLController) and a.kl_ctl is not b.kl_ctl
    a.kl_ctl.update(0.3, 100)  # KL above target: β grows by clip(0.3 / 0.1 - 1, ±0.2) · 100 / 1000 = 2 %
    assert a.kl_ctl.value == pytest.approx(0.05 * 1.02) and b.kl_ctl.value == 0.05


def scored_episode(task, scores, success=False, agent="solver"):
    return Episode(f"e-{task}-{len(scores)}", task, step=1, outcome={"success": success},
                   actions=[action(agent, t, ok(s)) for t, s in enumerate(scores)])


def test_dynamic_filtering_leaves_out_groups_whose_mean_score_is_out_of_range():
    # OpenRLHF keeps a prompt's samples when low < mean score < high; MAPPA's group is a task's actions by one agent
    # in the step, its score the coach's / 10. Task t1: all 10s (mean 1.0: out), t2: all 0s (out), t3: mixed (in).
    eps = [scored_episode("t1", [10, 10]), scored_episode("t1", [10]), scored_episode("t2", [0]),
           scored_episode("t2", [0]), scored_episode("t3", [10]), scored_episode("t3", [4, 0])]
    eps[4].actions.append(action("verifier", 0, ok(10)))  # the verifier's t3 group is all 10s: out, on its own
    counts = assign_rewards(eps, "process", filter_range=(0.0, 1.0))
    assert [[a.reward for a in ep.actions] for ep in eps] == [[None, None], [None], [None], [None], [10.0, None], [4.0, 0.0]]
    assert [a.filtered for a in eps[4].actions] == [False, True]
    assert counts["filtered"] == {"solver": (5, 1, 3), "verifier": (1, 0, 1)} and counts["trainable"] == 3
    # Another range, (0.5, 1): t1's mean 1.0 and t3's 0.2 are out, t4's 0.7 is in.
    eps = [scored_episode("t1", [10]), scored_episode("t1", [10]), scored_episode("t3", [4, 0]), scored_episode("t4", [6, 8])]
    assert assign_rewards(eps, "process", filter_range=(0.5, 1.0))["filtered"] == {"solver": (4, 1, 3)}
    assert [a.reward for a in eps[3].actions] == [6.0, 8.0]


def test_dynamic_filtering_in_outcome_mode_keeps_tasks_solved_sometimes():
    # Outcome rewards: each action's score is its episode's success; DAPO's rule, all solved or none -> out.
    eps = [scored_episode("t1", [5], True), scored_episode("t1", [5], True), scored_episode("t2", [5], True),
           scored_episode("t2", [5], False)]
    counts = assign_rewards(eps, "outcome", filter_range=(0.0, 1.0))
    assert [ep.actions[0].reward for ep in eps] == [None, None, 10.0, 0.0]
    assert counts["filtered"] == {"solver": (2, 1, 2)}


def test_staleness_is_per_component_and_stale_actions_are_left_out():
    # Now solver is at version 3, checker at 5. An action is stale when any of its versions (its own agent's, or
    # another's whose output it saw) is more than the bound behind: the checker's action saw a solver 2 versions old.
    from openrlhf_mappa.rewards import mark_stale

    solver, checker = action("solver", 0, ok(6)), action("checker", 0, ok(8))
    solver.versions, checker.versions = {"solver": 2}, {"solver": 1, "checker": 5}
    episode = Episode("e0", "t0", actions=[solver, checker])
    assert mark_stale([episode], {"solver": 3, "checker": 5}, most=1) == {"solver": [1], "checker": [0]}
    assert (solver.stale, checker.stale) == (False, True)
    counts = assign_rewards([episode], "process")
    assert (solver.reward, checker.reward) == (6.0, None) and counts["stale_left_out"] == {"checker": 1}
    assert mark_stale([episode], {"solver": 3, "checker": 5}, most=2) == {"solver": [1], "checker": [0]}
    assert not checker.stale  # within a bound of 2
