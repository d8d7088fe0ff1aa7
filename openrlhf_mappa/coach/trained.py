"""The trained coach (--mappa.coach.kind trained): a coach model that is a member of the team. It has its own
vLLM engines and ZeRO-3 actor, like an agent's (placement.trainee_specs), and its verdicts go through the same
strict parser as an API coach's. Each verdict is also one action of its own, and it trains on those with the
same REINFORCE++ machinery as an agent, rewarded by the terms of coach_rewards. A reference judge (any other
coach kind) scores a sampled fraction of the actions; a share of those is held out to measure agreement, never
trained on.
"""

import asyncio
import random
import time
from dataclasses import dataclass, replace

from openrlhf_mappa.coach.audit import pearson
from openrlhf_mappa.coach.base import Coach, CoachRequest, parse_score, render_prompt
from openrlhf_mappa.episode import COACH_NAME, Action, Verdict

TERMS = ("format", "outcome", "agreement", "bias")


@dataclass
class Judgement:
    """One verdict of the trained coach: the request it judged, the verdict given, and the coach's own action
    (its prompt, reply, sampling log-probs and weight version), which its reward lands on."""

    request: CoachRequest
    verdict: Verdict
    action: Action


class TrainedCoach(Coach):
    name = "trained"

    def __init__(self, template: str, score_key: str, reference: Coach, reference_fraction: float,
                 held_out_fraction: float, terms: tuple, agreement_bands: int = 5, reply: str = "text",
                 stratified: bool = False, pay_reference: bool = False, seed: int = 0, warmup_steps: int = 0,
                 min_agreement: float = 0.0, price_in: float = 0.0, price_out: float = 0.0):
        self.template, self.score_key, self.reference = template, score_key, reference
        # The driver's rules for it (trainer.py): which of its verdicts the agents train on and from when its
        # drift stops the run (both after warmup_steps), and the reference's prices (USD per 1M tokens), from
        # its flags.
        self.warmup_steps, self.min_agreement = warmup_steps, min_agreement
        self.price_in, self.price_out = price_in, price_out
        self.pay_reference = pay_reference  # the agents are paid the reference's score where it judged
        self.reference_fraction, self.held_out_fraction, self.terms, self.bands, self.reply, self.seed = (
            reference_fraction, held_out_fraction, tuple(terms), agreement_bands, reply, seed)
        self.digits = []  # the token of each of 0-9 (reply "digit")
        self.policy = None  # its AgentPolicy (engines, tokenizer, sync gate): attach()
        # The chance that the reference is asked about an action, by whether it was cut off: the last step's
        # strata share the fraction (stratified), or each is asked at the fraction (and in a run's first
        # step).
        self.stratified, self.ask = stratified, {False: reference_fraction, True: reference_fraction}
        self.agent = None  # its launch.Agent: actor, engines, AgentTrainer
        self.judgements = {}  # episode id -> its Judgements not trained on yet

    def attach(self, policy) -> None:
        """Judge with this AgentPolicy. With reply "digit" its one-token reply (placement.trainee_specs) is
        sampled from the digits 0-9 alone, so every verdict parses and none of its training goes into learning
        the format."""
        if self.reply == "digit":
            ids = {d: policy.tokenizer.encode(d, add_special_tokens=False) for d in "0123456789"}
            split = [d for d, t in ids.items() if len(t) != 1]
            if split:
                raise ValueError(
                    f"--mappa.coach.reply digit: the coach's tokenizer does not write the digits "
                    f"{', '.join(split)} as one token each"
                )
            self.digits = [t[0] for t in ids.values()]
            policy.sampling = {**policy.sampling, "allowed_token_ids": self.digits}
        self.policy = policy

    def draws(self, request: CoachRequest) -> tuple:
        """(asked of the reference, held out, the chance it was asked): fixed per action, seed and chance, so
        a rerun asks the same ones."""
        rng = random.Random(f"{self.seed}/{request.episode_id}/{request.agent}/{request.turn}")
        p = self.ask[request.truncated_at is not None]
        return rng.random() < p, rng.random() < self.held_out_fraction, p

    async def score(self, request: CoachRequest) -> Verdict:
        asked, held_out, p = self.draws(request)
        # off the critical path
        reference = asyncio.ensure_future(self.reference.score(request)) if asked else None
        t0, prompt = time.time(), render_prompt(self.template, request)
        text, ids, too_long = self.policy.prompt_ids([{"role": "user", "content": prompt}])
        if too_long:
            verdicts = [Verdict(None, "skipped", f"trained coach: prompt of {len(ids)} tokens over its "
                                "budget", self.name)]
        else:
            every = self.reply == "digit" and asked and not held_out
            generated, version, version_end = await self.policy.sample(ids)
            verdicts = [self.judged(request, text, ids, generated, version=version, version_end=version_end,
                                    latency_s=time.time() - t0, train=not every)]
            if every:
                # The coach trains on every one-digit reply to an action its agreement term judges, not on the one it
                # sampled: once it always gives one score there, a sampled reply's gradient vanishes, wrong or right.
                verdicts += [self.judged(request, text, ids, ([digit], True, []), version=version,
                                         version_end=version, latency_s=0.0) for digit in self.digits]
        if reference is not None:
            ref = await reference
            for verdict in verdicts:
                verdict.reference = {
                    "score": ref.score,
                    "status": ref.status,
                    "held_out": held_out,
                    "p": p,
                    "coach": ref.coach,
                    "tokens_in": ref.tokens_in,
                    "tokens_out": ref.tokens_out,
                    "cached": ref.cached,
                }
            if self.pay_reference and ref.status == "ok":
                # The agents get the better judge's score where it was paid for; no coach version: never
                # stale.
                mine = verdicts[0]
                said = mine.status if mine.score is None else mine.score
                why = f"the reference's score; the trained coach (version {mine.version}) said {said}"
                return replace(
                    mine, score=ref.score, status="ok", coach=ref.coach, version=None, rationale=why
                )
        return verdicts[0]  # the sampled one, the agents'

    def judged(self, request: CoachRequest, text: str, ids: list, generated: tuple, *, version: int,
               version_end: int, latency_s: float, train: bool = True) -> Verdict:
        """The verdict of one reply, kept (train) as a Judgement for the coach's own training."""
        reply_ids, truncated, logprobs = generated
        reply = self.policy.tokenizer.decode(reply_ids, skip_special_tokens=True)
        score = parse_score(reply, self.score_key)
        verdict = Verdict(score, "ok" if score is not None else "parse_error", reply[:2000], self.name,
                          latency_s=latency_s, tokens_in=len(ids), tokens_out=len(reply_ids), version=version)
        # A digit reply: vLLM's log-probs are over the ten digits, the actor's over the vocabulary; the coach trains
        # without them (no importance-sampling correction for it; --algo.advantage.is_correction_level is refused).
        action = Action(request.episode_id, COACH_NAME, request.position, ids, reply_ids, prompt_text=text,
                        response_text=reply, truncated=truncated,
                        rollout_logprobs=[] if self.reply == "digit" else logprobs,
                        versions={COACH_NAME: version}, version_end=version_end)
        if train:
            self.judgements.setdefault(request.episode_id, []).append(Judgement(request, verdict, action))
        return verdict

    def rewarded(self, episodes: list, now: int = 0, most: float = float("inf")) -> tuple:
        """(the coach's actions of these episodes' verdicts, each with its reward R; the step's term and judge
        metrics). Those verdicts leave the pending set. An action of the coach more than `most` updates behind
        its version `now` gets no R (stale, counted): the agents drop such verdicts (stale_verdicts), and the
        coach must not train on what they would not."""
        judged = [j for ep in episodes for j in self.judgements.pop(ep.episode_id, [])]
        if self.stratified and judged:
            cut = [r.truncated_at is not None for r in {id(j.request): j.request for j in judged}.values()]
            self.ask = strata_chances(self.reference_fraction, {True: sum(cut), False: len(cut) - sum(cut)})
        metrics = (coach_rewards(judged, episodes, self.terms, self.bands)
                   | judge_metrics(judged, self.price_in, self.price_out))
        stale = 0
        for j in judged:
            version = j.action.versions.get(COACH_NAME)  # None: not recorded
            if version is not None and now - version > most:
                j.action.reward, j.action.stale = None, True
                stale += 1
        metrics["coach/stale_left_out"] = stale
        return [j.action for j in judged], metrics

    def stale_verdicts(self, actions: list, now: int, most: int) -> int:
        """Mark `stale` (left out) every action whose verdict came from this coach more than `most` updates
        behind its version `now`, or from one with fewer than warmup_steps updates
        (--mappa.coach.warmup_steps): agents never train on an old coach's judgement, nor on a new one's that
        its reference has not shaped yet. Returns how many."""
        n = 0
        for a in actions:
            v = None if a.verdict is None else a.verdict.version
            if v is not None and (now - v > most or v < self.warmup_steps):
                a.stale, n = True, n + 1
        return n

    def agreement_stop(self, step: int, metrics: dict):
        """The reason to stop the run, or None: after warmup_steps steps, the step's held-out agreement with
        the reference below min_agreement (--mappa.coach.min_agreement; 0: never): the coach drifted from the
        judge it is anchored to."""
        agreement, least = metrics.get("coach/heldout_agreement"), self.min_agreement
        if least > 0 and step > self.warmup_steps and agreement is not None and agreement < least:
            return (
                f"step {step}: the trained coach's agreement with its reference judge on held-out actions "
                f"fell to {agreement:.3f}, below --mappa.coach.min_agreement {least:g}: its verdicts drifted "
                f"from the reference (collusion with the agents, or a reward it learned to game)"
            )
        return None

    async def probe(self) -> None:
        await self.reference.probe()

    async def aclose(self):
        await self.reference.aclose()


def coach_rewards(judgements: list, episodes: list, terms: tuple, bands: int = 5) -> dict:
    """Set the reward R of each judgement's action, the sum of the enabled terms for a verdict of score s
    (0-10):

        format     +1 for a valid score; for none (then its only term) -3 + d/2, d the share of digits in the
                   reply: 3.5 or more below a valid score's, yet a random-init coach, none of whose replies
                   parse, has a slope toward one. With format off, a reply with no score is left out
                   (R None).
        outcome    1 - 2|s/10 - o|       on the final agent's action, o = its episode's success (0 or 1)
        agreement  w_b (1 - 2|s - s_ref|/10)   where the reference judged the action and it is not held out;
                                         w_b = n / (B n_b): the step's n such verdicts fall in B score bands
                                         (of `bands` across 0-10) by s_ref, n_b in this one's band
        bias       -max(0, g_kτ - ḡ_k)   g_kτ = mean s/10 - success rate over agent k's actions of task type τ
                                         this step, ḡ_k its mean over k's types (two or more): a type scored
                                         higher than its outcomes warrant, against the agent's other types

    outcome and agreement are centered (a non-committal 5 against an outcome earns 0), so that a verdict is
    not paid merely for being one that a term applies to: uncentered, whitening favoured whatever the coach
    said on those actions, and a random-init coach collapsed to one score (benchmarks/README.md). The band
    weights give each of the reference's score bands an equal share of the agreement term: unweighted, a coach
    that always gives the reference's usual score agreed on 99% of actions and collapsed to it (bands=1 turns
    the weights off).

    A term that does not apply to a valid verdict counts at its mean over the ones it applied to this step, so
    that whitened, a verdict stands apart from the others by the terms that judged it alone: counted as 0, the
    verdicts the reference never saw (most) were all pushed one way by the rest's mean, whatever they said. A
    cut-off reply (no score to read) and an action of an episode whose environment failed (no outcome) count
    like any other. Several verdicts of one action (reply digit) are each rewarded against their mean, R -
    mean R + the sum of the terms' means, so that the action's own worth (a term shared by all, as outcome)
    moves none of them. Returns, per term, its mean over the verdicts it applied to, and how many it applied
    to."""
    episode_of = {ep.episode_id: ep for ep in episodes}
    valid = [j for j in judgements if j.verdict.score is not None]
    gap = bias_gaps(valid, episode_of) if "bias" in terms else {}
    band = lambda ref: min(bands - 1, int(ref["score"] / 10 * bands))
    agreed = [band(j.verdict.reference) for j in valid if referenced(j.verdict)]
    weight = {b: len(agreed) / (len(set(agreed)) * agreed.count(b)) for b in set(agreed)}
    applied, parts_of = {t: [] for t in TERMS}, []
    for j in judgements:
        s, ep = j.verdict.score, episode_of[j.request.episode_id]
        if s is None:
            text, j.action.reward = j.action.response_text, None
            if "format" in terms:
                j.action.reward = -3.0 + sum(ch.isdigit() for ch in text) / max(1, len(text)) / 2
                applied["format"].append(j.action.reward)
            continue
        parts = {"format": 1.0}
        if j.request.is_final_agent and not ep.env_error:
            parts["outcome"] = 1.0 - 2 * abs(s / 10 - float(ep.success))
        if referenced(j.verdict):
            ref = j.verdict.reference
            parts["agreement"] = weight[band(ref)] * (1.0 - 2 * abs(s - ref["score"]) / 10)
        if (j.request.agent, j.request.task_type) in gap:
            parts["bias"] = -gap[j.request.agent, j.request.task_type]
        parts = {t: v for t, v in parts.items() if t in terms}
        parts_of.append((j, parts))
        for t, v in parts.items():
            applied[t].append(v)
    mean = {t: sum(v) / len(v) for t, v in applied.items() if v}
    of_action = {}
    for j, parts in parts_of:  # no term judged anything this step: no signal, left out
        j.action.reward = sum(parts.get(t, mean[t]) for t in mean) if mean else None
        of_action.setdefault(id(j.request), []).append(j.action)
    # Several verdicts of one action (reply digit): each against their mean, a baseline of that action's own,
    # moved to where a verdict no term judged sits (the terms' means): a verdict is paid for beating the
    # others.
    for actions in of_action.values():
        if len(actions) > 1 and mean:
            baseline = sum(a.reward for a in actions) / len(actions)
            for a in actions:
                a.reward += sum(mean.values()) - baseline
    out = {f"coach/term_{t}": mean.get(t) for t in TERMS if t in terms}
    out.update({f"coach/term_{t}_n": len(v) for t, v in applied.items() if t in terms})
    return out


def strata_chances(fraction: float, counts: dict) -> dict:
    """{stratum: the chance to ask the reference} that asks about `fraction` of all the actions counted, each
    stratum an equal share where it has that many, a smaller one all of its actions and the rest to the others
    (water-filling): the rare kind of action, where the information is, is judged as often as the usual
    one."""
    budget, out = fraction * sum(counts.values()), {}
    strata = sorted(counts, key=counts.get)
    for i, stratum in enumerate(strata):
        n = counts[stratum]
        out[stratum] = min(1.0, budget / (len(strata) - i) / n) if n else 1.0
        budget -= out[stratum] * n
    return out


def referenced(verdict: Verdict) -> bool:
    """The reference judged this action, and it is not held out: the agreement term applies."""
    return (
        bool(verdict.reference) and verdict.reference["status"] == "ok" and not verdict.reference["held_out"]
    )


def bias_gaps(judgements: list, episode_of: dict) -> dict:
    """{(agent, task type): max(0, g_kτ - ḡ_k)} for agents judged on two or more task types
    (coach_rewards)."""
    cells = {}  # agent -> task type -> (its scores / 10, its episodes' successes)
    for j in judgements:
        scores, successes = cells.setdefault(j.request.agent, {}).setdefault(j.request.task_type, ([], []))
        scores.append(j.verdict.score / 10)
        successes.append(float(episode_of[j.request.episode_id].success))
    out = {}
    for agent, by_type in cells.items():
        if len(by_type) < 2:
            continue
        g = {t: sum(s) / len(s) - sum(o) / len(o) for t, (s, o) in by_type.items()}
        mean = sum(g.values()) / len(g)
        out.update({(agent, t): max(0.0, x - mean) for t, x in g.items()})
    return out


def judge_metrics(judgements: list, price_in: float = 0.0, price_out: float = 0.0) -> dict:
    """The step's verdicts against the reference: agreement on the held-out ones (mean 1 - |s - s_ref|/10, a
    reply with no valid score agreeing 0, each weighted 1/p by the chance p that its action was drawn, so that
    stratified draws still estimate it over all actions; None when none was held out) and the Pearson
    correlation of the scores (None when either is constant: a coach that always gives the reference's usual
    score agrees, and tells nothing), and what the reference was asked and cost. The run's coach cost is the
    reference's (prices per 1M tokens): the coach's own tokens are the cluster's time."""
    refs = list({id(j.request): j.verdict.reference for j in judgements if j.verdict.reference}.values())
    actions = len({id(j.request) for j in judgements})  # an action may have several verdicts (reply digit)
    held = [j for j in judgements if j.verdict.reference and j.verdict.reference["held_out"]
            and j.verdict.reference["status"] == "ok"]
    agree = [
        0.0 if j.verdict.score is None else 1.0 - abs(j.verdict.score - j.verdict.reference["score"]) / 10
        for j in held
    ]
    weight = [1 / j.verdict.reference["p"] for j in held]
    pairs = [(j.verdict.score, j.verdict.reference["score"]) for j in held if j.verdict.score is not None]
    fresh = [r for r in refs if not r["cached"]]
    tokens_in, tokens_out = (sum(r[k] for r in fresh) for k in ("tokens_in", "tokens_out"))
    return {
        "coach/heldout_agreement": sum(a * w for a, w in zip(agree, weight)) / sum(weight) if agree else None,
        "coach/heldout_n": len(held),
        "coach/heldout_correlation": pearson(pairs),
        "coach/reference_requests": len(refs),
        "coach/reference_share": len(refs) / actions if actions else None,
        "coach/parse_error_rate": (
            sum(j.verdict.score is None for j in judgements) / len(judgements) if judgements else None
        ),
        "coach/reference_tokens_in": tokens_in,
        "coach/reference_tokens_out": tokens_out,
        "coach/cost_usd": (tokens_in * price_in + tokens_out * price_out) / 1e6,
    }
