"""What every coach backend shares: the `Coach` protocol, the `CoachRequest` it judges, the prompt templates,
and the strict rules that turn a reply into a score or a review (parse_score, parse_review)."""

import asyncio
import json
import re
import string
from dataclasses import dataclass
from typing import Optional

from openrlhf_mappa.episode import Review, Verdict
from openrlhf_mappa.topology import PROMPT_FIELDS

# The hindsight prompt when the topology gives no `review_template`. The reply format is fixed (parse_review).
DEFAULT_REVIEW_TEMPLATE = """You are a coach reviewing, in hindsight, a whole episode of a team of AI agents \
that solved a task together.
Now that the outcome is known, trace it back through the trajectory: judge every action, and name the one \
action most
responsible for the outcome (for a failure: the first action that went wrong and that later actions could \
not repair).

Task type: {task_type}
Task:
{task}

The trajectory, {num_actions} actions in order (each with what the agent was given, what it did, and the \
tool feedback):
{trajectory}

The outcome of the episode:
{outcome}

Score every action from 0 (harmful or useless) to 10 (exactly what the task needed at that point).
Reply with one JSON object and nothing else:
{{"rationale": "<a few sentences>", "responsible": <id of the action most responsible for the outcome>,
 "actions": [{{"id": 1, "score": <0-10>}}, ... one entry for each action id from 1 to {num_actions}]}}"""


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
    runs_code: bool = False
    # the output was cut off at this token limit (None: it ended by itself)
    truncated_at: Optional[int] = None
    cut_off_note: bool = False  # a cut-off output says so at its end (`coach_input: ours`; the authors': no)
    coach_bias: Optional[str] = None  # --mappa.coach.show_bias: BiasAudit.prompt_text(), None when not shown
    round: int = 0  # where the action stands in the episode (see Action), from 0
    position: int = 0
    env_grade: Optional[tuple] = None  # the env's own (score, why, failed) of it (MultiAgentEnv.judge)


class Coach:
    """A coach backend. `score` never raises for a failed evaluation: a non-"ok" Verdict lets the caller leave
    the action out of training instead of inventing a score."""

    name: str = "coach"
    template: str = ""  # an LLM coach's prompt template; the trainer swaps it when the criteria switch

    async def score(self, request: CoachRequest) -> Verdict:
        raise NotImplementedError

    async def review(self, requests: list, outcome: dict) -> Review:
        """Hindsight: one Review of a finished episode (its actions' CoachRequests in order); never raises for
        a failed evaluation."""
        raise NotImplementedError(f"coach {self.name!r} has no hindsight review")

    async def reask_answer(self, verdict: Verdict) -> Verdict:
        """`verdict` (the final agent's, shown the reference, with no ANSWER_CORRECT line) after asking once
        more for that line, as the authors do before their raw-score fallback (evaluation.evaluate). A coach
        that writes no such line returns it as it is."""
        return verdict

    async def probe(self) -> None:
        """Raise ValueError when the coach cannot be reached, before a run spends anything on rollouts."""

    async def aclose(self):
        pass


def render_prompt(template: str, request: CoachRequest) -> str:
    """Fill a coach prompt template (str.format; literal braces doubled: {{ }}), its fields checked where it
    was loaded (topology.check_template). With `cut_off_note` (a topology's `coach_input: ours`) a cut-off
    output says so at its end, whatever the template, lest the coach judge an unfinished answer as a chosen
    stop; the authors' coach gets the raw text. The bias figures go where the template names {coach_bias},
    else before the whole prompt, so any template can show them."""
    fields = {name: getattr(request, name) for name in PROMPT_FIELDS} | {
        "agent_output": _shown_output(request), "feedback": request.feedback or "(none)",
        "ground_truth": request.ground_truth if request.ground_truth is not None else "(not available)",
        "coach_bias": request.coach_bias or "",
    }
    prompt = template.format(**fields)
    if (request.coach_bias
            and "coach_bias" not in {name for _, name, _, _ in string.Formatter().parse(template)}):
        prompt = request.coach_bias + "\n\n" + prompt
    return prompt


# A score comes only from the JSON verdict's "score", a line `<KEY>: <number>`, or a reply that is just a
# number. Prose is full of numbers that are not the score, and a guessed number trains the agents as surely
# as a real one, so an unclear reply is a parse error that the caller re-prompts.
_NUM = r"([-+]?\d+(?:\.\d+)?)"
_OUT_OF_10 = r"(?:[ \t]*/[ \t]*10(?:\.0+)?(?![\d.]))?"  # 7/10, 7 / 10.0
# After the key line's number (and an optional /10) the rest of the line is commentary ("6 - a flawless action
# would score 10" is 6). The number must end cleanly, so "7,5", "7%", "7/5", "6-7", "6 to 8" are no score.
_SCORE_LINE = (
    r"^[ \t#>*_`-]*{key}[*_`]*[ \t]*[:=][ \t*_`]*" + _NUM + r"[*_`]*" + _OUT_OF_10 + r"[*_`]*"
    r"(?=[.,;:!?)]?(?:[ \t\r]|$))(?![ \t]*(?:-|\u2013|\u2014|to|or|and)[ \t]*[-+]?\d)"
)
_BARE_NUMBER = re.compile(r"[*_`]*" + _NUM + r"[*_`]*" + _OUT_OF_10 + r"[*_`]*\.?")


def after_thinking(text: str) -> str:
    """A reasoning coach's verdict: what follows its last </think>. The reasoning itself is never read, for it
    weighs scores it may not give; a reply cut off inside <think> has no verdict (what precedes the tag)."""
    text = text or ""
    return text.rpartition("</think>")[2] if "</think>" in text else text.partition("<think>")[0]


def parse_score(text: str, key: str) -> Optional[float]:
    """The coach's score in [0, 10], else None: a JSON reply's "score" alone; else the `KEY: n` lines
    (case-insensitive, markdown allowed; two different values are no score), or a reply that is just a number.
    A score out of range is no score, never a reason to look for another number. Only the verdict counts: the
    text after a <think> block (after_thinking)."""
    text = after_thinking(text).strip()
    fenced = re.fullmatch(r"```[ \t]*(?:json)?\s*(.*?)\s*```", text, re.DOTALL | re.IGNORECASE)
    body = fenced.group(1) if fenced else text
    if body.startswith("{"):
        try:
            reply = json.loads(body)
        except json.JSONDecodeError:
            reply = None
        if isinstance(reply, dict):
            score = reply.get("score")
            return float(score) if _number(score, False) and 0.0 <= score <= 10.0 else None
    pattern = _SCORE_LINE.replace("{key}", re.escape(key))
    values = set(map(float, re.findall(pattern, text, re.IGNORECASE | re.MULTILINE)))
    if not values:
        bare = _BARE_NUMBER.fullmatch(text)
        values = {float(bare.group(1))} if bare else set()
    if len(values) != 1:
        return None
    score = values.pop()
    return score if 0.0 <= score <= 10.0 else None


# The authors' MathChat coach also states whether the Verifier's answer equals the reference:
# `ANSWER_CORRECT: 1|0` (their in-loop accuracy). Read as strictly as the score: its own key line only, 0 or
# 1, one value; a reasoning coach's <think> block is not its verdict. Never a reward: evaluation's
# coach-graded accuracy (evaluation.py).
ANSWER_KEY = "ANSWER_CORRECT"
_ANSWER_LINE = re.compile(_SCORE_LINE.replace("{key}", ANSWER_KEY), re.IGNORECASE | re.MULTILINE)


def parse_answer_correct(text: str) -> Optional[int]:
    """1 or 0 from the reply's `ANSWER_CORRECT: <1|0>` lines (after_thinking), else None (absent, another
    number, or two different values)."""
    values = set(map(float, _ANSWER_LINE.findall(after_thinking(text))))
    return int(values.pop()) if len(values) == 1 and values <= {0.0, 1.0} else None


def render_review_prompt(template: str, requests: list, outcome: dict) -> str:
    """Fill a hindsight template (fields REVIEW_FIELDS, checked where it was loaded) with a finished episode,
    its actions numbered from 1."""
    parts = []
    for i, r in enumerate(requests, 1):
        part = (
            f"=== Action {i} of {len(requests)}: agent {r.agent}, its action {r.turn + 1} ===\n"
            f"Role: {r.role}\nGiven:\n{r.agent_input}\nOutput:\n{_shown_output(r)}\n"
            f"Tool feedback:\n{r.feedback or '(none)'}"
        )
        if r.ground_truth is not None:
            part += f"\nGround truth for this action: {r.ground_truth}"
        parts.append(part)
    first = requests[0] if requests else CoachRequest("", "", 0, "", "", "", "", "", "")
    fields = {
        "task": first.task,
        "task_type": first.task_type,
        "trajectory": "\n\n".join(parts),
        "outcome": json.dumps(outcome, ensure_ascii=False, sort_keys=True),
        "num_actions": len(requests),
    }
    return template.format(**fields)


def _shown_output(r: CoachRequest) -> str:
    cut = r.truncated_at is not None and r.cut_off_note
    return r.agent_output + (f"\n[cut off at the limit of {r.truncated_at} tokens]" if cut else "")


def _number(x, integer: bool) -> bool:
    """A JSON number (an integer if asked), never a boolean (Python counts True as 1)."""
    return isinstance(x, int if integer else (int, float)) and not isinstance(x, bool)


def parse_review(text: str, n: int) -> Optional[tuple]:
    """(scores in action order, index of the responsible action, rationale) from a hindsight reply, else None.
    The JSON "actions" must match the n actions one to one (ids 1..n once each, scores in [0, 10]) and
    "responsible" be one of the ids: anything else is no review at all, never a partial one or a guess."""
    text = after_thinking(text).strip()
    fenced = re.fullmatch(r"```[ \t]*(?:json)?\s*(.*?)\s*```", text, re.DOTALL | re.IGNORECASE)
    try:
        reply = json.loads(fenced.group(1) if fenced else text)
    except json.JSONDecodeError:
        return None
    entries = reply.get("actions") if isinstance(reply, dict) else None
    if not isinstance(entries, list) or len(entries) != n:
        return None
    scores = {}
    for e in entries:
        if not (isinstance(e, dict) and _number(e.get("id"), True) and _number(e.get("score"), False)):
            return None
        if not (1 <= e["id"] <= n and 0.0 <= e["score"] <= 10.0) or e["id"] in scores:
            return None
        scores[e["id"]] = float(e["score"])
    responsible = reply.get("responsible")
    if not (_number(responsible, True) and 1 <= responsible <= n):
        return None
    rationale = reply.get("rationale")
    return (
        [scores[i] for i in range(1, n + 1)],
        responsible - 1,
        rationale if isinstance(rationale, str) else "",
    )


def combine(per_action: Verdict, hindsight: Verdict) -> Verdict:
    """--mappa.coach.mode both: the mean of the two scores, or the one that exists when the other failed (a
    failed review must not void per-action scores already paid for, nor the reverse); no score when neither
    does."""
    scores = [v.score for v in (per_action, hindsight) if v.status == "ok"]
    if not scores:
        return Verdict(None, per_action.status, f"both failed: per-action: {per_action.rationale[:300]}; "
                       f"hindsight: {hindsight.rationale[:300]}", per_action.coach, source="both")
    rule = ("mean of per-action and hindsight" if len(scores) == 2
            else "per-action only (the hindsight review failed)" if per_action.status == "ok"
            else "hindsight only (the per-action verdict failed)")
    return Verdict(
        sum(scores) / len(scores),
        "ok",
        f"{rule}: per-action {per_action.score}, hindsight {hindsight.score}",
        per_action.coach,
        cached=per_action.cached and hindsight.cached,
        source="both",
        answer_correct=per_action.answer_correct,
    )


async def judge_episode(coach: Coach, mode: str, requests: list, outcome: dict, pending: list) -> tuple:
    """(verdicts each action trains on, per action its {"per_action", "hindsight"} parts in mode "both" else
    {}, the Review or None) of a finished episode. `pending`: the per-action verdicts' awaitables, asked while
    it ran."""
    per_action = await asyncio.gather(*pending)
    if mode == "per_action" or not requests:  # an episode with no action (all skipped) has nothing to review
        return per_action, [{} for _ in per_action], None
    review = await coach.review(requests, outcome)
    hindsight = review.verdicts(len(requests))
    if mode == "hindsight":
        return hindsight, [{} for _ in hindsight], review
    parts = [{"per_action": p, "hindsight": h} for p, h in zip(per_action, hindsight)]
    return [combine(p, h) for p, h in zip(per_action, hindsight)], parts, review
