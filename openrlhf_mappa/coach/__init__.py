"""The coach: scores agent actions on 0-10 as `Verdict`s (episode.py), per action, in hindsight per episode,
or both (`--mappa.coach.mode`, judge_episode). Backends: "heuristic" (offline, deterministic, the demo's
default), "openai" (any OpenAI-compatible chat-completions server, hosted or a local vLLM) and "trained" (a
coach model in the team's cluster that trains with the agents, anchored to one of the others:
coach/trained.py)."""

from types import SimpleNamespace

from openrlhf_mappa.coach.base import (  # noqa: F401 (the package's API)
    DEFAULT_REVIEW_TEMPLATE, Coach, CoachRequest, combine, judge_episode, parse_answer_correct, parse_review,
    parse_score, render_prompt, render_review_prompt,
)
from openrlhf_mappa.topology import (  # noqa: F401
    DEFAULT_SCORE_KEY, PROMPT_FIELDS, REVIEW_FIELDS, SCORE_KEY_RE,
)


def build_coach(c, *, template: str = None, score_key: str = DEFAULT_SCORE_KEY, review_template: str = None,
                cache_path: str = None, seed: int = 0) -> Coach:
    """A coach backend from the `--mappa.coach.*` flags' namespace `c` (args.mappa.coach; argparse checked its
    choices) and the topology's `template` (the per-action prompt; None for a hindsight-only coach),
    `score_key` and `review_template`. An LLM coach gets a verdict cache (memory, plus SQLite at `cache_path`)
    so a rerun never pays twice; backends are imported lazily (the heuristic needs no HTTP). A trained coach
    also takes the run's `seed`."""
    if c.kind == "heuristic":
        from openrlhf_mappa.coach.heuristic import HeuristicCoach

        return HeuristicCoach()
    if c.kind == "openai":
        missing = [flag for flag in ("model", "base_url") if not getattr(c, flag)]
        if missing:
            raise ValueError(
                f"coach kind 'openai' needs {', '.join(f'--mappa.coach.{flag}' for flag in missing)}"
            )
        from openrlhf_mappa.coach.cache import VerdictCache
        from openrlhf_mappa.coach.openai_compat import OpenAICoach

        return OpenAICoach(c.model, c.base_url, template, api_key_env=c.api_key_env, timeout_s=c.timeout,
                           max_concurrency=c.max_concurrency, max_retries=c.max_retries, rpm=c.rpm,
                           structured=c.structured, format_retries=c.format_retries, max_tokens=c.max_tokens,
                           score_key=score_key, cache=VerdictCache(cache_path),
                           review_template=review_template)
    from openrlhf_mappa.coach.trained import TrainedCoach

    # Its reference judge: the same flags, of the reference's kind and model.
    judge = SimpleNamespace(**{**vars(c), "kind": c.reference_kind, "model": c.reference_model})
    reference = build_coach(judge, template=template, score_key=score_key, review_template=review_template,
                            cache_path=cache_path)
    return TrainedCoach(template, score_key, reference, c.reference_fraction, c.held_out_fraction,
                        tuple(c.terms.split(",")), agreement_bands=c.agreement_bands, reply=c.reply,
                        stratified=c.reference_draw == "stratified", pay_reference=c.pay_reference, seed=seed,
                        warmup_steps=c.warmup_steps, min_agreement=c.min_agreement, price_in=c.price_in,
                        price_out=c.price_out)
