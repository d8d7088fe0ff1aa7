"""MathChat (examples/configs/mathchat.yaml): a Problem Solver, a Code Executor and a Verifier, in that order.
The default `MultiAgentEnv` already runs the Code Executor's Python; success is the last agent's final
`\\boxed{}` answer equal to the task's answer (`grade`), which also grades that agent's actions for the
offline coach (`judge`).
"""

import re
import threading
from fractions import Fraction
from typing import Optional

from openrlhf_mappa.envs.base import MultiAgentEnv


class MathChatEnv(MultiAgentEnv):
    task_type = "math"
    grader = "math-verify"

    def final_answer(self) -> Optional[str]:
        """The last `\\boxed{}` the last agent (the Verifier) wrote, or None."""
        last_agent = self.topology.agents[-1].name
        for entry in reversed(self.history):
            boxed = extract_boxed(entry.response) if entry.agent == last_agent else None
            if boxed is not None:
                return boxed

    def answer_formatted(self, agent, response: str) -> Optional[bool]:
        """Only the last agent owes the team a final answer, written as \\boxed{...}."""
        return extract_boxed(response) is not None if agent is self.topology.agents[-1] else None

    def judge(self, agent, response: str, feedback, truncated_at) -> Optional[tuple]:
        """The answer rule for an agent given the task's answer (`coach_ground_truth`: the last one): its last
        \\boxed{} right -> 10, wrong -> 2, none -> 0. A code run is left to the coach's tool rule."""
        answer = self.coach_ground_truth(agent)
        if answer is None or feedback.ran:
            return None
        boxed = extract_boxed(response)
        if boxed is None:
            return 0.0, "answer rule: no \\boxed{} answer", True
        if grade(boxed, answer):
            return 10.0, f"answer rule: \\boxed{{{boxed}}} matches the ground truth", False
        return 2.0, f"answer rule: \\boxed{{{boxed}}} differs from the ground truth", True

    def outcome(self) -> dict:
        answer = self.final_answer()
        return {
            "success": grade(answer, self.task["answer"]),
            "answer": answer,
            "answered": answer is not None,
        }


def extract_boxed(text: str) -> Optional[str]:
    """The content of the last complete `\\boxed{...}` in text (nested braces kept), or None."""
    start = len(text or "")
    while True:
        start = text.rfind("\\boxed", 0, start)
        if start < 0:
            return None
        i = start + len("\\boxed")
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    return text[i + 1 : j].strip()
        # An unclosed box (e.g. cut off by the token limit): fall back to the one before it.


def grade(predicted, reference) -> bool:
    """Is the final answer right? `answers_match` first (fast, no sympy), then math-verify, which also sees
    equal expressions (2^{10} vs 1024). Its time bound is SIGALRM, which only the main thread may use (the
    rollout's and `mappa eval`'s calls): elsewhere it runs unbounded rather than silently fail."""
    if predicted is None:
        return False
    if answers_match(predicted, reference):
        return True
    from math_verify import parse, verify

    limit = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"${reference}$", parsing_timeout=limit)
    pred = parse(f"${predicted}$", parsing_timeout=limit)
    return bool(gold and pred and verify(gold, pred, timeout_seconds=limit))


def answers_match(predicted, reference) -> bool:
    """Equal after removing LaTeX noise, or equal as exact numbers (18.0 == 18, 023 == 23, 1/2 == 0.5)."""
    a, b = _normalize(predicted), _normalize(reference)
    if a == b:
        return bool(a)
    try:
        return Fraction(a) == Fraction(b)
    except (ValueError, ZeroDivisionError):
        return False


def _normalize(answer) -> str:
    s = str(answer)
    s = re.sub(r"\\(left|right)\b|\\[,;:! ]|\$", "", s)
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|\\%|%", "", s)  # 30^\circ -> 30, 25\% -> 25
    s = re.sub(r"\s+", "", s).rstrip(".")
    s = re.sub(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}", r"\1/\2", s)
    s = re.sub(r"\\[dt]?frac(\d)(\d)", r"\1/\2", s)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")  # 1,000 -> 1000
    return s
