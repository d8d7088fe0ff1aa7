"""Records of one multi-agent episode: actions, coach verdicts, outcome. Plain Python, written to
episodes.jsonl.

An `Action` is one generation of one agent (one experience in training); a `Verdict` the coach's judgement of
one action, where `score is None` means "no valid score": such an action never trains on an invented number.
"""

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from typing import Optional

COACH_NAME = "coach"  # a trained coach's name among the trainees (its actions, checkpoints, metrics)
VERDICT_STATUSES = ("ok", "parse_error", "api_error", "timeout", "skipped")
# Where a verdict's score comes from (--mappa.coach.mode): the coach's request about this one action, the
# hindsight review of the whole episode, or both combined (coach.combine).
VERDICT_SOURCES = ("per_action", "hindsight", "both")
# ToolFeedback.limit values, as as_text() tells them to the coach.
LIMIT_MARKERS = {
    "timeout": "[timed out]",
    "cpu": "[killed: CPU time limit]",
    "memory": "[hit the memory limit]",
    "file_size": "[hit the file size limit]",
    "processes": "[hit the process limit]",
}


@dataclass
class ToolFeedback:
    """What the environment answered to an action (code run, files, errors). Empty when no tool ran."""

    stdout: str = ""
    stderr: str = ""
    exit_code: Optional[int] = None
    timed_out: bool = False
    files: list = field(default_factory=list)  # every file in the workspace after the run
    limit: Optional[str] = None  # which limit stopped or refused the code: a key of LIMIT_MARKERS
    output_truncated: bool = False  # stdout or stderr was longer than the cap; the middle was cut
    files_created: list = field(default_factory=list)
    files_changed: list = field(default_factory=list)
    isolation: dict = field(default_factory=dict)  # which protections applied (see sandbox.py)

    @property
    def ran(self) -> bool:
        return self.exit_code is not None or self.timed_out

    @property
    def error(self) -> bool:
        return self.timed_out or (self.exit_code not in (None, 0))

    def as_text(self, files: bool = True) -> str:
        """What the run printed, its limit and exit markers, and (`files`) the workspace's files after it."""
        if not self.ran:
            return ""
        markers = [LIMIT_MARKERS[self.limit]] if self.limit else ["[timed out]"] if self.timed_out else []
        if self.exit_code and not self.timed_out:
            markers.append(f"[exit code {self.exit_code}]")
        parts = [" ".join(markers)] if markers else []
        if self.stdout:
            parts.append(f"stdout:\n{self.stdout}")
        if self.stderr:
            parts.append(f"stderr:\n{self.stderr}")
        if files and self.files:
            parts.append("files: " + ", ".join(self.files))
        if files and (self.files_created or self.files_changed):
            parts.append("this run created: " + (", ".join(self.files_created) or "-") + "; changed: "
                         + (", ".join(self.files_changed) or "-"))
        return "\n".join(parts) or "[no output]"


@dataclass
class Verdict:
    score: Optional[float]  # in [0, 10], or None when the coach gave no valid score
    status: str  # one of VERDICT_STATUSES
    rationale: str = ""
    coach: str = ""  # coach name, e.g. "heuristic" or "openai:<model>"
    latency_s: float = 0.0
    tokens_in: int = 0
    tokens_out: int = 0
    retries: int = 0  # HTTP attempts beyond the first (429, 5xx, timeouts) and format re-prompts
    cached: bool = False  # served from the verdict cache: cost nothing this time
    # "hindsight" and "both" verdicts are no requests of their own: their cost is counted on the episode's
    # Review and the per-action verdict (Action.verdict_parts; audit.coach_calls).
    source: str = "per_action"
    version: Optional[int] = None  # --mappa.coach.kind trained: the coach's weight version that gave it
    # trained coach: its reference judge's verdict on the action, where asked
    reference: Optional[dict] = None
    # the reply's ANSWER_CORRECT line, 1 or 0 (coach.parse_answer_correct)
    answer_correct: Optional[int] = None

    def __post_init__(self):
        if self.status not in VERDICT_STATUSES:
            raise ValueError(f"unknown verdict status {self.status!r}; expected one of {VERDICT_STATUSES}")
        if self.source not in VERDICT_SOURCES:
            raise ValueError(f"unknown verdict source {self.source!r}; expected one of {VERDICT_SOURCES}")
        if self.status == "ok" and (self.score is None or not 0.0 <= self.score <= 10.0):
            raise ValueError(f"an 'ok' verdict needs a score in [0, 10], got {self.score!r}")
        if self.status != "ok" and self.score is not None:
            raise ValueError(f"a {self.status!r} verdict must not carry a score (got {self.score!r})")


@dataclass
class Review:
    """The coach's hindsight review of a whole episode, once its outcome is known: one request, a score per
    action (in episode order) and the action held responsible for the outcome; a failed review has neither."""

    scores: Optional[list]  # one score in [0, 10] per action of the episode, or None
    responsible: Optional[int]  # index into Episode.actions (the coach's action id - 1), or None
    status: str  # one of VERDICT_STATUSES
    rationale: str = ""
    coach: str = ""
    latency_s: float = 0.0
    tokens_in: int = 0
    tokens_out: int = 0
    retries: int = 0
    cached: bool = False

    def __post_init__(self):
        if self.status not in VERDICT_STATUSES:
            raise ValueError(f"unknown review status {self.status!r}; expected one of {VERDICT_STATUSES}")
        if (self.status == "ok") != (self.scores is not None and self.responsible is not None):
            raise ValueError(f"an 'ok' review, and only one, has scores and a responsible action "
                             f"(status {self.status!r})")

    def verdicts(self, n: int) -> list:
        """A hindsight Verdict for each of the episode's `n` actions (scoreless, of its status, if it
        failed)."""
        if self.status != "ok":
            return [
                Verdict(
                    None, self.status, f"hindsight review: {self.rationale}", self.coach, source="hindsight"
                )
                for _ in range(n)
            ]
        why = f"hindsight review, action {self.responsible + 1} of {n} held responsible: {self.rationale}"
        return [
            Verdict(float(s), "ok", why, self.coach, cached=self.cached, source="hindsight")
            for s in self.scores
        ]


@dataclass
class Action:
    episode_id: str
    agent: str
    turn: int  # the agent's own turn index within the episode, from 0
    prompt_ids: list  # token ids the agent's policy saw (its chat template applied)
    response_ids: list  # token ids the agent generated; only these train
    round: int = 0  # the round of the episode it was taken in, from 0 (agents of one round act concurrently)
    position: int = 0  # its index among the episode's actions, from 0
    prompt_text: str = ""
    response_text: str = ""
    truncated: bool = False  # generation hit the token limit
    # it gives a final answer in the env's format (None: not asked of this agent)
    formatted: Optional[bool] = None
    prompt_truncated: bool = False  # its oldest history entries were left out to fit max_len - max_new_tokens
    feedback: ToolFeedback = field(default_factory=ToolFeedback)
    # What the coach saw besides the texts (role, task, feedback, ground truth...), for `mappa coach score`.
    coach_request: dict = field(default_factory=dict)
    verdict: Optional[Verdict] = None  # the verdict it trains on (see --mappa.coach.mode)
    # mode "both": {"per_action", "hindsight"} verdicts combined
    verdict_parts: dict = field(default_factory=dict)
    reward: Optional[float] = None  # the scalar reward this action trained on (None: left out)
    # In its agent's batch at zero loss (--mappa.batch_semantics authors): truncated (its reward, if any, is
    # still in the whitening statistics) or unscored; its advantage is 0.
    zero_loss: bool = False
    advantage: Optional[float] = None  # mean normalized advantage over its tokens
    # Each response token's log-prob as vLLM sampled it (after temperature and top-p): what the trainer's
    # log-probs are compared with (mismatch metrics, --algo.advantage.is_correction_*). Empty: not asked.
    rollout_logprobs: list = field(default_factory=list)
    # left out by --algo.dynamic_filtering_enable (its group's mean score out of range)
    filtered: bool = False
    # {agent: weight version}: its own agent's when it started generating, and each other agent's that acted
    # in an earlier round of the episode; version_end: its own agent's when it ended (later: a partial
    # rollout).
    versions: dict = field(default_factory=dict)
    version_end: int = 0
    stale: bool = False  # left out: a version more than --mappa.max_staleness behind when its step trained


@dataclass
class Episode:
    episode_id: str
    task_id: str
    task_type: str = ""  # e.g. "math", "regression", "classification"
    actions: list = field(default_factory=list)
    outcome: dict = field(default_factory=dict)  # at least {"success": bool}; pipelines may add metrics
    step: int = 0  # training step that produced it
    timings: dict = field(default_factory=dict)
    # Actions never taken, their prompt too long even without history: {"agent", "turn", "prompt_tokens",
    # "budget"}; that agent's turns ended there.
    skipped_actions: list = field(default_factory=list)
    # Which limit stopped the episode (max_actions, max_episode_actions), "" if none: a stopped episode fails.
    action_limit: str = ""
    review: Optional[Review] = None  # the hindsight review (--mappa.coach.mode hindsight or both)
    # What the environment raised, and where (rollout.run_episode), or "": such an episode fails, trains
    # nothing.
    env_error: str = ""

    @property
    def success(self) -> bool:
        return bool(self.outcome.get("success", False))

    def to_json(self) -> str:
        """One episodes.jsonl line: everything but the token ids (the texts carry the same content)."""
        d = dataclasses.asdict(self)
        for a in d["actions"]:
            a.pop("prompt_ids"), a.pop("response_ids")
            # bf16 engines: ~1e-2 nats apart
            a["rollout_logprobs"] = [round(x, 4) for x in a["rollout_logprobs"]]
        return json.dumps(d, ensure_ascii=False)

    @classmethod
    def from_record(cls, record: dict) -> "Episode":
        """An episodes.jsonl record as an Episode again; its token ids, not kept there, are empty lists."""
        actions = [Action(**{**a, "prompt_ids": [], "response_ids": [],
                             "feedback": ToolFeedback(**a.get("feedback") or {}),
                             "verdict": Verdict(**a["verdict"]) if a.get("verdict") else None})
                   for a in record.get("actions", [])]
        return cls(**{**record, "actions": actions})


def read_record(path: str, what: str) -> dict:
    """One JSON object from `path` (a checkpoint marker, an adapter's config), or a ValueError naming the
    file."""
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(
            f"{path}: {what} is cut off or not JSON ({e}); restore it, or move it away"
        ) from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}: {what} must be a JSON object, got {type(record).__name__}")
    return record


def read_jsonl(path: str) -> list:
    """(line number, record) of each non-empty line of a run's JSONL file. A cut-off last line (a run killed
    mid-write) is skipped with a warning; a broken line anywhere else is an error naming its line."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        lines = data.decode("utf-8").split("\n")
    except UnicodeDecodeError as e:  # a binary file (a checkpoint, a database) given for a run's log
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{path}: line {line}: byte 0x{data[e.start]:02x} is not UTF-8: not a JSONL file of "
                         f"a run (one JSON record per line)") from e
    last = len(lines) - 1 if lines[-1] == "" else len(lines)
    out = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if lineno == last:
                print(
                    f"warning: {path}: line {lineno} is cut off (an interrupted run?); skipped",
                    file=sys.stderr,
                )
                continue
            raise ValueError(f"{path}: line {lineno}: broken JSON: {e.msg}") from e
        if not isinstance(record, dict):
            raise ValueError(
                f"{path}: line {lineno}: a JSON {type(record).__name__}, not one record (a JSON object) "
                f"per line"
            )
        out.append((lineno, record))
    return out
