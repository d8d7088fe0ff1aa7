"""The coach's step accounting, the live coach-bias audit, the bias mitigation and the failure policies:
pure functions over episode records, checked against hand-computed values."""

import logging
import statistics

import pytest

from openrlhf_mappa.coach.audit import BiasAudit, CoachFailure, check_failures, coach_step_metrics
from openrlhf_mappa.episode import Action, Episode, Verdict
from openrlhf_mappa.rewards import assign_rewards, standardize_by_task_type


def act(agent, verdict, final=False):
    return Action("e", agent, 0, [1], [2], verdict=verdict, coach_request={"is_final_agent": final})


def ok(score, **kw):
    return Verdict(score=score, status="ok", **kw)


def episodes_by_type(scores_by_type: dict, agent="modeler", success=False):
    return [
        Episode(f"e{task_type}{i}", "t", task_type=task_type, outcome={"success": success}, actions=[act(agent, ok(s))])
        for task_type, scores in scores_by_type.items()
        for i, s in enumerate(scores)
    ]


def test_step_metrics_count_statuses_cost_and_latency():
    fresh = [ok(7, latency_s=t, tokens_in=100, tokens_out=10, retries=r) for t, r in ((0.1, 0), (0.2, 1), (0.3, 0), (4.0, 2))]
    cached = ok(5, latency_s=9.9, tokens_in=1000, tokens_out=1000, cached=True)  # paid for in an earlier run
    failed = [Verdict(None, "timeout", latency_s=60.0, tokens_in=0), Verdict(None, "parse_error", tokens_in=50, tokens_out=5)]
    ep = Episode("e", "t", actions=[act("a", v) for v in fresh + [cached] + failed])
    m = coach_step_metrics([ep], price_in=2.0, price_out=10.0)
    assert (m["coach/verdicts_ok"], m["coach/verdicts_timeout"], m["coach/verdicts_parse_error"], m["coach/verdicts_api_error"]) == (5, 1, 1, 0)
    assert m["coach/failure_fraction"] == pytest.approx(2 / 7)
    assert m["coach/cache_hit_rate"] == pytest.approx(1 / 7)
    assert (m["coach/tokens_in"], m["coach/tokens_out"], m["coach/retries"]) == (450, 45, 3)
    assert m["coach/cost_usd"] == pytest.approx((450 * 2.0 + 45 * 10.0) / 1e6)
    # Nearest rank over the 6 fresh latencies [0, 0.1, 0.2, 0.3, 4, 60]: p50 = 3rd, p90 = p99 = 6th.
    assert (m["coach/latency_p50"], m["coach/latency_p90"], m["coach/latency_p99"]) == (0.2, 60.0, 60.0)
    assert "coach/cost_usd" not in coach_step_metrics([ep])  # no prices, no made-up cost


def test_skipped_verdicts_are_neither_failures_nor_calls():
    # Catches the old accounting: skipped verdicts (no coach asked: the outcome baseline, evaluation) diluted
    # the failure fraction (1/6 here instead of 1/3) and put 0-second latencies into the percentiles.
    asked = [ok(6, latency_s=2.0), ok(4, latency_s=3.0), Verdict(None, "timeout", latency_s=60.0)]
    skipped = [Verdict(None, "skipped", rationale="outcome baseline: not scored") for _ in range(3)]
    m = coach_step_metrics([Episode("e", "t", actions=[act("a", v) for v in asked + skipped])])
    assert (m["coach/verdicts_skipped"], m["coach/verdicts_ok"]) == (3, 2)
    assert m["coach/failure_fraction"] == pytest.approx(1 / 3)
    assert m["coach/latency_p50"] == 3.0  # nearest rank over 2, 3, 60 (with the skipped: 0, 0, 0, 2, 3, 60 -> 0)
    only_skipped = [Episode("e", "t", actions=[act("a", v) for v in skipped])]
    m = coach_step_metrics(only_skipped)
    assert (m["coach/failure_fraction"], m["coach/cache_hit_rate"], m["coach/latency_p50"]) == (0.0, 0.0, None)
    check_failures(only_skipped, m, max_fraction=0.0)  # nothing asked, nothing failed: the run goes on


def test_too_many_failures_stop_with_counts_and_reason():
    eps = [Episode("e", "t", actions=[act("a", ok(5)), act("a", Verdict(None, "api_error", rationale="HTTP 503 upstream")),
                                      act("b", Verdict(None, "timeout"))])]
    m = coach_step_metrics(eps)
    check_failures(eps, m, max_fraction=0.7)  # 2/3 failed: allowed
    with pytest.raises(CoachFailure, match=r"67% of the coach's verdicts failed.*'api_error': 1.*'timeout': 1.*HTTP 503"):
        check_failures(eps, m, max_fraction=0.5)


def test_bias_audit_warns_when_one_task_type_is_scored_higher(caplog):
    audit = BiasAudit(threshold=1.0, window=2)
    biased = episodes_by_type({"regression": [7.0, 8.0] * 4, "classification": [5.0, 6.0] * 4})
    with caplog.at_level(logging.WARNING):
        m = audit.update(biased)
    assert m["coach_bias/modeler/regression/mean"] == 7.5 and m["coach_bias/modeler/classification/mean"] == 5.5
    assert m["coach_bias/modeler/regression/std"] == 0.5 and m["coach_bias/modeler/regression/n"] == 8
    assert (m["coach_bias/modeler/type_gap"], m["coach_bias/warning"]) == (2.0, 1)
    assert "modeler's scores on regression tasks average 2.00 points above classification" in caplog.text

    fair = episodes_by_type({"regression": [6.0] * 8, "classification": [6.0] * 8})
    assert audit.update(fair)["coach_bias/modeler/type_gap"] == 1.0  # the window still holds the biased step
    m = audit.update(fair)  # ... and now it has left the 2-step window
    assert (m["coach_bias/max_type_gap"], m["coach_bias/warning"]) == (0.0, 0)


def test_bias_audit_needs_enough_scores_per_type():
    m = BiasAudit(threshold=1.0).update(episodes_by_type({"regression": [9.0] * 3, "classification": [1.0] * 3}))
    assert "coach_bias/modeler/type_gap" not in m and m["coach_bias/warning"] == 0


def test_bias_audit_final_score_agreement_with_outcome():
    eps = [
        Episode(f"e{i}", "t", task_type="math", outcome={"success": s}, actions=[act("solver", ok(3.0)), act("verifier", ok(v), final=True)])
        for i, (s, v) in enumerate([(True, 9.0), (True, 8.0), (False, 2.0), (False, 3.0)])
    ]
    m = BiasAudit().update(eps)
    assert m["coach_bias/final_score_on_success"] == 8.5 and m["coach_bias/final_score_on_failure"] == 2.5
    assert m["coach_bias/final_score_outcome_corr"] == pytest.approx(statistics.correlation([9, 8, 2, 3], [1, 1, 0, 0]))


def test_standardize_by_task_type_removes_the_gap_and_keeps_the_scale():
    eps = episodes_by_type({"regression": [7.0, 9.0], "classification": [3.0, 5.0]})
    eps += episodes_by_type({"math": [1.0, 2.0]}, agent="other")
    assign_rewards(eps, "process")
    before = [a.reward for ep in eps for a in ep.actions if a.agent == "modeler"]
    standardize_by_task_type(eps)
    reg = [ep.actions[0].reward for ep in eps if ep.task_type == "regression"]
    cls = [ep.actions[0].reward for ep in eps if ep.task_type == "classification"]
    assert statistics.fmean(reg) == pytest.approx(statistics.fmean(cls))  # the 4-point offset is gone
    after = reg + cls
    assert statistics.fmean(after) == pytest.approx(statistics.fmean(before))
    assert statistics.pstdev(after) == pytest.approx(statistics.pstdev(before))
    assert reg[1] > reg[0] and cls[1] > cls[0]  # the order within a type is kept
    # One task type only: R' = μ_k + σ_k·(R − μ_k)/σ_k = R.
    assert [ep.actions[0].reward for ep in eps if ep.task_type == "math"] == pytest.approx([1.0, 2.0])


def test_failure_policies_are_explicit():
    def episode():
        return Episode("e", "t", outcome={"success": True}, actions=[act("a", ok(4.0)), act("a", Verdict(None, "timeout"))])

    eps = [episode()]
    counts = assign_rewards(eps, "process", on_failure="outcome")
    assert [a.reward for a in eps[0].actions] == [4.0, 10.0] and counts["fallback"] == 1
    eps = [episode()]
    assign_rewards(eps, "process", on_failure="neutral", neutral_score=5.0)
    assert [a.reward for a in eps[0].actions] == [4.0, 5.0]
    assert eps[0].actions[1].verdict.score is None  # the verdict itself never gets a score
    eps = [episode()]
    assert assign_rewards(eps, "process")["left_out_by_status"] == {"timeout": 1}
    # Any other policy is refused by --mappa.coach.on_failure's choices (test_rewards: ..._refused_by_its_flag).


def test_a_hindsight_review_is_one_request_for_its_whole_episode():
    from openrlhf_mappa.coach import combine
    from openrlhf_mappa.episode import Review

    paid = Review([6.0, 2.0, 9.0], 1, "ok", "r", latency_s=4.0, tokens_in=900, tokens_out=60, retries=1)
    failed = Review(None, None, "parse_error", "prose", latency_s=5.0, tokens_in=800, tokens_out=50)
    hindsight = [Episode(f"e{i}", "t", review=r, actions=[act("a", v) for v in r.verdicts(3)])
                 for i, r in enumerate((paid, failed))]
    m = coach_step_metrics(hindsight, price_in=1.0)
    assert (m["coach/requests"], m["coach/reviews_ok"], m["coach/reviews_parse_error"]) == (2, 1, 1)
    assert (m["coach/verdicts_ok"], m["coach/verdicts_parse_error"], m["coach/failure_fraction"]) == (3, 3, 0.5)
    assert (m["coach/tokens_in"], m["coach/tokens_out"], m["coach/retries"]) == (1700, 110, 1)  # counted once per review
    assert (m["coach/latency_p50"], m["coach/latency_p99"]) == (4.0, 5.0)  # the reviews', not 0 s per action
    assert "coach/both_one_source" not in m

    # Mode both: the per-action verdicts are requests too; the combined ones are not.
    asked = [ok(8.0, latency_s=1.0, tokens_in=100), ok(4.0, latency_s=1.0, tokens_in=100), ok(5.0, cached=True, tokens_in=100)]
    for ep, review in zip(hindsight, (paid, failed)):
        for a, per_action, derived in zip(ep.actions, asked, review.verdicts(3)):
            a.verdict_parts = {"per_action": per_action, "hindsight": derived}
            a.verdict = combine(per_action, derived)
    m = coach_step_metrics(hindsight)
    assert m["coach/requests"] == 2 * 3 + 2 and m["coach/cache_hit_rate"] == pytest.approx(2 / 8)
    assert m["coach/tokens_in"] == 4 * 100 + 1700
    assert (m["coach/verdicts_ok"], m["coach/failure_fraction"], m["coach/both_one_source"]) == (6, 0.0, 3)
    assert [a.verdict.score for a in hindsight[0].actions] == [7.0, 3.0, 7.0]
    # per action (the paper's mode): one request per action, as before
    assert coach_step_metrics([Episode("e", "t", actions=[act("a", ok(5.0)) for _ in range(3)])])["coach/requests"] == 3
