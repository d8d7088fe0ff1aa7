"""The coach: scores agent actions on 0-10 as `Verdict`s (episode.py), per action, in hindsight per episode, or
both (`--mappa.coach.mode`, judge_episode). Backends: "heuristic" (offline, deterministic, the demo's default),
"openai" (any OpenAI-compatible chat-completions server, hosted or a local vLLM) and "trained" (a coach model in
the team's cluster that trains with the agents, anchored to one of the others: coach/trained.py)."""

from openrlhf_mappa.coach.base import (  # noqa: F401 (the package's API)
    COACH_MODES, DEFAULT_REVIEW_TEMPLATE, Coach, CoachRequest, combine, judge_episode, parse_answer_correct,
    parse_review, parse_score, render_prompt, render_review_prompt,
)
from openrlhf_mappa.topology import DEFAULT_SCORE_KEY, PROMPT_FIELDS, REVIEW_FIELDS, SCORE_KEY_RE  # noqa: F401

COACH_KINDS = ("heuristic", "openai", "trained")


def build_coach(kind: str, *, template: str = None, model: str = None, base_url: str = None,
                cache_path: str = None, trained: dict = None, **options) -> Coach:
    """A coach backend from the `--mappa.coach.*` flags; `options` go to OpenAICoach. `template` (the per-action
    prompt) may be None for a hindsight-only coach. An LLM coach gets a verdict cache (memory, plus SQLite at
    `cache_path`) so a rerun never pays twice; backends are imported lazily (the heuristic needs no HTTP). A trained
    coach's `trained`: its reference judge's kind and model, and TrainedCoach's own settings."""
    if kind == "heuristic":
        from openrlhf_mappa.coach.heuristic import HeuristicCoach

        return HeuristicCoach()
    if kind == "openai":
        missing = [flag for flag, value in {"model": model, "base_url": base_url}.items() if not value]
        if missing:
            raise ValueError(f"coach kind 'openai' needs {', '.join(f'--mappa.coach.{flag}' for flag in missing)}")
        from openrlhf_mappa.coach.cache import VerdictCache
        from openrlhf_mappa.coach.openai_compat import OpenAICoach

        return OpenAICoach(model=model, base_url=base_url, template=template, cache=VerdictCache(cache_path), **options)
    if kind == "trained":
        from openrlhf_mappa.coach.trained import TrainedCoach

        t = dict(trained)
        reference = build_coach(t.pop("reference_kind"), template=template, model=t.pop("reference_model"),
                                base_url=base_url, cache_path=cache_path, **options)
        return TrainedCoach(template, options.get("score_key", DEFAULT_SCORE_KEY), reference, **t)
    raise ValueError(f"unknown coach kind {kind!r}; expected one of {', '.join(COACH_KINDS)}")
