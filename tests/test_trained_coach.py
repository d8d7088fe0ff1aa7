"""The trained coach (--mappa.coach.kind trained, openrlhf_mappa/coach/trained.py): each term of its reward, the
staleness rule for its verdicts, the agreement stop and the reference draws as unit tests; and a real run on CPU
(Ray, vLLM, DeepSpeed ZeRO-3) of the relay team with a random-init tiny coach in the cluster, the heuristic coach as
its reference judge, for 3 steps."""

import json
import os
import sys

import pytest

from conftest import REPO, TINY_RUN_FLAGS, local_cluster_env, run_training
from openrlhf_mappa.coach import CoachRequest
from openrlhf_mappa.coach.base import parse_score
from openrlhf_mappa.coach.trained import Judgement, TrainedCoach, coach_rewards, judge_metrics, strata_chances
from openrlhf_mappa.episode import Action, Episode, Verdict


def judged(episode_id, agent, score, final=False, task_type="math", ref=None, held_out=False, ref_status="ok",
           reply="x", p=0.25):
    """A Judgement of `agent`'s action in `episode_id` with the coach's `score` (None: no valid score) and the
    reference's `ref` (None: not asked), whose action was drawn for the reference with chance `p`."""
    request = CoachRequest(episode_id, agent, 0, "role", "task", task_type, "in", "out", "", is_final_agent=final)
    verdict = Verdict(score, "ok" if score is not None else "parse_error", version=0)
    if ref is not None:
        verdict.reference = {"score": ref if ref_status == "ok" else None, "status": ref_status, "held_out": held_out,
                             "p": p,
                             "coach": "heuristic", "tokens_in": 100, "tokens_out": 10, "cached": False}
    return Judgement(request, verdict, Action(episode_id, "coach", 0, [1], [2], response_text=reply))


def episode(episode_id, success, task_type="math", env_error=""):
    return Episode(episode_id, "t", task_type, outcome={"success": success}, env_error=env_error)


ALL = ("format", "outcome", "agreement", "bias")


def test_format_term_rewards_a_valid_score_and_never_a_reply_without_one():
    js = [judged("e1", "a", 7.0), judged("e1", "b", None, reply="no score"), judged("e1", "c", None, reply="ab12")]
    m = coach_rewards(js, [episode("e1", True)], ("format",))
    # No score: -3, plus half the share of digits in the reply (a slope toward a number, always below a score).
    assert [j.action.reward for j in js] == [1.0, -3.0, -2.75]
    assert (m["coach/term_format"], m["coach/term_format_n"]) == (pytest.approx(-1.583333), 3)
    # Format off: the reply with no score is left out, not paid 0 (which whitening could put above others).
    js = [judged("e1", "a", 7.0, ref=5.0), judged("e1", "b", None, ref=5.0)]
    coach_rewards(js, [episode("e1", True)], ("agreement",))
    assert js[0].action.reward == pytest.approx(0.6) and js[1].action.reward is None


def test_outcome_term_calibrates_the_final_agents_score_to_its_episodes_success():
    eps = [episode("ok", True), episode("bad", False), episode("broken", True, env_error="raised")]
    js = [judged("ok", "last", 8.0, final=True), judged("bad", "last", 8.0, final=True),
          judged("ok", "first", 8.0), judged("broken", "last", 8.0, final=True)]
    m = coach_rewards(js, eps, ("outcome",))
    # 1 - 2|s/10 - o|: 0.6 for a success, -0.6 for a failure; a non-final action or an episode with no outcome
    # gets the term's mean over those it applied to (0.0 here)
    assert [j.action.reward for j in js] == pytest.approx([0.6, -0.6, 0.0, 0.0])
    assert m["coach/term_outcome"] == pytest.approx(0.0) and m["coach/term_outcome_n"] == 2


def test_agreement_term_uses_the_reference_where_asked_and_never_a_held_out_action():
    js = [judged("e", "a", 8.0, ref=6.0), judged("e", "b", 8.0, ref=6.0, held_out=True), judged("e", "c", 8.0),
          judged("e", "d", 8.0, ref=6.0, ref_status="api_error"), judged("e", "f", 8.0, ref=8.0)]
    m = coach_rewards(js, [episode("e", True)], ("agreement",))
    # 0.6 and 1.0 where it applies; elsewhere its mean, 0.8: a held-out action counted would have had 0.6
    assert [j.action.reward for j in js] == pytest.approx([0.6, 0.8, 0.8, 0.8, 1.0])
    assert m["coach/term_agreement_n"] == 2 and m["coach/term_agreement"] == pytest.approx(0.8)
    # So whitened, the verdicts the reference never saw (format's +1 their only term) move neither way.
    coach_rewards(js, [episode("e", True)], ("format", "agreement"))
    rewards = [j.action.reward for j in js]
    assert rewards[1:4] == pytest.approx([sum(rewards) / len(rewards)] * 3)
    coach_rewards(js[2:4], [episode("e", True)], ("agreement",))  # no term judged anything: left out
    assert [j.action.reward for j in js[2:4]] == [None, None]


def test_agreement_bands_give_a_rare_reference_score_the_weight_of_the_usual_one():
    # Three referenced verdicts in the reference's band [0, 2) and one in [6, 8), of 5 bands: weights n/(B n_b),
    # 4/(2*3) and 4/(2*1). A coach that says 0 everywhere then loses on the rare one what it wins on the usual.
    js = [judged("e", f"a{i}", 0.0, ref=0.5) for i in range(3)] + [judged("e", "b", 0.0, ref=7.0)]
    coach_rewards(js, [episode("e", True)], ("agreement",), bands=5)
    assert [j.action.reward for j in js] == pytest.approx([0.9 * 2 / 3] * 3 + [-0.4 * 2])
    assert sum(j.action.reward for j in js) == pytest.approx(1.0)  # against 2.3 unweighted
    coach_rewards(js, [episode("e", True)], ("agreement",), bands=1)
    assert [j.action.reward for j in js] == pytest.approx([0.9] * 3 + [-0.4])
    # A held-out verdict is neither paid by the term nor counted in a band (counted, [6, 8) would hold 2 of 5 and
    # weigh 5/4 each): it gets the term's mean, (1.8 - 0.8) / 4.
    js.append(judged("e", "h", 0.0, ref=7.0, held_out=True))
    coach_rewards(js, [episode("e", True)], ("agreement",), bands=5)
    assert [j.action.reward for j in js] == pytest.approx([0.9 * 2 / 3] * 3 + [-0.4 * 2, 0.25])
    # One band present: every weight is 1, as unweighted. A score of exactly 10 is in the top band.
    js = [judged("e", "a", 10.0, ref=10.0), judged("e", "b", 6.0, ref=10.0)]
    coach_rewards(js, [episode("e", True)], ("agreement",), bands=5)
    assert [j.action.reward for j in js] == pytest.approx([1.0, 0.2])


def test_a_digit_reply_samples_one_digit_token_and_the_coach_replies_with_one_token(tiny_model):
    """--mappa.coach.reply digit: the coach's engines sample its one-token reply from the tokens of 0-9 alone, as
    vLLM's allowed_token_ids (each decodes to a score the strict parser reads); its AgentSpec generates one token,
    and learns at --mappa.coach.lr."""
    from transformers import AutoTokenizer

    from openrlhf_mappa.cli.train_mappa_ray import parse_args
    from openrlhf_mappa.placement import trainee_specs
    from openrlhf_mappa.rollout import AgentPolicy
    from openrlhf_mappa.team import load_topology

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    policy = AgentPolicy([], tokenizer, 1, 256, {"temperature": 1.0})
    TrainedCoach("", "PROCESS_SCORE", None, 0.25, 0.2, (), reply="digit").attach(policy)
    allowed = policy.sampling.pop("allowed_token_ids")
    assert policy.sampling == {"temperature": 1.0} and len(set(allowed)) == 10
    assert [parse_score(tokenizer.decode([t]), "PROCESS_SCORE") for t in allowed] == list(range(10))
    TrainedCoach("", "PROCESS_SCORE", None, 0.25, 0.2, ()).attach(policy)
    assert "allowed_token_ids" not in policy.sampling  # reply "text": the coach writes what it likes
    topology = os.path.join(REPO, "examples", "configs", "relay.yaml")
    for flags, tokens in (([], 6), (["--mappa.coach.reply", "digit"], 1)):
        args = parse_args(["--mappa.topology", topology, "--data.prompt_dataset", "x.jsonl", *TINY_RUN_FLAGS,
                           "--mappa.coach.kind", "trained", "--mappa.coach.model", "m", "--mappa.coach.max_tokens",
                           "6", *flags])
        assert trainee_specs(args, load_topology(topology))[-1].max_new_tokens == tokens
    # --mappa.coach.lr: the coach's actor learns at its own rate, the agents' at --actor.adam.lr.
    from openrlhf_mappa.placement import agent_args

    for coach_lr, expected in (([], 5e-2), (["--mappa.coach.lr", "1e-3"], 1e-3)):
        args = parse_args(["--mappa.topology", topology, "--data.prompt_dataset", "x.jsonl", *TINY_RUN_FLAGS,
                           "--actor.adam.lr", "5e-2", "--mappa.coach.kind", "trained", "--mappa.coach.model", "m",
                           *coach_lr])
        rates = [agent_args(args, spec).actor.adam.lr for spec in trainee_specs(args, load_topology(topology))]
        assert rates == [5e-2, 5e-2, 5e-2, expected]


def test_a_digit_reply_trains_on_every_one_digit_reply_where_the_agreement_term_judges(tiny_model):
    """--mappa.coach.reply digit through TrainedCoach.score: an action the agreement term will judge gives the coach
    ten actions of its own, one per digit, and the agents the sampled verdict (the reference's, held out or not,
    with pay_reference); a held-out action gives the coach the sampled one alone. No action carries vLLM's log-probs
    (over the digits, not the vocabulary). The engine is a stand-in that replies 4 (a real vLLM engine serves the
    coach in the e2e test below)."""
    import asyncio
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from openrlhf_mappa.coach.heuristic import HeuristicCoach
    from openrlhf_mappa.rollout import AgentPolicy

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)

    async def generate(ids, params):
        assert params.allowed_token_ids and len(params.allowed_token_ids) == 10  # sampled from the digits alone
        token = tokenizer.encode("4", add_special_tokens=False)
        step = [{token[0]: SimpleNamespace(logprob=-0.5)}]
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=token, logprobs=step, finish_reason="length")])

    engine = SimpleNamespace(generate=SimpleNamespace(remote=generate))
    request = CoachRequest("e", "a", 0, "role", "task", "math", "in", "7", "",
                           env_grade=(10.0, "reply rule: the reply is '\\\\d+' and ended on its own", False))
    every = [float(d) for d in range(10)]
    for held_out, pay, scores in ((0.0, False, every), (1.0, False, [4.0]), (0.0, True, every), (1.0, True, [4.0])):
        coach = TrainedCoach("{agent_output}", "PROCESS_SCORE", HeuristicCoach(), 1.0, held_out, ("agreement",),
                             reply="digit", pay_reference=pay)
        coach.attach(AgentPolicy([engine], tokenizer, 1, 256))
        verdict = asyncio.run(coach.score(request))
        judged = coach.judgements["e"]
        assert [j.verdict.score for j in judged] == scores and all(j.request is request for j in judged)
        assert [j.action.rollout_logprobs for j in judged] == [[]] * len(scores)
        # --mappa.coach.pay_reference: the agents get the reference's 10 (no coach version: never stale), the
        # coach still trains on its own verdicts; otherwise the agents get the coach's sampled 4, of version 0.
        paid = (10.0, None, "heuristic") if pay else (4.0, 0, "trained")
        assert (verdict.score, verdict.version, verdict.coach) == paid
        assert verdict.reference["score"] == 10.0 and verdict.reference["held_out"] == held_out
        assert all(j.verdict.reference == verdict.reference for j in judged)
        coach_rewards(judged, [episode("e", True)], ("agreement",), bands=1)
        if len(judged) == 10:  # each digit's agreement 1 - 2|d - 10|/10, less their mean plus the term's (-0.1 both)
            assert [j.action.reward for j in judged] == pytest.approx([-1 + 0.2 * d for d in range(10)])


def test_bias_term_penalizes_a_task_type_scored_above_what_its_outcomes_warrant():
    # Agent a: type "reg" scored 8 with success 1/2, "cls" scored 4 with success 1/2: g = 0.3 and -0.1, mean 0.1,
    # so "reg" verdicts pay 0.2 and "cls" nothing. Agent b saw one type only: no term.
    eps = [episode("r1", True, "reg"), episode("r2", False, "reg"), episode("c1", True, "cls"),
           episode("c2", False, "cls")]
    js = [judged(e.episode_id, "a", 8.0 if e.task_type == "reg" else 4.0, task_type=e.task_type) for e in eps]
    js.append(judged("r1", "b", 9.0, task_type="reg"))
    m = coach_rewards(js, eps, ("bias",))
    assert [j.action.reward for j in js] == pytest.approx([-0.2, -0.2, 0.0, 0.0, -0.1])  # b: the term's mean
    assert m["coach/term_bias_n"] == 4


def test_reward_is_the_sum_of_the_enabled_terms():
    js = [judged("e", "last", 8.0, final=True, ref=6.0)]
    m = coach_rewards(js, [episode("e", True)], ALL)
    assert js[0].action.reward == pytest.approx(1.0 + 0.6 + 0.6 + 0.0)
    assert set(m) == {f"coach/term_{t}{n}" for t in ALL for n in ("", "_n")}
    coach_rewards(js, [episode("e", True)], ("format", "agreement"))
    assert js[0].action.reward == pytest.approx(1.6)


def test_agents_never_train_on_a_verdict_from_a_coach_older_than_the_bound():
    actions = [Action("e", "a", i, [], []) for i in range(5)]
    for a, version in zip(actions, (5, 4, 3, 2, None)):  # None: a frozen coach's verdict
        a.verdict = Verdict(5.0, "ok", version=version)
    # One update behind is within a bound of 1, two are not (an off-by-one either way moves one of them), and the
    # same verdicts against a bound of 2 keep the third.
    for most, stale in ((1, [False, False, True, True, False]), (2, [False, False, False, True, False])):
        for a in actions:
            a.stale = False
        assert TrainedCoach("", "PROCESS_SCORE", None, 0.25, 0.2, ()).stale_verdicts(actions, 5, most) == sum(stale)
        assert [a.stale for a in actions] == stale
    # In the coach's warm-up (--mappa.coach.warmup_steps 5): a verdict of a coach with fewer than 5 updates too.
    for a in actions:
        a.stale = False
    coach = TrainedCoach("", "PROCESS_SCORE", None, 0.25, 0.2, (), warmup_steps=5)
    assert coach.stale_verdicts(actions, 5, 9) == 3
    assert [a.stale for a in actions] == [False, True, True, True, False]


def test_agreement_stop_after_the_warmup_only_and_never_when_off():
    agreed = lambda x: {"coach/heldout_agreement": x}
    stop = lambda least, warmup: TrainedCoach("", "PROCESS_SCORE", None, 0.25, 0.2, (), min_agreement=least,
                                              warmup_steps=warmup).agreement_stop
    assert stop(0.5, 10)(11, agreed(0.4)).startswith("step 11: the trained coach's agreement")
    assert "fell to 0.400, below --mappa.coach.min_agreement 0.5" in stop(0.5, 10)(11, agreed(0.4))
    assert stop(0.5, 10)(10, agreed(0.4)) is None  # still warming up
    assert stop(0.5, 0)(1, agreed(0.4)).startswith("step 1: ")  # no warm-up: from the first step
    assert stop(0.5, 10)(11, agreed(0.6)) is None
    assert stop(0.0, 10)(11, agreed(0.0)) is None  # off
    assert stop(0.5, 10)(11, agreed(None)) is None  # nothing held out this step


def test_several_verdicts_of_one_action_each_agree_against_their_mean():
    # --mappa.coach.reply digit: verdicts of one referenced action (one request), beside one verdict of another.
    first = judged("e", "a", 6.0, ref=6.0)
    js = [first] + [Judgement(first.request, Verdict(s, "ok", version=0, reference=dict(first.verdict.reference)),
                              Action("e", "coach", 0, [1], [2])) for s in (4.0, 2.0)] + [judged("e", "b", 5.0, ref=5.0)]
    coach_rewards(js, [episode("e", True)], ("agreement",), bands=1)
    # Agreements 1.0, 0.6 and 0.2 less their mean 0.6, plus the term's mean 0.7 (where a verdict no term judged
    # sits): the best verdict of the action is paid, the worst charged, whatever the action; the lone one keeps 1.0.
    assert [j.action.reward for j in js] == pytest.approx([1.1, 0.7, 0.3, 1.0])
    m = coach_rewards(js, [episode("e", True)], ("format", "agreement", "outcome"), bands=1)
    assert m["coach/term_agreement"] == pytest.approx(0.7)  # the term as the reference scored it, before baselines
    assert [js[i].action.reward - js[i + 1].action.reward for i in (0, 1)] == pytest.approx([0.4, 0.4])
    m = judge_metrics(js)  # the reference was asked about two actions, not four
    assert (m["coach/reference_requests"], m["coach/reference_share"]) == (2, 1.0)


def test_judge_metrics_held_out_agreement_reference_share_and_its_cost():
    js = [judged("e", "a", 8.0, ref=6.0, held_out=True), judged("e", "b", None, ref=6.0, held_out=True),
          judged("e", "c", 8.0, ref=6.0), judged("e", "d", 8.0)]
    m = judge_metrics(js, price_in=1.0, price_out=2.0)
    assert m["coach/heldout_agreement"] == pytest.approx((0.8 + 0.0) / 2)  # no valid score agrees 0
    assert (m["coach/heldout_n"], m["coach/reference_requests"], m["coach/reference_share"]) == (2, 3, 0.75)
    assert m["coach/parse_error_rate"] == 0.25
    assert m["coach/heldout_correlation"] is None  # one held-out pair with a score: no correlation
    scored = [(8.0, 6.0), (2.0, 1.0), (5.0, 4.0)]  # (coach, reference)
    pairs = [judged("e", str(i), s, ref=r, held_out=True) for i, (s, r) in enumerate(scored)]
    assert judge_metrics(pairs)["coach/heldout_correlation"] == pytest.approx(0.9934, abs=1e-4)
    constant = [judged("e", str(i), 0.0, ref=r, held_out=True) for i, r in enumerate([0.0, 0.5, 7.0])]
    # A coach that always says 0 agrees with a reference that mostly does, and tells nothing.
    assert judge_metrics(constant)["coach/heldout_agreement"] == pytest.approx(0.75)
    assert judge_metrics(constant)["coach/heldout_correlation"] is None
    assert m["coach/cost_usd"] == pytest.approx((300 * 1.0 + 30 * 2.0) / 1e6)
    # Each held-out verdict weighs 1/p, p the chance its action was drawn (stratified draws): one drawn surely
    # (agreement 1.0) beside one drawn at 0.25 (agreement 0.5), which stands for four such actions.
    mixed = [judged("e", "a", 6.0, ref=6.0, held_out=True, p=1.0), judged("e", "b", 1.0, ref=6.0, held_out=True)]
    assert judge_metrics(mixed)["coach/heldout_agreement"] == pytest.approx((1.0 + 4 * 0.5) / 5)


def test_reference_draws_are_fixed_per_action_and_hold_the_fraction():
    coach = TrainedCoach("{agent_output}", "PROCESS_SCORE", None, 0.25, 0.2, ALL, seed=3)
    requests = [CoachRequest(f"s1-{i}", "a", 0, "", "", "", "", "", "") for i in range(4000)]
    draws = [coach.draws(r) for r in requests]
    assert draws == [coach.draws(r) for r in requests]  # a rerun asks the reference about the same actions
    asked = [held for ask, held, p in draws if ask]
    assert abs(len(asked) / 4000 - 0.25) < 0.02 and abs(sum(asked) / len(asked) - 0.2) < 0.04


def test_stratified_draws_judge_the_rare_kind_of_action_as_often_and_keep_the_fraction():
    # 25% of 100 actions: the 10 ended ones all (a share of 12.5 > 10), the 15 left over the 90 cut off.
    assert strata_chances(0.25, {True: 90, False: 10}) == pytest.approx({False: 1.0, True: 15 / 90})
    assert strata_chances(0.25, {True: 50, False: 50}) == pytest.approx({False: 0.25, True: 0.25})
    assert strata_chances(0.25, {True: 96, False: 0}) == pytest.approx({False: 1.0, True: 0.25})
    coach = TrainedCoach("{agent_output}", "PROCESS_SCORE", None, 0.25, 0.2, ALL, stratified=True, seed=3)
    cut = lambda i: None if i % 10 == 0 else 16
    step = [judged(f"s1-{i}", "a", 5.0) for i in range(100)]
    for i, j in enumerate(step):
        j.request.truncated_at = cut(i)
        coach.judgements.setdefault(j.request.episode_id, []).append(j)
    coach.rewarded([episode(f"s1-{i}", False) for i in range(100)])  # the step's counts set the next draws
    requests = [CoachRequest(f"s2-{i}", "a", 0, "", "", "", "", "", "", truncated_at=cut(i)) for i in range(4000)]
    draws = [coach.draws(r) for r in requests]
    assert all(ask and p == 1.0 for (ask, _, p), r in zip(draws, requests) if r.truncated_at is None)
    assert abs(sum(ask for ask, _, _ in draws) / 4000 - 0.25) < 0.02


@pytest.mark.parametrize("flags, message", [
    ([], "give the coach's model"),
    (["--mappa.coach.model", "m", "--mappa.coach.mode", "hindsight"], "not --mappa.coach.mode hindsight"),
    (["--mappa.coach.model", "m", "--mappa.coach.terms", "format,vibes"], "--mappa.coach.terms format,vibes"),
    (["--mappa.coach.model", "m", "--mappa.shared_policy"], "--mappa.shared_policy is not built"),
    (["--mappa.coach.model", "m", "--mappa.colocate", "agent", "--vllm.enable_sleep"], "--vllm.enable_sleep is not"),
    (["--mappa.coach.model", "m", "--mappa.coach.reference_kind", "openai"], "needs --mappa.coach.reference_model"),
    (["--mappa.coach.model", "m", "--mappa.coach.reply", "digit", "--algo.advantage.is_correction_level", "token"],
     "no importance-sampling correction can apply to it"),
])
def test_a_trained_coach_is_refused_with_its_reason(flags, message):
    from openrlhf_mappa.cli.train_mappa_ray import parse_args, validate
    from openrlhf_mappa.team import load_topology

    topology = os.path.join(REPO, "examples", "configs", "relay.yaml")
    args = parse_args(["--mappa.topology", topology, "--data.prompt_dataset", "x.jsonl", *TINY_RUN_FLAGS,
                       "--mappa.coach.kind", "trained", *flags])
    with pytest.raises(SystemExit, match=message.replace(".", r"\.").replace("(", r"\(")):
        validate(args, load_topology(topology))


def test_the_training_flags_build_the_trained_coach_and_each_flag_acts(tmp_path, tiny_model, monkeypatch):
    """Issue 51: the trained coach as a training job builds it (parse_args, validate, run_coach, build_coach:
    train_mappa_ray.train's own calls), every --mappa.coach.* flag it reads set off its default, against the default
    build: each flag changes what the coach does. Its engine is a stand-in that replies 4 (a unit test starts no
    vLLM; the e2e test below runs a real one); its reference judge is a real HTTP server on 127.0.0.1."""
    import argparse
    import asyncio
    import random
    from types import SimpleNamespace

    import yaml
    from transformers import AutoTokenizer

    from coach_server import COACH_TEMPLATE, CoachServer
    from openrlhf_mappa.cli.train_mappa_ray import add_trained_coach_args, parse_args, run_coach, validate
    from openrlhf_mappa.placement import agent_args, trainee_specs
    from openrlhf_mappa.rollout import AgentPolicy
    from openrlhf_mappa.team import load_topology

    relay = yaml.safe_load(open(os.path.join(REPO, "examples", "configs", "relay.yaml")))
    path = tmp_path / "relay.yaml"  # the rule server reads the agent's output from its template's markers
    path.write_text(yaml.safe_dump({**relay, "coach_template": COACH_TEMPLATE + "\nPROCESS_SCORE: <0-10>"}))
    topology, tokenizer, sampled_from = load_topology(str(path)), AutoTokenizer.from_pretrained(tiny_model), []

    async def generate(ids, params):
        sampled_from.append(params.allowed_token_ids)
        token = tokenizer.encode("4", add_special_tokens=False)
        step = [{token[0]: SimpleNamespace(logprob=-0.5)}]
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=token, logprobs=step, finish_reason="length")])

    engine, given = SimpleNamespace(generate=SimpleNamespace(remote=generate)), set()

    def built(*flags):
        given.update(f for f in flags if f.startswith("--mappa.coach."))
        args = parse_args(["--mappa.topology", str(path), "--data.prompt_dataset", "x.jsonl", *TINY_RUN_FLAGS,
                           "--mappa.coach.kind", "trained", "--mappa.coach.model", tiny_model, *flags])
        validate(args, topology)
        coach = run_coach(args, topology)
        coach.attach(AgentPolicy([engine], tokenizer, 1, 256))
        return args, coach

    # --mappa.coach.reference_fraction, held_out_fraction and --train.seed: each action's two draws (TrainedCoach.draws)
    # from a RNG seeded by the run's seed and the action, asked below the fraction, then held out below the share.
    requests = [CoachRequest(f"e{i}", "item", 0, "", "", "", "", "", "") for i in range(400)]
    drawn = lambda seed, fraction, share: [
        (rng.random() < fraction, rng.random() < share)
        for rng in (random.Random(f"{seed}/{r.episode_id}/item/0") for r in requests)]
    _, default = built()
    _, flagged = built("--mappa.coach.reference_fraction", "0.6", "--mappa.coach.held_out_fraction", "0.5",
                       "--train.seed", "7")
    differ = lambda coach, expected: [r.episode_id for r, e in zip(requests, expected) if coach.draws(r)[:2] != e]
    assert differ(default, drawn(42, 0.25, 0.2)) == [] and differ(flagged, drawn(7, 0.6, 0.5)) == []
    assert differ(flagged, drawn(42, 0.6, 0.5))  # the seed chooses which actions

    # --mappa.coach.reference_draw stratified: after a step of 9 cut-off actions and 1 ended one, the ended kind is
    # asked surely and the cut-off at 1.5 / 9 (the fraction's 2.5 of 10); uniform draws keep the fraction.
    _, stratified = built("--mappa.coach.reference_draw", "stratified")
    for coach in (default, stratified):
        for i in range(10):
            j = judged(f"s{i}", "item", 5.0)
            j.request.truncated_at = 16 if i else None
            coach.judgements[f"s{i}"] = [j]
        coach.rewarded([episode(f"s{i}", False) for i in range(10)])
    ended, cut = (CoachRequest("n", "item", 0, "", "", "", "", "", "", truncated_at=t) for t in (None, 16))
    assert (default.draws(ended)[2], default.draws(cut)[2]) == (0.25, 0.25)
    assert (stratified.draws(ended)[2], stratified.draws(cut)[2]) == pytest.approx((1.0, 1.5 / 9))

    # --mappa.coach.terms and agreement_bands: four verdicts of 0 on one task's actions, the first the final agent's
    # (success: outcome -1), the reference's scores 0.5 (3x) and 7. Default: format 1, outcome -1 (the others at its
    # mean), agreement 0.9 and -0.4 weighted 2/3 and 2 in 5 bands. format,agreement in 1 band: 1 + 0.9 or 1 - 0.4.
    for flags, terms, expected in (((), ALL, [0.6] * 3 + [-0.8]),
                                   (("--mappa.coach.terms", "format,agreement", "--mappa.coach.agreement_bands", "1"),
                                    ("format", "agreement"), [1.9] * 3 + [0.6])):
        _, coach = built(*flags)
        js = [judged("t", "code", 0.0, final=True, ref=0.5)] + [judged("t", a, 0.0, ref=r)
                                                                 for a, r in (("b", 0.5), ("c", 0.5), ("d", 7.0))]
        coach.judgements["t"] = js
        mine, metrics = coach.rewarded([episode("t", True)])
        assert [a.reward for a in mine] == pytest.approx(expected)
        assert {k for k in metrics if k.startswith("coach/term_")} == {f"coach/term_{t}{n}" for t in terms
                                                                        for n in ("", "_n")}

    # The reference judge (--mappa.coach.reference_kind openai, reference_model, base_url, api_key_env), what it is
    # paid (price_in, price_out), reply digit and pay_reference, on one action drawn for the reference:
    # the rule server scores "abc" 3, at 10 prompt and 5 completion tokens.
    monkeypatch.setenv("JUDGE_KEY", "sk-judge")
    request = CoachRequest("a", "item", 0, "role", "task", "math", "in", "abc", "", ground_truth="Required reply: x")
    with CoachServer() as server:
        asked = ("--mappa.coach.reference_fraction", "1", "--mappa.coach.held_out_fraction", "0")
        for flags in ((), ("--mappa.coach.reference_kind", "openai", "--mappa.coach.reference_model", "judge",
                           "--mappa.coach.base_url", server.base_url, "--mappa.coach.api_key_env", "JUDGE_KEY",
                           "--mappa.coach.price_in", "1", "--mappa.coach.price_out", "2", "--mappa.coach.reply",
                           "digit", "--mappa.coach.pay_reference")):
            _, coach = built(*asked, *flags)
            verdict = asyncio.run(coach.score(request))
            judgements, (_, metrics) = len(coach.judgements["a"]), coach.rewarded([episode("a", True)])
            if not flags:  # the heuristic reference; the agents get the coach's 4, sampled from any token; one verdict
                assert (verdict.score, verdict.version, verdict.reference["coach"]) == (4.0, 0, "heuristic")
                assert (sampled_from[-1], judgements, metrics["coach/cost_usd"], server.requests) == (None, 1, 0.0, [])
                continue
            assert verdict.reference["coach"] == "openai:judge" and len(server.requests) == 1
            assert server.requests[0]["body"]["model"] == "judge"
            assert server.requests[0]["authorization"] == "Bearer sk-judge"
            assert (verdict.score, verdict.version, verdict.coach) == (3.0, None, "openai:judge")  # pay_reference
            assert len(set(sampled_from[-1])) == 10  # reply digit: sampled from the ten digits alone,
            assert judgements == 10  # and it trains on every one-digit reply to a referenced action
            assert metrics["coach/cost_usd"] == pytest.approx((10 * 1 + 5 * 2) / 1e6)

    # --mappa.coach.warmup_steps 2: the agents leave out the verdicts of a coach with fewer than 2 updates, however
    # fresh, and min_agreement waits as long: the run stops on held-out agreement 0.6 < 0.7 after step 2 only.
    _, warm = built("--mappa.coach.warmup_steps", "2", "--mappa.coach.min_agreement", "0.7")
    actions = [Action("e", "item", i, [], [], verdict=Verdict(5.0, "ok", version=v)) for i, v in enumerate((0, 1, 2))]
    assert default.stale_verdicts(actions, 2, 5) == 0 and warm.stale_verdicts(actions, 2, 5) == 2
    assert [a.stale for a in actions] == [True, True, False]
    agreed = {"coach/heldout_agreement": 0.6}
    assert warm.agreement_stop(2, agreed) is None and "below --mappa.coach.min_agreement 0.7" in warm.agreement_stop(
        3, agreed)
    assert default.agreement_stop(11, {"coach/heldout_agreement": 0.0}) is None  # 0: never

    # --mappa.coach.model, lr and max_tokens reach the launcher: the coach's own trainee spec and actor settings.
    args, _ = built("--mappa.coach.lr", "1e-3", "--mappa.coach.max_tokens", "6")
    spec = trainee_specs(args, topology)[-1]
    assert (spec.name, spec.model, spec.max_new_tokens, agent_args(args, spec).actor.adam.lr) == (
        "coach", tiny_model, 6, 1e-3)
    # Every flag add_trained_coach_args defines is set above: a new one needs a case here.
    parser = argparse.ArgumentParser()
    add_trained_coach_args(parser)
    assert {a.option_strings[0] for a in parser._actions if a.dest != "help"} <= given


@pytest.mark.e2e
def test_a_trained_coach_learns_beside_the_agents_it_scores(tmp_path, tiny_model):
    """The relay team, 3 steps of 2 tasks x 2 samples, coached by a tiny model on a logical GPU of its own (actor and
    engine), first distilled by `mappa coach distill` from a recorded relay run as a user runs it (issue 54: the
    output loads with its chat template, no episode on both sides, distill.json's metrics recomputed from its
    replies), the heuristic coach its reference on half the actions, trained asynchronously with
    partial rollouts (step 2 is generated and judged beside step 1) and --mappa.max_staleness 0. From the run's
    records: the reference judged exactly the actions its draws chose; each term of the coach's reward and its
    held-out agreement are recomputed from the verdicts; every verdict's coach version lies between the coach's
    versions when its step's rollout began and when it trained, and an action is left out exactly when its own
    or its coach's version is behind at that step's training (syncs.jsonl), for the agents and for the coach alike,
    the step's staleness metrics and trained rows recomputed; its exported weights differ from the ones it
    started with."""
    import torch
    from safetensors.torch import load_file

    from openrlhf_mappa.coach.audit import pearson

    from transformers import AutoTokenizer

    from openrlhf_mappa.tools.distill import report
    from test_distill import distill

    run_dir, final, distilled = tmp_path / "run", tmp_path / "final", tmp_path / "distilled"
    proc = distill(tiny_model, distilled, "--rollout.max_new_tokens", "8")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert AutoTokenizer.from_pretrained(distilled).chat_template  # a coach sends its prompt as one user message
    summary = json.loads((distilled / "distill.json").read_text())
    held = [json.loads(line) for line in open(distilled / "distill" / "heldout.jsonl")]
    train = [json.loads(line) for line in open(distilled / "distill" / "train.jsonl")]
    assert summary["rows"] == {"train": len(train), "heldout": len(held)} and train and held
    assert not {r["episode_id"] for r in held} & {r["episode_id"] for r in train}
    expected = report(held, summary["replies"], "PROCESS_SCORE")  # the metrics, recomputed from the replies
    assert {k: summary[k] for k in expected} == expected
    assert "agreement" in proc.stdout and "reference band" in proc.stdout
    argv = ["--mappa.topology", os.path.join(REPO, "examples", "configs", "relay.yaml"), "--mappa.model", tiny_model,
            "--data.prompt_dataset", os.path.join(REPO, "examples", "data", "relay_train.jsonl"),
            "--data.max_samples", "6", "--mappa.run_dir", str(run_dir), *TINY_RUN_FLAGS,
            "--data.max_len", "1024",  # after TINY_RUN_FLAGS' 512: the relay's coach prompt holds the agent's
            "--actor.adam.lr", "5e-2", "--actor.lr_warmup_ratio", "0",
            "--mappa.coach.kind", "trained", "--mappa.coach.model", str(distilled), "--mappa.coach.max_tokens", "6",
            "--mappa.coach.reference_fraction", "0.5", "--mappa.coach.held_out_fraction", "0.25",
            "--mappa.coach.on_failure", "neutral",  # the agents train on the steps a random coach gives no score
            # Issue 51: a trained coach never ran asynchronously. Bound 0: a verdict one coach update old is left out
            # by the agents and by the coach (its own action), so both sides of the rule are exercised.
            "--train.async_enable", "--train.partial_rollout_enable", "--mappa.max_staleness", "0",
            "--ckpt.path", str(tmp_path / "ckpt"), "--ckpt.output_dir", str(final)]  # fmt: skip
    proc = run_training([sys.executable, "-m", "openrlhf_mappa.cli.train_mappa_ray", *argv], tmp_path / "train",
                        timeout=1200, cwd=tmp_path, env=local_cluster_env(8))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert "coach/actor" in proc.stdout  # the placement plan counts the coach's GPUs

    episodes = [json.loads(line) for line in open(run_dir / "episodes.jsonl")]
    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    syncs = [json.loads(line) for line in open(run_dir / "syncs.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2, 3] and len(episodes) == 12
    # Each trainee's version when step `step` trained: the syncs of the steps before (each update ends with one).
    now = lambda agent, step: sum(s["agent"] == agent and s["step"] < step for s in syncs)
    coach = TrainedCoach("", "PROCESS_SCORE", None, 0.5, 0.25, (), seed=42)
    held_out_n, coach_stale = 0, 0
    for m in metrics:
        step = m["step"]
        acted = [(ep, a) for ep in episodes if ep["step"] == step for a in ep["actions"]]
        verdicts = [a["verdict"] for _, a in acted]
        assert len(verdicts) == 12 and {v["coach"] for v in verdicts} == {"trained"}
        for ep, a in acted:  # the reference was asked about the actions drawn for it, and only those
            request = CoachRequest(ep["episode_id"], a["agent"], a["turn"], "", "", "", "", "", "")
            asked, held_out, _ = coach.draws(request)
            assert (a["verdict"]["reference"] is not None) == asked
            if asked:
                assert a["verdict"]["reference"]["held_out"] == held_out and a["verdict"]["reference"]["status"] == "ok"
                assert a["verdict"]["reference"]["p"] == 0.5  # uniform draws
        refs = [v["reference"] for v in verdicts if v["reference"]]
        assert m["coach/reference_requests"] == len(refs) and m["coach/reference_share"] == len(refs) / 12
        # Each term, recomputed from the verdicts (a trained coach's rationale is its reply): format +1, or -3 plus
        # half the reply's share of digits; agreement on the referenced, not held out ones, each weighted by
        # n / (B n_b) for the reference's score band (5 bands of width 2 by default); outcome on the final
        # agent's valid verdicts, 1 - 2|s/10 - success|. The coach's stale verdicts count too (it never trains
        # on them, but they judged the same actions).
        valid = [v for v in verdicts if v["score"] is not None]
        digits = lambda text: sum(ch.isdigit() for ch in text) / max(1, len(text))
        formats = [1.0 if v["score"] is not None else -3 + digits(v["rationale"]) / 2 for v in verdicts]
        assert m["coach/term_format"] == pytest.approx(sum(formats) / 12)
        pairs = [(v["score"], v["reference"]["score"]) for v in valid
                 if v["reference"] and not v["reference"]["held_out"]]
        bands = [min(4, int(ref // 2)) for _, ref in pairs]
        agree = [len(bands) / (len(set(bands)) * bands.count(b)) * (1 - 2 * abs(s - ref) / 10)
                 for (s, ref), b in zip(pairs, bands)]
        assert m["coach/term_agreement_n"] == len(agree)
        assert m["coach/term_agreement"] == (pytest.approx(sum(agree) / len(agree)) if agree else None)
        finals = [1 - 2 * abs(a["verdict"]["score"] / 10 - ep["outcome"]["success"]) for ep, a in acted
                  if a["agent"] == "code" and a["verdict"]["score"] is not None and not ep["env_error"]]
        assert m["coach/term_outcome_n"] == len(finals)
        assert m["coach/term_outcome"] == (pytest.approx(sum(finals) / len(finals)) if finals else None)
        assert m["coach/term_bias_n"] == 0 and m["coach/term_bias"] is None  # the relay has one task type
        assert m["coach/parse_error_rate"] == pytest.approx(1 - len(valid) / 12)
        # Held-out agreement: 1 - |s - s_ref|/10 (0 for a reply with no score), each weighted 1/p.
        held = [v for v in verdicts if v["reference"] and v["reference"]["held_out"]]
        weights = [1 / v["reference"]["p"] for v in held]
        agreed = [0.0 if v["score"] is None else 1 - abs(v["score"] - v["reference"]["score"]) / 10 for v in held]
        assert m["coach/heldout_n"] == len(held)
        assert m["coach/heldout_agreement"] == (
            pytest.approx(sum(a * w for a, w in zip(agreed, weights)) / sum(weights)) if held else None)
        scored = [(v["score"], v["reference"]["score"]) for v in held if v["score"] is not None]
        correlation = pearson(scored)  # None where undefined: fewer than 2 pairs, or a constant side
        assert m["coach/heldout_correlation"] == (None if correlation is None else pytest.approx(correlation))
        held_out_n += len(held)

        # Async: step t's rollout began once step t - 2 had trained, so each verdict's coach version lies between
        # the coach's version then and at step t's training (its syncs before step t).
        lo, hi = now("coach", step - 1), now("coach", step)
        assert all(lo <= v["version"] <= hi for v in verdicts), (step, lo, hi, [v["version"] for v in verdicts])
        # Bound 0: an action is left out when any version it records (its own agent's, or one whose output it
        # saw) or its verdict's coach version is behind that trainee's version at the step's training.
        fresh = {}
        for ep, a in acted:
            behind = max([now(name, step) - v for name, v in a["versions"].items()] + [0])
            coach_behind = now("coach", step) - a["verdict"]["version"]
            assert a["stale"] == (behind > 0 or coach_behind > 0), (step, a["agent"], a["versions"], a["verdict"])
            assert not a["stale"] or a["reward"] is None
            fresh.setdefault(a["agent"], []).append(not a["stale"])
            coach_stale += coach_behind > 0
            fresh.setdefault("coach", []).append(coach_behind == 0)
        for name, kept in fresh.items():  # a train batch of 4: floor(n / 4) * 4 of the n fresh rows train
            p = f"agent/{name}/"
            assert (m[p + "trained_actions"], m[p + "updated"]) == (sum(kept) // 4 * 4, int(sum(kept) >= 4)), name
            if name == "coach":
                assert m["coach/stale_left_out"] == len(kept) - sum(kept)
                continue
            lag = [now(name, step) - a["versions"][name] for _, a in acted if a["agent"] == name]
            assert (m[p + "staleness_max"], m[p + "stale_left_out"]) == (max(lag), len(kept) - sum(kept)), name
            assert m[p + "staleness_mean"] == pytest.approx(sum(lag) / len(lag))
    # Step 2's rollout began with step 1's, before any update: its first verdicts are one coach version behind.
    assert coach_stale > 0 and held_out_n > 0
    updates = sum(m["agent/coach/updated"] for m in metrics)
    assert sorted(s["version"] for s in syncs if s["agent"] == "coach") == list(range(1, updates + 1))
    start = load_file(distilled / "model.safetensors")
    end = load_file(final / "coach" / "model.safetensors")
    moved = [k for k in start if not torch.equal(start[k].float(), end[k].float())]
    assert len(moved) > len(start) // 2, moved  # the coach trained


def test_the_coach_never_trains_on_its_own_verdicts_the_agents_drop_as_stale():
    # Issue 51: under async training the agents left out verdicts more than the bound behind (stale_verdicts), while
    # the coach trained on those same actions. Its own actions now meet the same bound: at version 5 with bound 0,
    # its version-4 verdict trains neither the agents nor the coach.
    from openrlhf_mappa.coach.heuristic import HeuristicCoach
    from openrlhf_mappa.episode import COACH_NAME

    coach = TrainedCoach("{agent_output}", "PROCESS_SCORE", HeuristicCoach(), reference_fraction=0.0,
                         held_out_fraction=0.0, terms=("format",))
    judgements = []
    for i, version in enumerate((5, 4)):
        request = CoachRequest(f"e{i}", "solver", 0, "role", "task", "math", "input", "output", "")
        verdict = Verdict(7.0, "ok", version=version)
        action = Action(f"e{i}", COACH_NAME, 0, [1], [2], versions={COACH_NAME: version})
        agent_action = Action(f"e{i}", "solver", 0, [1], [2])
        agent_action.verdict = verdict
        judgements.append((Judgement(request, verdict, action), agent_action))
    coach.judgements = {j.request.episode_id: [j] for j, _ in judgements}
    episodes = [Episode(f"e{i}", "t", "math", [agent]) for i, (_, agent) in enumerate(judgements)]
    actions, metrics = coach.rewarded(episodes, now=5, most=0)
    assert [a.reward for a in actions] == [1.0, None] and metrics["coach/stale_left_out"] == 1
    assert coach.stale_verdicts([agent for _, agent in judgements], 5, 0) == 1  # the agents drop the same one
