"""What the coach did in a step: verdict statuses, cost accounting, and the live coach-bias audit.

The bias audit exists because of the paper's own finding: its coach favoured regression over classification
actions, and the agents exploited the gap. So score means per agent x task type are logged every step, and a
gap above a threshold over the last few steps is a warning in the log and in the metrics."""

import logging
import math
import statistics
from collections import Counter, deque
from typing import Optional

from openrlhf_mappa.episode import VERDICT_STATUSES

logger = logging.getLogger(__name__)
FAILED_STATUSES = ("parse_error", "api_error", "timeout")
# Fewer scores than this for a task type in the window make its mean too noisy to call a bias.
MIN_SCORES_FOR_GAP = 8


def pearson(pairs: list) -> Optional[float]:
    """Pearson correlation of (x, y) pairs, or None when it is undefined (fewer than 2 pairs, or a constant
    side)."""
    try:
        return statistics.correlation(*zip(*pairs)) if len(pairs) > 1 else None
    except statistics.StatisticsError:
        return None


class CoachFailure(RuntimeError):
    """Too many of a step's coach verdicts failed: training on what is left would be training on noise."""


def check_failures(episodes: list, metrics: dict, max_fraction: float):
    """Raise CoachFailure when more than `max_fraction` of the step's verdicts failed (per
    coach_step_metrics)."""
    if metrics["coach/failure_fraction"] <= max_fraction:
        return
    failed = [
        a.verdict for ep in episodes for a in ep.actions if a.verdict and a.verdict.status in FAILED_STATUSES
    ]
    counts = {
        k.removeprefix("coach/verdicts_"): n
        for k, n in metrics.items()
        if k.startswith("coach/verdicts_") and n
    }
    raise CoachFailure(
        f"{metrics['coach/failure_fraction']:.0%} of the coach's verdicts failed (more than "
        f"--mappa.coach.max_failure_fraction {max_fraction}); verdicts by status: {counts}. First failure: "
        f"{failed[0].rationale[:300]!r}."
    )


def coach_calls(episodes: list) -> list:
    """One record (Verdict or Review) per request to the coach: per-action verdicts and hindsight reviews.
    Verdicts derived from a review or combined from two are not requests: their cost is their parts'."""
    calls = []
    for ep in episodes:
        for a in ep.actions:
            own = a.verdict if a.verdict and a.verdict.source == "per_action" else None
            asked = a.verdict_parts.get("per_action") or own
            calls += [asked] if asked is not None else []
        calls += [ep.review] if ep.review is not None else []
    return calls


def coach_step_metrics(episodes: list, price_in: float = 0.0, price_out: float = 0.0) -> dict:
    """Verdict counts per status, the failed fraction, and the requests' cost (prices in USD per 1M tokens).
    Verdicts count what trains; tokens, latency and cost count fresh (uncached) calls (coach_calls). A
    `skipped` verdict (no coach was asked: evaluation, the outcome baseline) is neither a failure nor a
    call."""
    statuses = Counter(a.verdict.status for ep in episodes for a in ep.actions if a.verdict is not None)
    m = {f"coach/verdicts_{s}": statuses[s] for s in VERDICT_STATUSES}
    asked = statuses.total() - statuses["skipped"]
    failed = sum(statuses[s] for s in FAILED_STATUSES)
    m["coach/failure_fraction"] = failed / asked if asked else 0.0
    calls = [c for c in coach_calls(episodes) if c.status != "skipped"]
    reviews = Counter(ep.review.status for ep in episodes if ep.review is not None)
    m["coach/requests"] = len(calls)
    if reviews:  # modes hindsight and both
        m.update({f"coach/reviews_{s}": reviews[s] for s in VERDICT_STATUSES if s != "skipped"})
    parts = [a.verdict_parts for ep in episodes for a in ep.actions if a.verdict_parts]
    if parts:  # mode both: actions whose score came from one of the two verdicts only (coach.combine)
        m["coach/both_one_source"] = sum(
            (p["per_action"].status == "ok") != (p["hindsight"].status == "ok") for p in parts
        )
    fresh = [c for c in calls if not c.cached]
    m["coach/cache_hit_rate"] = (len(calls) - len(fresh)) / len(calls) if calls else 0.0
    m.update(
        {f"coach/{k}": sum(getattr(c, k) for c in fresh) for k in ("tokens_in", "tokens_out", "retries")}
    )
    latencies = sorted(c.latency_s for c in fresh)
    for q in (50, 90, 99):
        # Nearest-rank percentile: an observed latency, not an interpolation between two.
        m[f"coach/latency_p{q}"] = latencies[math.ceil(q / 100 * len(latencies)) - 1] if latencies else None
    if price_in or price_out:
        m["coach/cost_usd"] = (m["coach/tokens_in"] * price_in + m["coach/tokens_out"] * price_out) / 1e6
    return m


class BiasAudit:
    """Coach score statistics per agent x task type, each step and over a window of recent steps."""

    def __init__(self, threshold: float = 1.0, window: int = 5):
        self.threshold = threshold
        self.window = deque(maxlen=window)  # per step: ({(agent, task_type): [scores]}, final_pairs)

    def update(self, episodes: list) -> dict:
        step, final_pairs = {}, []  # {(agent, task_type): [scores]}, [(final agent's score, episode success)]
        for ep in episodes:
            for a in ep.actions:
                if a.verdict is None or a.verdict.score is None:
                    continue
                step.setdefault((a.agent, ep.task_type or "-"), []).append(a.verdict.score)
            finals = [a.verdict.score for a in ep.actions
                      if a.coach_request.get("is_final_agent") and a.verdict and a.verdict.score is not None]
            if finals:
                final_pairs.append((finals[-1], float(ep.success)))
        self.window.append((step, final_pairs))

        m = {}
        for (agent, task_type), scores in sorted(step.items()):
            p = f"coach_bias/{agent}/{task_type}/"
            m.update({p + "mean": statistics.fmean(scores), p + "std": statistics.pstdev(scores),
                      p + "n": len(scores)})

        # The agreement of the final agent's score with the outcome: a coach that pays the last agent the
        # same for solved and failed episodes teaches nothing about the outcome.
        m["coach_bias/final_score_outcome_corr"] = pearson(final_pairs)
        for label, success in (("success", 1.0), ("failure", 0.0)):
            scores = [s for s, ok in final_pairs if ok == success]
            m[f"coach_bias/final_score_on_{label}"] = statistics.fmean(scores) if scores else None

        pooled = self.pooled()
        worst = (0.0, None)
        for agent in sorted({agent for agent, _ in pooled}):
            means = {t: statistics.fmean(s) for (a, t), s in pooled.items()
                     if a == agent and len(s) >= MIN_SCORES_FOR_GAP}
            if len(means) < 2:
                continue
            high, low = max(means, key=means.get), min(means, key=means.get)
            gap = means[high] - means[low]
            m[f"coach_bias/{agent}/type_gap"] = gap
            if gap > worst[0]:
                worst = (gap, f"{agent}'s scores on {high} tasks average {gap:.2f} points above {low} tasks")
        m["coach_bias/max_type_gap"] = worst[0]
        m["coach_bias/warning"] = int(worst[0] > self.threshold)
        if m["coach_bias/warning"]:
            logger.warning(
                "coach bias: %s over the last %d steps (threshold %.2f). Agents learn to exploit such a "
                "gap; consider --mappa.coach.standardize_task_type or a different coach prompt.",
                worst[1],
                len(self.window),
                self.threshold,
            )
        return m

    def pooled(self) -> dict:
        """{(agent, task_type): [scores]} over the window's steps."""
        pooled = {}
        for step, _ in self.window:
            for key, scores in step.items():
                pooled.setdefault(key, []).extend(scores)
        return pooled

    def prompt_text(self) -> str:
        """The window's figures for the coach's own prompt (--mappa.coach.show_bias). Only measured figures:
        where one is undefined (no scored step yet), the text says so instead."""
        pooled = self.pooled()
        if not pooled:
            return (
                "Your recent scoring in this run: no figures yet (none of your scores in this run has been "
                "tallied so far)."
            )
        steps, n = len(self.window), sum(map(len, pooled.values()))
        lines = [
            f"Your recent scoring in this run (the last {steps} training step{'s' * (steps > 1)}, {n} scored "
            "actions). Agents learn to exploit a coach's systematic leanings, such as a higher average for "
            "one task type or one agent that the work does not justify. Check these figures for such a "
            "leaning and keep your scale the same for every agent and task type; still judge this action on "
            "its own merits.",
            "Your mean score per agent and task type:",
        ]
        for (agent, task_type), scores in sorted(pooled.items()):
            lines.append(f"- {agent}, {task_type}: {statistics.fmean(scores):.2f} (n={len(scores)})")
        pairs = [p for _, final_pairs in self.window for p in final_pairs]
        if not pairs:
            lines.append(
                "Agreement of your scores with outcomes: not measurable yet (no final agent's action was "
                "scored)."
            )
            return "\n".join(lines)
        r = pearson(pairs)
        agree = (f"Pearson correlation {r:.2f}" if r is not None
                 else "Pearson correlation undefined (one outcome only, or constant scores)")
        means = []
        for label, success in (("solved", 1.0), ("failed", 0.0)):
            scores = [score for score, ok in pairs if ok == success]
            means.append(
                f"mean {statistics.fmean(scores):.2f} on {label} episodes (n={len(scores)})"
                if scores
                else f"no {label} episode"
            )
        lines.append(
            f"Agreement of your scores with outcomes (the final agent's score vs. the episode's success, "
            f"{len(pairs)} episodes): {agree}; {'; '.join(means)}."
        )
        return "\n".join(lines)
