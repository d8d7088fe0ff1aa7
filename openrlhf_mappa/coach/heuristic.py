"""An offline, deterministic stand-in for an LLM coach, so the demo and the tests run without an API key."""

import re

from openrlhf_mappa.coach.base import Coach, CoachRequest
from openrlhf_mappa.envs.mathchat import extract_boxed, grade
from openrlhf_mappa.episode import Review, Verdict

# Python's error shapes and ToolFeedback.as_text()'s timeout and exit markers; "Error" alone is not enough:
# stdout like "mean squared error: 0.3" is a clean run.
_TOOL_ERROR_RE = re.compile(r"Traceback \(most recent call last\)|\b\w*(?:Error|Exception)\b:|\[timed out\]"
                            r"|\[exit code")
_CODE_BLOCK_RE = re.compile(r"```python\b", re.IGNORECASE)
_NUMBER_RE = re.compile(r"\d")
# The workspace check DSBenchEnv.coach_ground_truth writes.
_DSBENCH_RE = re.compile(r"^Missing inputs[^:]*: (.*)\nMissing outputs[^:]*: (.*)$", re.MULTILINE)
_SUBMISSION_RE = re.compile(r"^Submission check: (valid|invalid).*?(?:relative score ([\d.]+))?$", re.MULTILINE)
# Per-action goals a pipeline can check mechanically, given as the ground truth (rule 2).
PATTERN_PREFIX = "Required pattern: "
REPLY_PREFIX = "Required reply: "


class HeuristicCoach(Coach):
    """Rule-based coach: no LLM, no network, same request -> same verdict. The first rule that applies fires:

    0. DSBench contract (DSBenchEnv's workspace check as ground truth): an earlier agent's file missing too
       -> 5 (not this agent's fault); its own files missing -> 1 after an error or without code, 3 after a
       clean run; an invalid submission -> 3; files present after an error -> 5; else 7, + 2 x the relative
       score (capped at 1) of a valid submission. So a missing artifact costs the agent that had to make it.
    1. tool feedback: an error (Traceback, `XxxError:`, timeout, non-zero exit) -> 2; clean with output -> 7,
       clean without output -> 5.
    2. ground truth "Required pattern: <regex>" -> 10 if the output contains a match, else 0; "Required reply:
       <regex>" -> 10 for a whole-reply match that ended on its own, 0 if cut off, else 5 (+2 if it contains
       a match): an untrained agent first learns to stop (paying content first would crowd out the rare end
       token), then to say the right thing; any other ground truth: the last \\boxed{...} equals it (`grade`)
       -> 10, differs -> 2, none -> 0.
    3. a code agent's output has no ```python block -> 1.
    4. otherwise: empty -> 0; else 3, +1 if it mentions a number, + 0.01 per word (at most 2).
    Every score below 10 adds up to 0.9 for readable text (the share of printable ASCII), so that even an
    untrained tiny model's outputs differ and REINFORCE++ has a signal.
    """

    name = "heuristic"

    async def score(self, request: CoachRequest) -> Verdict:
        score, why, _ = self.judge(request)
        return Verdict(score=score, status="ok", rationale=f"heuristic coach: {why}", coach=self.name)

    async def review(self, requests: list, outcome: dict) -> Review:
        """Hindsight: every action scored by the rules above; held responsible: on a failed episode the first
        action that broke its own goal (a rule marked it failed), else the last action, as on a solved one."""
        judged = [self.judge(r) for r in requests]
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
        score, why, broke = self._rule(request)
        output = request.agent_output or ""
        if score < 10.0 and output:
            readable = sum(" " <= ch <= "~" or ch in "\n\t" for ch in output) / len(output)
            score, why = round(score + 0.9 * readable, 3), f"{why}; readability {readable:.2f}"
        return score, why, broke

    def _rule(self, request: CoachRequest):
        output = request.agent_output or ""
        feedback = request.feedback or ""
        contract = _DSBENCH_RE.search(request.ground_truth or "")
        if contract:
            return self._dsbench_rule(contract, feedback, request.ground_truth)
        if feedback.strip():
            if _TOOL_ERROR_RE.search(feedback):
                return 2.0, "tool rule: the code failed (error, timeout or non-zero exit)", True
            if feedback.strip() == "[no output]":
                return 5.0, "tool rule: the code ran without error but printed nothing", False
            return 7.0, "tool rule: the code ran without error", False
        if request.ground_truth is not None:
            if request.ground_truth.startswith(PATTERN_PREFIX):
                pattern = request.ground_truth[len(PATTERN_PREFIX) :]
                if re.search(pattern, output):
                    return 10.0, f"pattern rule: the output matches {pattern!r}", False
                return 0.0, f"pattern rule: the output does not match {pattern!r}", True
            if request.ground_truth.startswith(REPLY_PREFIX):
                pattern = request.ground_truth[len(REPLY_PREFIX) :]
                ended = request.truncated_at is None
                if ended and re.fullmatch(pattern, output):
                    return 10.0, f"reply rule: the reply is {pattern!r} and ended on its own", False
                if not ended:
                    return 0.0, f"reply rule: cut off at the token limit ({request.truncated_at} tokens)", True
                found = bool(re.search(pattern, output))
                why = f"reply rule: ended on its own but is not {pattern!r}; contains it: {found}"
                return 5.0 + 2.0 * found, why, True
            boxed = extract_boxed(output)
            if boxed is None:
                return 0.0, "answer rule: no \\boxed{} answer", True
            if grade(boxed, request.ground_truth):
                return 10.0, f"answer rule: \\boxed{{{boxed}}} matches the ground truth", False
            return 2.0, f"answer rule: \\boxed{{{boxed}}} differs from the ground truth", True
        if request.runs_code and not _CODE_BLOCK_RE.search(output):
            return 1.0, "code rule: a code agent wrote no ```python block", True
        if not output.strip():
            return 0.0, "reasonableness rule: empty output", True
        has_number = bool(_NUMBER_RE.search(output))
        work = min(2.0, 0.01 * len(output.split()))
        why = f"reasonableness rule: mentions a number: {has_number}, work credit {work:.2f}"
        return 3.0 + has_number + work, why, False

    def _dsbench_rule(self, contract, feedback: str, ground_truth: str):
        missing_inputs, missing_outputs = (g.strip() != "none" for g in contract.groups())
        errored = bool(_TOOL_ERROR_RE.search(feedback))
        failed = not feedback.strip() or errored
        if missing_inputs and missing_outputs:
            return 5.0, "contract rule: an earlier agent's file is missing; not this agent's fault", False
        if missing_outputs:
            if failed:
                return 1.0, "contract rule: its own files are missing after an error or without code", True
            return 3.0, "contract rule: ran cleanly but its own files are still missing", True
        submission = _SUBMISSION_RE.search(ground_truth)
        if submission and submission.group(1) == "invalid":
            return 3.0, "contract rule: submission.csv is invalid", True
        if errored:  # a reply without code once the files exist closes the agent's turns: no failure
            return 5.0, "contract rule: its files exist but this action's code failed", False
        if submission:  # valid; the relative score is missing only when the task has best == baseline
            rel = float(submission.group(2) or 0.0)
            return 7.0 + 2.0 * min(1.0, rel), f"contract rule: valid submission, relative score {rel:.3f}", False
        return 7.0, "contract rule: its files are saved", False
