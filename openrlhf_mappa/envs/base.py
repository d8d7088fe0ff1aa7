"""The environment protocol: how a pipeline tells MAPPA what each agent sees and what its actions do.

One environment instance serves one episode (one task). The rollout (rollout.py) drives it in rounds::

    env = topology.make_env(task, workspace)      # env_class(topology, task, workspace, **env_kwargs)
    turns, last = {every agent: 0}, {}
    while agents := env.next_agents(turns, last): # who acts next; [] ends the episode
        <past an agent's max_actions or the topology's max_episode_actions: the episode ends, a failure>
        for agent in agents:                      # all of them see the history as it stands now
            messages = env.observe(agent, turns[agent.name])   # omit=k: the k oldest entries left out to fit
        responses = <the agents' policies generate, concurrently>
        for agent, response in zip(agents, responses):
            result = last[agent.name] = env.step(agent, turn, response)   # runs tools, records history
            <the coach scores the action: result.feedback, env.coach_ground_truth(agent), env.judge(...)>
            turns[agent.name] += 1
    outcome = env.outcome()                       # {"success": bool, ...metrics}, logged with the episode

To write a pipeline, subclass `MultiAgentEnv`, override what differs (usually `outcome`, often `step`), and
name it in the topology YAML as `env: mypackage.mymodule:MyEnv`; the YAML's `env_kwargs` are its constructor's
keyword arguments. docs/reference.md ("What each agent sees", "Over-long prompts", "The environment protocol")
describes the defaults below; `openrlhf_mappa.team.play` plays an episode of one against scripted replies.
"""

from __future__ import annotations

import csv
import errno
import json
import math
import os
import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, NamedTuple, Optional

from openrlhf_mappa.episode import ToolFeedback
from openrlhf_mappa.sandbox import extract_code, run_python

if TYPE_CHECKING:
    from openrlhf_mappa.topology import AgentSpec, Topology


@dataclass
class StepResult:
    feedback: ToolFeedback
    done: bool = False  # True ends this agent's turns early (read by the default next_agents, the chain)


class HistoryEntry(NamedTuple):
    agent: str
    turn: int
    response: str
    feedback: str  # ToolFeedback.as_text(); "" when no tool ran
    # How many entries the history held when this action's input was rendered (observe); None: all before it.
    # Actions of one round see the history as it was before the round.
    seen: Optional[int] = None


class MultiAgentEnv:
    """One instance per episode."""

    task_type: str = ""
    # What decides outcome()["success"], evaluation's `accuracy`: `mappa paper-table` heads its row with it.
    grader: str = "success (the environment's outcome)"
    # False where a task has no reference answer (a writer judged by the coach alone): its rows may leave
    # --data.label_key's column out or null (load_tasks), and coach_ground_truth gives None.
    needs_answer: bool = True

    def __init__(
        self,
        topology: Topology,
        task: dict,
        workspace: str,
        code_timeout_s: float = 10.0,
        code_memory_mb: int = 4096,
        code_cpu_time_s: Optional[float] = None,
        code_max_file_mb: int = 1024,
        code_max_processes: int = 256,
        sandbox_url: Optional[str] = None,
    ):
        # The sandbox's limits (env_kwargs) are refused here, so before a run starts (Topology.check_env), all
        # wrong ones in one refusal.
        limits = {
            "code_timeout_s": (code_timeout_s, (int, float)),
            "code_cpu_time_s": (code_cpu_time_s, (int, float)),
            "code_memory_mb": (code_memory_mb, int),
            "code_max_file_mb": (code_max_file_mb, int),
            "code_max_processes": (code_max_processes, int),
        }
        problems = []
        for key, (value, kind) in limits.items():
            if value is None and key == "code_cpu_time_s":
                continue
            if isinstance(value, bool) or not isinstance(value, kind) or not 0 < value < math.inf:
                what = "a positive integer" if kind is int else "a positive number of seconds"
                problems.append(f"env_kwargs {key} must be {what}, got {value!r}")
        if sandbox_url is not None and not (isinstance(sandbox_url, str)
                                            and sandbox_url.startswith(("http://", "https://"))):
            problems.append(f"env_kwargs sandbox_url must be the http(s) URL of a SandboxFusion service, "
                            f"got {sandbox_url!r}")
        if problems:
            raise ValueError("; ".join(problems))
        self.topology, self.task, self.workspace, self.code_timeout_s = (
            topology, task, workspace, code_timeout_s
        )
        self.sandbox_limits = dict(
            memory_mb=code_memory_mb,
            cpu_time_s=code_cpu_time_s,
            max_file_mb=code_max_file_mb,
            max_processes=code_max_processes,
            sandbox_url=sandbox_url,
        )
        self.history: list[HistoryEntry] = []
        self._observed = {}  # (agent name, turn) -> len(history) when observe() rendered its input

    @property
    def task_text(self) -> str:
        """The task as the prompts' {task} and the coach see it: its prompt and the topology's
        problem_suffix."""
        return self.task["prompt"] + self.topology.problem_suffix

    def next_agents(self, turns: dict, last: dict) -> list:
        """The AgentSpecs of the next round ([] ends the episode). `turns`: name -> actions so far; `last`:
        the round just played, name -> its StepResult (None: the prompt did not fit), {} before the first. The
        default is the chain: the topology's agents in order, each until done, max_actions or a misfit."""
        agents = self.topology.agents
        if not last:
            return agents[:1]
        ((name, result),) = last.items()  # the chain plays one agent per round
        i = next(i for i, a in enumerate(agents) if a.name == name)
        if result is not None and not result.done and turns[name] < agents[i].max_actions:
            return [agents[i]]
        return agents[i + 1 : i + 2]

    # Marks the default: in a chain no agent's view may name a later agent (topology.py reads the mark).
    next_agents.chain = True

    def observe(self, agent: AgentSpec, turn: int, omit: int = 0) -> list[dict]:
        """The episode as this agent saw it happen: its system message; its prompt ({task}, and {history}:
        what its view selects of the other agents' actions before its first one); then each of its own earlier
        actions as an assistant turn, followed by one user turn with that action's tool output (where a tool
        ran) and the others' actions its view selects up to its next action ("(nothing new)" where there is
        neither: chat templates want turns to alternate). The rollout renders its replies as generated,
        reasoning included, unless the topology sets keep_reasoning: false. `omit=k` leaves out the k oldest
        of those entries with a marker; the system message, prompt and task are never cut."""
        self._observed[agent.name, turn] = len(self.history)  # what its input can show: step() records it
        view, shows_history = agent.view, "{history}" in agent.prompt
        others = [(i, e) for i, e in enumerate(self.history) if e.agent != agent.name
                  and (view.agents == "all" or e.agent in view.agents)]
        if view.actions == "last":
            # Each agent's final reply and its latest code run: what the authors' Verifier saw of the Code
            # Executor.
            last = {e.agent: i for i, e in others}
            last_run = {e.agent: i for i, e in others if e.feedback and view.tool_output}
            others = [(i, e) for i, e in others if i in {*last.values(), *last_run.values()}]
        if view.strip_thinking == "answer":  # what follows the last </think> (cut off in its reasoning: none)
            others = [(i, e._replace(response=e.response.rpartition("</think>")[2] if "</think>" in e.response
                                     else e.response.partition("<think>")[0])) for i, e in others]
        elif view.strip_thinking:
            # The authors' strip_thinking_blocks (dsbench_workflow.py): whole <think>...</think> blocks go,
            # then any stray tag, so a reply cut off inside its reasoning, or without the opening tag (the
            # template of Qwen3-4B-Thinking-2507 writes it), hands its reasoning on.
            for i, (n, e) in enumerate(others):
                text = re.sub(r"<think>.*?</think>\s*", "", e.response, flags=re.DOTALL)
                text = re.sub(r"\n{3,}", "\n\n", re.sub(r"</?think>\s*", "", text))
                others[i] = (n, e._replace(response=text.strip()))
        if not view.tool_output:
            others = [(i, e._replace(feedback="")) for i, e in others]
        # Episode order: another agent's action goes after the last own action whose input could not show it
        # (one of the same round, generated at once, counts as after).
        own = [(i, e) for i, e in enumerate(self.history) if e.agent == agent.name]
        seen = [i if e.seen is None else e.seen for i, e in own]
        after = [[] for _ in range(len(own) + 1)]  # after[0]: before its first action, {history}'s
        for i, e in others:
            after[sum(s <= i for s in seen)].append(e)
        if not shows_history:  # a prompt without {history} shows nothing of before its first action
            after[0] = []
        timeline = list(after[0])
        for (_, mine), theirs in zip(own, after[1:]):
            timeline += [mine, *theirs]
        omit = min(omit, len(timeline))
        marker = f"[{omit} earlier action{'s' * (omit > 1)} omitted to fit the context]"
        # the others' actions before its first kept action, then [own action, others' after it...]
        parts = [[]]
        for e in timeline[omit:]:
            if e.agent == agent.name:
                parts.append([])
            parts[-1].append(e)
        history = self.history_text(parts[0])
        if omit:
            history = f"{marker}\n\n{history}" if parts[0] else marker
        user = agent.prompt.format(task=self.task_text, history=history)
        if omit and not shows_history:
            user += f"\n\n{marker}"
        messages = [{"role": "system", "content": agent.system}] if agent.system else []
        messages.append({"role": "user", "content": user})
        for mine, *theirs in parts[1:]:
            shown = [f"#### Output of the code\n{mine.feedback}"] * bool(mine.feedback)
            shown += [self.history_text(theirs)] * bool(theirs)
            messages += [{"role": "assistant", "content": mine.response},
                         {"role": "user", "content": "\n\n".join(shown) or "(nothing new)"}]
        return messages

    def step(self, agent: AgentSpec, turn: int, response: str) -> StepResult:
        """Record the response; a `runs_code` agent's ```python blocks run in the workspace's sandbox. A code
        agent that writes no code block, and any other agent after one reply, is done."""
        feedback, done = ToolFeedback(), True
        if agent.runs_code:
            code = extract_code(response)
            if code is not None:
                feedback = run_python(
                    code, self.workspace, timeout_s=self.code_timeout_s, **self.sandbox_limits
                )
                done = False
        seen = self._observed.pop((agent.name, turn), None)
        self.history.append(HistoryEntry(agent.name, turn, response, feedback.as_text(), seen))
        return StepResult(feedback, done)

    def answer_formatted(self, agent: AgentSpec, response: str) -> Optional[bool]:
        """Whether the response gives a final answer in the required form (metric `answer_format_rate`); None
        for agents that owe none."""
        return None

    def outcome(self) -> dict:
        raise NotImplementedError(f"{type(self).__name__} must define outcome(): {{'success': bool, ...}}")

    def coach_ground_truth(self, agent: AgentSpec) -> Optional[str]:
        """The task's "answer" for the last agent's coach, nothing for the others."""
        return self.task.get("answer") if agent.name == self.topology.agents[-1].name else None

    def judge(self, agent: AgentSpec, response: str, feedback: ToolFeedback,
              truncated_at: Optional[int]) -> Optional[tuple]:
        """The pipeline's own grade of the action just stepped (asked right after `step`; `truncated_at`: the
        token limit the reply was cut off at, else None): (score in [0, 10], why, whether the action failed
        its own goal), or None to leave it to the coach. Recorded in the coach request (`env_grade`); the
        offline heuristic coach takes it before its generic rules, for only the pipeline knows its goals."""
        return None

    def history_text(self, entries: Optional[list] = None) -> str:
        """Entries (all of this episode's by default) as the {history} text of a prompt."""
        entries = self.history if entries is None else entries
        if not entries:
            return "(nothing yet)"
        return "\n\n".join(
            f"### {e.agent} (action {e.turn + 1})\n{e.response.strip()}"
            + (f"\n\n#### Output of the code\n{e.feedback}" if e.feedback else "")
            for e in entries
        )


def returned_problem(hook: str, value) -> str:
    """What is wrong with `value` as the return of the environment hook `hook` ("" if nothing, or a hook not
    checked here: next_agents is rollout.check_round's). The rollout and team.play check each return where the
    hook is called, so that a wrong one is named with its hook, not read as something else further on (a
    judge's bare 0.0 as "no grade", a bare 0.5 as a TypeError inside the coach)."""
    if hook == "judge":
        grade = value if isinstance(value, tuple) and len(value) == 3 else (None, None, None)
        score, why, failed = grade
        if value is None or (isinstance(score, (int, float)) and not isinstance(score, bool)
                             and 0 <= score <= 10 and isinstance(why, str) and isinstance(failed, bool)):
            return ""
        return "expected None or a tuple (score: a number in [0, 10], why: str, failed: bool)"
    if hook == "step" and not (isinstance(value, StepResult) and isinstance(value.feedback, ToolFeedback)):
        return ("expected a StepResult(feedback: ToolFeedback, done: bool), e.g. super().step(agent, turn, "
                "response)")
    if hook == "observe" and not (isinstance(value, list) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value)):
        return "expected a non-empty list of chat messages {'role': str, 'content': str}"
    if hook == "outcome" and not (isinstance(value, dict) and isinstance(value.get("success"), bool)):
        return "expected a dict {'success': bool, ...}"
    if hook == "coach_ground_truth" and not (value is None or isinstance(value, str)):
        return "expected a str or None"
    if hook == "answer_formatted" and not (value is None or isinstance(value, bool)):
        return "expected True, False or None"
    if hook in ("task_type", "task_text") and not isinstance(value, str):
        return "expected a str"
    return ""


def load_tasks(spec: str, probs: Optional[str] = None, split: str = "train", *, input_key: str = "prompt",
               label_key: str = "answer", needs_answer: bool = True, seed: int = 42) -> list[dict]:
    """Tasks from what OpenRLHF's --data.prompt_dataset takes (a Hub name, a dataset folder, name@data_dir,
    .json/.jsonl/.csv/.parquet/.arrow files, several comma-separated, blended by `probs`), loaded by OpenRLHF's own
    blending_datasets: the task text in `input_key`, its answer in `label_key` (optional where not `needs_answer`),
    optionally "id" and "type"; other columns are kept for the environment."""
    entries = [entry.strip() for entry in spec.split(",")]
    for path in (entry.split("@")[0].strip() for entry in entries):
        # A missing local path is named now: blending_datasets would take it for a Hub name (and retry ~20 s).
        local = path.startswith(("/", ".", "~")) or path.lower().endswith((".json", ".jsonl", ".csv", ".parquet",
                                                                             ".arrow", ".py"))
        if local and not os.path.exists(path):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
    names = [e.split("@")[0].strip() for e in entries if not os.path.exists(e.split("@")[0].strip())]
    if names:
        # A name that is no local path goes to the Hub, whose client retries a Hub out of reach for ~30 s (a
        # folder not created yet reads as a dataset name): one plain request first says so at once.
        from huggingface_hub import constants, errors, get_session, is_offline_mode

        try:
            if not is_offline_mode():
                get_session().head(constants.ENDPOINT, timeout=constants.HF_HUB_ETAG_TIMEOUT)
        except (errors.HTTPError, OSError) as e:
            raise ValueError(f"{names[0]}: no local file or folder (relative to {os.getcwd()}), and the "
                             f"Hugging Face Hub ({constants.ENDPOINT}) could not be reached to look it up as "
                             f"a dataset name ({type(e).__name__}): check the path; a Hub dataset needs the "
                             f"network, or its copy in the cache and HF_HUB_OFFLINE=1") from e
    try:
        return _load_checked(spec, entries, probs, split, seed, input_key=input_key, label_key=label_key,
                             needs_answer=needs_answer)
    except Exception:
        # A blend's rows do not say which dataset they came from: each dataset loaded alone names its file and
        # row where one is at fault (a conflict between datasets stays the blend's error).
        if len(entries) > 1:
            for entry in entries:
                load_tasks(entry, None, split, input_key=input_key, label_key=label_key,
                           needs_answer=needs_answer, seed=seed)
        raise


def _load_checked(spec: str, entries: list, probs, split: str, seed: int, *, input_key: str, label_key: str,
                  needs_answer: bool) -> list[dict]:
    """load_tasks' rows of `spec` (its comma-separated `entries`), loaded by blending_datasets and checked."""
    # A local JSON file is read here first, for what HF's loader reports without a line (or not at all: a row that
    # is not an object); a lone one also gives each row its line (row) number, its id when it has none.
    located = [_read_json_rows(e) for e in entries if e.lower().endswith((".json", ".jsonl"))]
    for entry in entries:
        if entry.lower().endswith(".csv"):
            _check_csv_fields(entry)
    # OpenRLHF's blending_datasets, run from its file as openrlhf.utils.config is (cli/train_mappa_ray.py): its
    # package's __init__ loads torch and transformers, which the checks before a launch never import. Its
    # `strategy` prints (silenced here) and asks for ModelScope (OpenRLHF's --use_ms, refused).
    import importlib.util

    folder = importlib.util.find_spec("openrlhf.datasets").submodule_search_locations[0]
    module_spec = importlib.util.spec_from_file_location("_openrlhf_datasets_utils", os.path.join(folder, "utils.py"))
    upstream = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(upstream)
    strategy = SimpleNamespace(args=SimpleNamespace(use_ms=False), print=lambda *_: None, is_rank_0=lambda: False)
    try:
        data = upstream.blending_datasets(spec, probs, strategy, seed, dataset_split=split)
    except Exception as e:
        if isinstance(e, AttributeError) and "DatasetDict" in str(e):  # blending_datasets' select on the whole dict
            raise ValueError(f"{spec}: no split {split!r} (a data file's only split is 'train'); name one of its splits "
                             "with --data.prompt_split, or --eval.split for --eval.dataset") from e
        tried = "" if all(os.path.exists(entry.split("@")[0]) for entry in entries) else (
            " (a name that is no local file or folder is looked up on the Hugging Face Hub)")
        raise ValueError(f"{spec}: OpenRLHF's blending_datasets cannot load it{tried}: {type(e).__name__}: {e}") from e
    rows, columns = data.to_list(), data.column_names
    if len(entries) == len(located) == 1 and len(located[0]) == len(rows):
        places = [(where, default_id) for where, default_id, _ in located[0]]
    else:
        places = [(f"row {i} (counting from 0)", str(i)) for i in range(len(rows))]
    if not rows:
        raise ValueError(f"{spec}: no tasks in it (split {split!r})")
    # Grouping (--mappa.norm_scope group) and evaluation pool the samples of an id, so ids must be unique; a blend
    # that oversamples a dataset repeats its rows, which are kept. A row without an id takes its line (row) number,
    # or "line<n>" ("row<n>") where another row gives that id.
    given = {str(row["id"]) for row in rows if row.get("id") is not None}
    tasks, first = [], {}  # id -> (where it was first given, its row)
    for (where, default_id), row in zip(places, rows):
        if default_id in given:
            default_id = where.split()[0] + default_id
        task = _check_task(row, default_id, f"{spec}: {where}", columns, input_key=input_key,
                           label_key=label_key, needs_answer=needs_answer)
        if task["id"] in first and first[task["id"]][1] != row:
            raise ValueError(f"{spec}: {first[task['id']][0]} and {where} have the same id {task['id']!r}; give "
                             f"every task its own id")
        first.setdefault(task["id"], (where, row))
        tasks.append(task)
    return tasks


def _check_csv_fields(path: str) -> None:
    """Refuse a CSV row with more fields than the header, naming its line: pandas (HF's CSV loader) would take
    the row's first fields for an implicit index (`__index_level_0__`) and shift the rest, so that an unquoted
    comma in a task's text loads a wrong id and text without a word."""
    with open(path, encoding="utf-8-sig", errors="replace", newline="") as f:
        reader = csv.reader(f)
        header = next(reader, [])
        start = reader.line_num + 1  # the line a row starts on (a quoted field may hold line breaks)
        for row in reader:
            if len(row) > len(header):
                raise ValueError(f"{path}: line {start}: {len(row)} fields, but the header has {len(header)} "
                                 f"({','.join(header)}): put a field that holds a comma in double quotes, "
                                 f"e.g. \"A tag for Ana, who loves cake.\"")
            start = reader.line_num + 1


def _read_json_rows(path: str) -> list:
    """(where, default id, row) of each row of a JSON list or JSONL file (told apart by the first character);
    the file, line and byte named where it is not UTF-8, not JSON, or a row is no object."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark (some Windows editors write one) is not content
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(
            f"{path}: line {line}: byte 0x{data[e.start]:02x} is not UTF-8; save the file as UTF-8"
        ) from e
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: line {e.lineno}: broken JSON: {e.msg}") from e
        located = [(f"row {i} (counting from 0)", str(i), row) for i, row in enumerate(rows)]
    else:
        located = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                located.append((f"line {lineno}", str(lineno), json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path}: line {lineno}: broken JSON: {e.msg} (expected a JSON list, or one task "
                    "per line)"
                ) from e
    if not located:
        raise ValueError(f"{path}: no tasks in the file")
    for where, _, row in located:
        if not isinstance(row, dict):
            raise ValueError(f"{path}: {where}: a task must be a JSON object, got {type(row).__name__}")
    return located


def _check_task(row: dict, default_id: str, where: str, columns: list, *, input_key: str, label_key: str,
                needs_answer: bool) -> dict:
    """The task of one row, or one refusal naming each of the row's problems (a rule on a value's content asks
    for its type first, so that one wrong value is named once)."""
    prompt, answer, task_id = row.get(input_key), row.get(label_key), row.get("id")
    # A column the whole dataset lacks is likely another name for it: the dataset's columns and the flag are named.
    listed = f" (its columns: {', '.join(columns)}; name "
    prompt_hint = "" if input_key in columns else f"{listed}the task text's with --data.input_key COLUMN)"
    answer_hint = "" if label_key in columns else f"{listed}the answer's with --data.label_key COLUMN)"
    typed = isinstance(answer, (str, int, float)) and not isinstance(answer, bool)
    rules = (
        (prompt is None, f"missing {input_key!r}{prompt_hint}"),
        (prompt is not None and not isinstance(prompt, str),
         f"{input_key!r} must be a string, got {type(prompt).__name__}"),
        (isinstance(prompt, str) and not prompt.strip(), f"empty {input_key!r}"),
        (answer is None and needs_answer,
         f"{label_key!r} is missing or null{answer_hint}; these tasks need a reference answer (string or number)"),
        (answer is not None and not typed, f"{label_key!r} must be a string or a number, got {type(answer).__name__}"),
        (isinstance(answer, str) and not answer.strip(), f"empty {label_key!r}"),
        (isinstance(answer, float) and not math.isfinite(answer),  # JSON's NaN and Infinity: "nan", "inf"
         f"{label_key!r} is {answer}, not a finite number; write the reference answer"),
        (task_id is not None and (isinstance(task_id, bool) or not isinstance(task_id, (str, int, float))),
         f"'id' must be a string or a number, got {type(task_id).__name__}"),
    )
    problems = [f"{where}: {message}" for broken, message in rules if broken]
    if problems:
        raise ValueError("\n".join(problems))
    if answer is not None:
        answer = str(int(answer) if isinstance(answer, float) and answer.is_integer() else answer)  # 18.0 means 18
    return dict(row, prompt=prompt, answer=answer, id=str(default_id if task_id is None else task_id),
                type=row.get("type") or "")
