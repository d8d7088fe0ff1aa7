"""The coach: scores one agent action on 0-10 and returns a `Verdict` (see episode.py).

`Coach` is the protocol every backend implements; `build_coach` picks a backend from the `--mappa.coach.*`
flags. Backends: "heuristic" (offline, deterministic, no API key; the demo's default) and "openai" (any
OpenAI-compatible chat-completions server: a hosted API or a local open-weight coach behind vLLM).
"""

import json
import re
from dataclasses import dataclass
from typing import Optional

from openrlhf_mappa.episode import Verdict

COACH_KINDS = ("heuristic", "openai")
PROMPT_FIELDS = (
    "task", "role", "agent", "turn", "task_type", "agent_input", "agent_output", "feedback", "ground_truth"
)


@dataclass
class CoachRequest:
    """Everything the coach sees about one action (the paper's per-action coach context)."""

    episode_id: str
    agent: str
    turn: int
    role: str  # the agent's role description
    task: str  # the problem text
    task_type: str
    agent_input: str
    agent_output: str
    feedback: str  # tool feedback text, "" when no tool ran
    ground_truth: Optional[str] = None  # only where the pipeline decides (e.g. the final agent)
    is_final_agent: bool = False
    runs_code: bool = False  # the agent's actions are executed as code
    truncated_at: Optional[int] = None  # the output was cut off at this token limit (None: it ended by itself)


class Coach:
    """A coach backend. `score` never raises for a failed evaluation: it returns a non-"ok" Verdict, so
    the caller can leave the action out of training instead of inventing a score."""

    name: str = "coach"

    async def score(self, request: CoachRequest) -> Verdict:
        raise NotImplementedError

    async def aclose(self):
        pass


def build_coach(kind: str, *, template: str = None, model: str = None, base_url: str = None,
                cache_path: str = None, **options) -> Coach:
    """A coach backend from the `--mappa.coach.*` flags. `options` go to the OpenAI-compatible backend
    (api_key_env, timeout_s, max_concurrency, max_retries, rpm, structured, format_retries).

    An LLM coach is wrapped in a verdict cache (memory, plus SQLite at `cache_path`), so a rerun or a
    resumed run never pays twice for the same request. The heuristic coach costs nothing and is not cached.
    """
    # Backends are imported here, not at module top: they import `Coach` from this module, and the
    # heuristic path needs no HTTP client at all.
    if kind == "heuristic":
        from openrlhf_mappa.coach.heuristic import HeuristicCoach

        return HeuristicCoach()
    if kind == "openai":
        flags = {"model": model, "base_url": base_url, "template": template}
        missing = [flag for flag, value in flags.items() if not value]
        if missing:
            names = ", ".join(f"--mappa.coach.{flag}" for flag in missing)
            raise ValueError(f"coach kind 'openai' needs {names}")
        from openrlhf_mappa.coach.cache import VerdictCache
        from openrlhf_mappa.coach.openai_compat import OpenAICoach

        return OpenAICoach(model=model, base_url=base_url, template=template, cache=VerdictCache(cache_path), **options)
    raise ValueError(f"unknown coach kind {kind!r}; expected one of {', '.join(COACH_KINDS)}")


def render_prompt(template: str, request: CoachRequest) -> str:
    """Fill a coach prompt template (str.format syntax; literal braces must be doubled: {{ }}).

    An output cut off at the token limit says so at its end, whatever the template: otherwise the coach
    would judge an unfinished answer as if the agent had chosen to stop there."""
    agent_output = request.agent_output
    if request.truncated_at is not None:
        agent_output += f"\n[cut off at the limit of {request.truncated_at} tokens]"
    fields = {
        "task": request.task,
        "role": request.role,
        "agent": request.agent,
        "turn": request.turn,
        "task_type": request.task_type,
        "agent_input": request.agent_input,
        "agent_output": agent_output,
        "feedback": request.feedback or "(none)",
        "ground_truth": request.ground_truth if request.ground_truth is not None else "(not available)",
    }
    try:
        return template.format(**fields)
    except KeyError as e:
        raise ValueError(
            f"coach prompt template names unknown field {{{e.args[0]}}}; allowed fields: {', '.join(PROMPT_FIELDS)}"
        ) from None
    except IndexError:
        raise ValueError(
            f"coach prompt template has a positional field {{}}; use named ones: {', '.join(PROMPT_FIELDS)}"
        ) from None


# Score formats, most explicit kind first. The first kind found in the reply decides; within a kind the
# last match wins (coaches reason first and conclude at the end). A stated score outside [0, 10] is a
# parse error, never a reason to go looking for some other number (the authors' "first number in range").
_NUM = r"([-+]?\d+(?:\.\d+)?)"
_SCORE_FORMATS = (
    # PROCESS_SCORE: 7 | SCORE = 7.5 | **Score:** 7 | "score": 7 | score of 7/10 | the score is 7
    re.compile(r"""\b(?:process[_ ])?score\b["']?\**\s*(?:[:=]|\bis\b|\bof\b)?\s*\**\s*""" + _NUM, re.IGNORECASE),
    re.compile(r"(?<![\d.])" + _NUM + r"\s*(?:/|\bout\s+of\b)\s*10(?!\.?\d)", re.IGNORECASE),  # 7/10, 7 out of 10
    re.compile(r"\*\*\s*" + _NUM + r"\s*\*\*"),  # **7**
    re.compile(r"^\W*" + _NUM + r"\W*$"),  # a reply that is just the number
)


def parse_score(text: str) -> Optional[float]:
    """The coach's score in [0, 10], from a JSON object {"score": n, ...} or from free text; else None."""
    text = (text or "").strip()
    if text.startswith("{") or text.startswith("```"):
        try:
            reply = json.loads(text.strip("`").removeprefix("json").strip())
        except json.JSONDecodeError:
            reply = None
        if isinstance(reply, dict) and "score" in reply:
            score = reply["score"]
            ok = isinstance(score, (int, float)) and not isinstance(score, bool)
            return float(score) if ok and 0.0 <= score <= 10.0 else None
    for pattern in _SCORE_FORMATS:
        matches = pattern.findall(text)
        if matches:
            score = float(matches[-1])
            return score if 0.0 <= score <= 10.0 else None
    return None
