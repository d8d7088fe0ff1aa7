"""The coach: scores one agent action on 0-10 and returns a `Verdict` (see episode.py).

`Coach` is the protocol every backend implements; `build_coach` picks a backend from the `--mappa.coach.*`
flags. Backends: "heuristic" (offline, deterministic, no API key; the demo's default) and "openai" (any
OpenAI-compatible chat-completions server: a hosted API or a local open-weight coach behind vLLM).
"""

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


class Coach:
    """A coach backend. `score` never raises for a failed evaluation: it returns a non-"ok" Verdict, so
    the caller can leave the action out of training instead of inventing a score."""

    name: str = "coach"

    async def score(self, request: CoachRequest) -> Verdict:
        raise NotImplementedError

    async def aclose(self):
        pass


def build_coach(
    kind: str,
    *,
    template: str = None,
    model: str = None,
    base_url: str = None,
    api_key_env: str = "OPENAI_API_KEY",
    timeout_s: float = 60.0,
    max_concurrency: int = 32,
) -> Coach:
    # Backends are imported here, not at module top: they import `Coach` from this module, and the
    # heuristic path must not need the `openai` package at all.
    if kind == "heuristic":
        from openrlhf_mappa.coach.heuristic import HeuristicCoach

        return HeuristicCoach()
    if kind == "openai":
        flags = {"model": model, "base_url": base_url, "template": template}
        missing = [flag for flag, value in flags.items() if not value]
        if missing:
            names = ", ".join(f"--mappa.coach.{flag}" for flag in missing)
            raise ValueError(f"coach kind 'openai' needs {names}")
        from openrlhf_mappa.coach.openai_compat import OpenAICoach

        return OpenAICoach(
            model=model,
            base_url=base_url,
            template=template,
            api_key_env=api_key_env,
            timeout_s=timeout_s,
            max_concurrency=max_concurrency,
        )
    raise ValueError(f"unknown coach kind {kind!r}; expected one of {', '.join(COACH_KINDS)}")


def render_prompt(template: str, request: CoachRequest) -> str:
    """Fill a coach prompt template (str.format syntax; literal braces must be doubled: {{ }})."""
    fields = {
        "task": request.task,
        "role": request.role,
        "agent": request.agent,
        "turn": request.turn,
        "task_type": request.task_type,
        "agent_input": request.agent_input,
        "agent_output": request.agent_output,
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


# The last "SCORE: x" / "PROCESS_SCORE: x" wins: coaches usually reason first and conclude at the end.
# The sign is captured so that "SCORE: -1" is rejected as out of range instead of read as 1.
_SCORE_RE = re.compile(r"\b(?:PROCESS_)?SCORE\s*[:=]\s*\**\s*([-+]?\d+(?:\.\d+)?)", re.IGNORECASE)


def parse_score(text: str) -> Optional[float]:
    """Return the score in [0, 10] stated as `SCORE: <n>` (or `PROCESS_SCORE: <n>`), else None."""
    matches = _SCORE_RE.findall(text or "")
    if not matches:
        return None
    score = float(matches[-1])
    return score if 0.0 <= score <= 10.0 else None
