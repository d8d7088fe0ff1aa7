"""The coach: scores one agent action on 0-10 and returns a `Verdict` (see episode.py).

`Coach` is the protocol every backend implements; `build_coach` picks a backend from the `--mappa.coach.*`
flags. Backends: "heuristic" (offline, deterministic, no API key; the demo's default) and "openai" (any
OpenAI-compatible chat-completions server: a hosted API or a local open-weight coach behind vLLM).

`--mappa.coach.mode` says when the coach judges (judge_episode): "per_action" (the paper: one request per
action, while the episode runs), "hindsight" (one request per episode once its outcome is known: the whole
trajectory, a score for every action and the action held responsible; a `Review`), or "both" (the two
combined by `combine`).
"""

from openrlhf_mappa.coach.base import (  # noqa: F401 (the package's API)
    COACH_MODES, DEFAULT_REVIEW_TEMPLATE, DEFAULT_SCORE_KEY, PROMPT_FIELDS, REVIEW_FIELDS, SCORE_KEY_RE, Coach,
    CoachRequest, combine, judge_episode, parse_review, parse_score, render_prompt, render_review_prompt,
)

COACH_KINDS = ("heuristic", "openai")


def build_coach(kind: str, *, template: str = None, model: str = None, base_url: str = None,
                cache_path: str = None, **options) -> Coach:
    """A coach backend from the `--mappa.coach.*` flags. `options` go to the OpenAI-compatible backend
    (api_key_env, timeout_s, max_concurrency, max_retries, rpm, structured, format_retries, max_tokens,
    score_key: the line `<score_key>: <n>` a text reply states its score on, see parse_score;
    review_template: the hindsight prompt, default DEFAULT_REVIEW_TEMPLATE).

    `template` is the per-action prompt: None for an LLM coach that only reviews whole episodes (mode
    hindsight); where one is needed, the launch requires it (Topology.check_coach_template).

    An LLM coach is wrapped in a verdict cache (memory, plus SQLite at `cache_path`), so a rerun or a
    resumed run never pays twice for the same request. The heuristic coach costs nothing and is not cached.
    """
    # Backends are imported here, not at module top: the heuristic path needs no HTTP client at all.
    if kind == "heuristic":
        from openrlhf_mappa.coach.heuristic import HeuristicCoach

        return HeuristicCoach()
    if kind == "openai":
        flags = {"model": model, "base_url": base_url}
        missing = [flag for flag, value in flags.items() if not value]
        if missing:
            names = ", ".join(f"--mappa.coach.{flag}" for flag in missing)
            raise ValueError(f"coach kind 'openai' needs {names}")
        from openrlhf_mappa.coach.cache import VerdictCache
        from openrlhf_mappa.coach.openai_compat import OpenAICoach

        return OpenAICoach(model=model, base_url=base_url, template=template, cache=VerdictCache(cache_path), **options)
    raise ValueError(f"unknown coach kind {kind!r}; expected one of {', '.join(COACH_KINDS)}")
