"""An offline, deterministic stand-in for an LLM coach, so the demo and the tests run without an API key."""

import re

from openrlhf_mappa.coach.base import Coach, CoachRequest
from openrlhf_mappa.episode import Review, Verdict

# Python's error shapes and ToolFeedback.as_text()'s timeout and exit markers; "Error" alone is not enough:
# stdout like "mean squared error: 0.3" is a clean run.
_TOOL_ERROR_RE = re.compile(r"Traceback \(most recent call last\)|\b\w*(?:Error|Exception)\b:|\[timed out\]"
                            r"|\[exit code")
_CODE_BLOCK_RE = re.compile(r"```python\b", re.IGNORECASE)
_NUMBER_RE = re.compile(r"\d")


class HeuristicCoach(Coach):
    """Rule-based coach: no LLM, no network, same request -> same verdict. The first rule that applies fires:

    0. the environment's grade of the action (`MultiAgentEnv.judge`, the request's `env_grade`): MathChat's
       answer rule, DSBench's file contract, the relay's reply rule (see those environments).
    1. tool feedback: an error (Traceback, `XxxError:`, timeout, non-zero exit) -> 2; clean with output -> 7,
       clean without output -> 5.
    2. a code agent's output has no ```python block -> 1.
    3. otherwise: empty -> 0; else 3, +1 if it mentions a number, + 0.01 per word (at most 2).
    Every score below 10 adds up to 0.9 for readable text (the share of printable ASCII), so that even an
    untrained tiny model's outputs differ and REINFORCE++ has a signal. The ground truth is never read: it is
    text for an LLM coach, and the environment grades with the data behind it.
    """

    name = "heuristic"

    async def score(self, request: CoachRequest) -> Verdict:
        score, why, _ = self.judge(request)
        return Verdict(score=score, status="ok", rationale=f"heuristic coach: {why}", coach=self.name)

    async def review(self, requests: list, outcome: dict) -> Review:
        """Hindsight: every action scored by the rules above; held responsible: on a failed episode the first
        action that broke its own goal (a rule marked it failed), else the last action, as on a solved one."""
        judged = list(map(self.judge, requests))
        broke = [i for i, (_, _, failed) in enumerate(judged) if failed]
        last = len(requests) - 1
        if outcome.get("success"):
            responsible, why = last, "the episode succeeded; the last action delivered it"
        elif broke:
            responsible, why = broke[0], f"the first action that broke its own goal: {judged[broke[0]][1]}"
        else:
            responsible, why = last, "no action broke its own goal; the last one gave the failed result"
        return Review([s for s, _, _ in judged], responsible, "ok", f"heuristic coach: {why}", self.name)

    def judge(self, request: CoachRequest):
        """(score, why, broke its goal) of one action."""
        score, why, broke = request.env_grade or self._rule(request)
        output = request.agent_output or ""
        if score < 10.0 and output:
            readable = sum(" " <= ch <= "~" or ch in "\n\t" for ch in output) / len(output)
            score, why = round(score + 0.9 * readable, 3), f"{why}; readability {readable:.2f}"
        return score, why, broke

    def _rule(self, request: CoachRequest):
        output = request.agent_output or ""
        feedback = request.feedback or ""
        if feedback.strip():
            if _TOOL_ERROR_RE.search(feedback):
                return 2.0, "tool rule: the code failed (error, timeout or non-zero exit)", True
            if feedback.strip() == "[no output]":
                return 5.0, "tool rule: the code ran without error but printed nothing", False
            return 7.0, "tool rule: the code ran without error", False
        if request.runs_code and not _CODE_BLOCK_RE.search(output):
            return 1.0, "code rule: a code agent wrote no ```python block", True
        if not output.strip():
            return 0.0, "reasonableness rule: empty output", True
        has_number = bool(_NUMBER_RE.search(output))
        work = min(2.0, 0.01 * len(output.split()))
        why = f"reasonableness rule: mentions a number: {has_number}, work credit {work:.2f}"
        return 3.0 + has_number + work, why, False
