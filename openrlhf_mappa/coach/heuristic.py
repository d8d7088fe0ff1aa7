"""An offline, deterministic stand-in for an LLM coach, so the demo and the tests run without an API key."""

import re
from fractions import Fraction
from typing import Optional

from openrlhf_mappa.coach import Coach, CoachRequest
from openrlhf_mappa.episode import Verdict

# Python's own error shapes, plus the markers ToolFeedback.as_text() writes for a timeout or a non-zero exit.
# "Error" alone is not enough: stdout like "mean squared error: 0.3" is a clean run.
_TOOL_ERROR_RE = re.compile(
    r"Traceback \(most recent call last\)|\b\w*(?:Error|Exception)\b:|\[timed out\]|\[exit code"
)
_CODE_BLOCK_RE = re.compile(r"```python\b", re.IGNORECASE)
_NUMBER_RE = re.compile(r"\d")


def _last_boxed(text: str) -> Optional[str]:
    """The content of the last \\boxed{...}, nested braces included; None when absent or unbalanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    begin = start + len("\\boxed{")
    for i in range(begin - 1, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
    return None


def _normalize(answer: str):
    """Light normalization: a number becomes a Fraction (18.0 == 18, 1/2 == 0.5), anything else a bare string."""
    s = re.sub(r"\s+|\$|\\[,!;]", "", answer)
    s = re.sub(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", s)
    s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s)  # thousands separators: 1,000 -> 1000
    s = s.rstrip(".")
    try:
        parts = s.replace("(", "").replace(")", "").split("/")
        if len(parts) == 1:
            return Fraction(parts[0])
        if len(parts) == 2:
            return Fraction(parts[0]) / Fraction(parts[1])
    except (ValueError, ZeroDivisionError):
        pass
    return s


class HeuristicCoach(Coach):
    """Rule-based coach: no LLM, no network, same request -> same verdict. The first rule that applies fires:

    1. tool feedback present (code ran): an error (Traceback, `XxxError:`, timeout, non-zero exit) -> 2;
       ran cleanly and printed something -> 7; ran cleanly with no output -> 5.
    2. ground truth given: the last \\boxed{...} of the output equals it after normalization -> 10;
       a boxed answer that differs -> 2; no boxed answer -> 0.
    3. the role asks for code ("python" or "code" in the role text) but the output has no ```python block -> 1.
    4. otherwise reasonableness: empty output -> 0; else 3, +1 if it mentions any number, + up to 2 for
       showing work (0.01 per word, capped at 200 words) -> a score in [3, 6] that varies with the output.
    """

    name = "heuristic"

    async def score(self, request: CoachRequest) -> Verdict:
        # No latency is recorded (it stays 0.0): the verdict is a pure function of the request.
        score, why = self._rule(request)
        return Verdict(score=score, status="ok", rationale=f"heuristic coach: {why}", coach=self.name)

    def _rule(self, request: CoachRequest):
        output = request.agent_output or ""
        feedback = request.feedback or ""
        if feedback.strip():
            if _TOOL_ERROR_RE.search(feedback):
                return 2.0, "tool rule: the code failed (error, timeout or non-zero exit)"
            if feedback.strip() == "[no output]":
                return 5.0, "tool rule: the code ran without error but printed nothing"
            return 7.0, "tool rule: the code ran without error"
        if request.ground_truth is not None:
            boxed = _last_boxed(output)
            if boxed is None:
                return 0.0, "answer rule: no \\boxed{} answer"
            if _normalize(boxed) == _normalize(request.ground_truth):
                return 10.0, f"answer rule: \\boxed{{{boxed}}} matches the ground truth"
            return 2.0, f"answer rule: \\boxed{{{boxed}}} differs from the ground truth"
        role = (request.role or "").lower()
        if ("python" in role or "code" in role) and not _CODE_BLOCK_RE.search(output):
            return 1.0, "code rule: the role asks for code but there is no ```python block"
        if not output.strip():
            return 0.0, "reasonableness rule: empty output"
        has_number = bool(_NUMBER_RE.search(output))
        work = min(2.0, 0.01 * len(output.split()))
        score = round(3.0 + has_number + work, 2)
        return score, f"reasonableness rule: non-empty, mentions a number: {has_number}, work credit {work:.2f}"
