"""A team of agents, their order, their environment and the coach prompt, read from one YAML file. Everything
is checked on load, so a typo fails in the first second with a message naming the file and what to fix, not an
hour later inside a Ray worker. The bottom room: it imports nothing of the package, so the language a topology
is written in (template fields, the score key, LoRA ranks) is defined here, and the checks that need an
environment's class or a model (team.py) live above it."""

import logging
import operator
import os
import re
import string
from dataclasses import dataclass, field
from typing import Optional, Union

import yaml

logger = logging.getLogger(__name__)

AGENT_PROMPT_FIELDS = ("task", "history")
# The fields a coach prompt (coach_template) and a hindsight prompt (review_template) may name;
# coach.render_prompt and coach.render_review_prompt fill them.
PROMPT_FIELDS = (
    "task", "role", "agent", "turn", "round", "position", "task_type", "agent_input", "agent_output",
    "feedback", "ground_truth", "coach_bias",
)
REVIEW_FIELDS = ("task", "task_type", "trajectory", "outcome", "num_actions")
DEFAULT_SCORE_KEY = "PROCESS_SCORE"  # the authors' coach prompts ask for `PROCESS_SCORE: <0-10>`
SCORE_KEY_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
# The ranks vLLM's engines accept as max_lora_rank (a larger adapter is refused; placement sizes pools by
# them).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Agent names become parts of checkpoint paths and metric keys.
AGENT_NAME_RE = re.compile(r"[A-Za-z0-9_-]+")
# A switch rule of coach_templates: `<metric> <op> <number>`, the metric a key of metrics.jsonl or `step`.
SWITCH_RULE_RE = re.compile(r"\s*(\S+)\s*(<=|>=|<|>)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*")
SWITCH_OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}
SWITCH_NAMESPACES = (
    "step", "agent/<agent>/<metric>", "outcome/success_rate", "coach/<metric>", "coach_bias/<...>",
)
# The per-agent keys a step logs (run_log.step_metrics, run_log.behaviour_metrics; tests/test_criteria.py
# checks them): a rule on any other agent key would never fire.
AGENT_METRICS = tuple(
    "coach_score outcome_success truncated_left_out trained_actions dropped_for_batching zero_loss_rows "
    "optimizer_steps updated kl kl_coef "
    "policy_loss logprob_mismatch_abs logprob_mismatch_kl filtered_actions dynamic_filtering_pass_rate "
    "staleness_mean staleness_max stale_left_out "
    "actor_lr actor_grad_norm ppo_clip_ratio num_actions action_length tool_use_rate tool_error_rate "
    "code_error_rate truncated_rate prompt_truncated prompt_too_long_skipped answer_format_rate sync_mib "
    "full_sync_mib".split()
)


@dataclass(frozen=True)
class View:
    """Which actions of OTHER agents an agent sees (MultiAgentEnv.observe: those before its first action in
    its prompt's {history}, later ones after its own turns). YAML: `view: all | previous | [names]`, or a
    mapping."""

    # "all", or a tuple of agent names ("previous" is resolved when the file loads)
    agents: Union[str, tuple] = "all"
    actions: str = "all"  # "last": each agent's final reply (and, with tool_output, its latest code run) only
    tool_output: bool = True  # show what their code printed
    # Drop their reasoning: true as the authors (<think>...</think> blocks, then stray tags: a reply cut off
    # in its reasoning keeps it); "answer": only what follows the last </think> (cut off in its reasoning:
    # nothing).
    strip_thinking: Union[bool, str] = False


@dataclass(frozen=True)
class CoachStage:
    """One coach template of a criteria schedule (coach_templates) and the rule `metric op threshold` on a
    step's logged metrics that switches to it after that step (None for the first stage)."""

    name: str
    template: str
    metric: Optional[str] = None  # a metrics.jsonl key, or "step"
    op: Optional[str] = None  # <, <=, > or >=
    threshold: Optional[float] = None

    def holds(self, value) -> bool:
        """Whether the rule holds for a logged value; a missing value (None, NaN) never switches."""
        return _number(value) and value == value and SWITCH_OPS[self.op](value, self.threshold)

    @property
    def when(self) -> str:
        return f"{self.metric} {self.op} {self.threshold:g}"


@dataclass(frozen=True)
class Lora:
    """An agent's LoRA adapter (key `lora`), trained on a frozen base that is its reference with the adapter
    off; it generates on its pool's engines, which serve the base once and each member's adapter by
    request."""

    rank: int
    alpha: float  # peft's scaling is alpha / rank
    target_modules: tuple = ("all-linear",)  # module names (q_proj, ...) or peft's "all-linear"
    dropout: float = 0.0
    pool: Optional[str] = None  # engine pool; None: one pool per base model, shared by its LoRA agents


@dataclass
class AgentSpec:
    name: str
    model: str  # HF hub id or local directory
    role: str  # what this agent is for; shown to the coach (and usable in the agent's own prompt)
    prompt: str  # str.format template of the agent's user message; fields: task, history
    max_actions: int = 1
    runs_code: bool = False
    system: str = ""  # optional system message
    # Per-agent overrides of the run-wide flags (None: use the command-line value).
    num_gpus_per_node: Optional[int] = None
    vllm_num_engines: Optional[int] = None
    max_new_tokens: Optional[int] = None
    ring_attn_size: Optional[int] = None
    tensor_parallel_size: Optional[int] = None
    lr: Optional[float] = None  # the trained coach's --mappa.coach.lr (not a topology key)
    view: View = field(default_factory=View)
    lora: Optional[Lora] = None

    # The environment's hooks get the acting agent's AgentSpec, and `agent == "planner"` is what one writes: a
    # str compares with the name (hashed by it too, so `agent in {"planner"}` agrees); two AgentSpecs compare
    # every field, as the dataclass did.
    def __eq__(self, other) -> bool:
        if isinstance(other, str):
            return self.name == other
        return vars(self) == vars(other) if isinstance(other, AgentSpec) else NotImplemented

    def __hash__(self) -> int:
        return hash(self.name)

    @property
    def pool(self) -> Optional[str]:
        """The engine pool of a LoRA agent (its base model unless named), None for a full-weights agent."""
        return None if self.lora is None else self.lora.pool or self.model


@dataclass
class Topology:
    name: str
    env: str  # "package.module:Class", or a built-in short name such as "mathchat"
    agents: list  # list[AgentSpec]; in the order they act, unless the env's next_agents decides otherwise
    # str.format template, fields PROMPT_FIELDS (with coach_templates: the first's); None only where no coach
    # is sent it (check_coach_template).
    coach_template: Optional[str]
    env_kwargs: dict = field(default_factory=dict)  # extra keyword arguments of the env's constructor
    # a text reply of the coach states its score on a line `<score_key>: <n>`
    score_key: str = DEFAULT_SCORE_KEY
    # every reward is multiplied by it (coach score and outcome alike; see rewards.py)
    reward_scale: float = 1.0
    # coach_templates' stages in order; empty: coach_template
    coach_stages: list = field(default_factory=list)
    max_episode_actions: Optional[int] = None  # None: the max_actions summed; past it, stopped as a failure
    review_template: Optional[str] = None  # hindsight prompt (fields: REVIEW_FIELDS); None: the default
    # appended to every task's text, as the agents (not DSBench's), coach and eval see it
    problem_suffix: str = ""
    # An agent's own earlier replies as generated, <think> included (the authors'); False: as its chat
    # template renders them (Qwen3's drops the reasoning of turns before the last user message).
    keep_reasoning: bool = True
    # What the coach is shown of an action: "authors" the output as generated (not told it was cut off) and
    # the first COACH_TOOL_CHARS characters of its code's output; "ours" adds the cut-off marker and shows the
    # code's output as the agent saw it (4,000 characters a stream, the workspace's files).
    coach_input: str = "authors"
    batch_strata: Optional[str] = None  # a task-row column: each batch keeps its values' shares (pass_order)
    # the env's class, resolved by team.load_topology
    env_cls: Optional[type] = field(default=None, repr=False)

    def check_coach_template(self, path: str, kind: str, mode: str, scored: bool = True) -> None:
        """Refuse a missing coach_template where a coach is sent it: an openai coach asked per action (mode
        per_action or both) in a run that asks it at all (`scored`: not an outcome baseline). Hindsight sends
        review_template alone; the heuristic coach reads no prompt."""
        if self.coach_template is None and kind == "openai" and mode != "hindsight" and scored:
            raise ValueError(f"{path}: {MISSING_COACH_TEMPLATE}: coach mode {mode} sends it to the coach with every "
                             f"action (mode hindsight needs none: it sends one review prompt per episode, "
                             f"review_template)")

    def make_env(self, task: dict, workspace: str):
        """One environment instance for one episode (task is one row of load_tasks)."""
        return self.env_cls(self, task, workspace, **self.env_kwargs)

    def check_env(self, tasks: list, label: str) -> None:
        """Build the env once per task type (its first task, a scratch workspace): env_kwargs it rejects (a
        wrong type, a goal that is no regex) are refused with its message before a run, not in the first
        rollout."""
        import tempfile

        first = {}
        for task in tasks:
            first.setdefault(task.get("type", ""), task)
        for task in first.values():
            with tempfile.TemporaryDirectory(prefix="mappa-env-check-") as workspace:
                try:
                    self.make_env(task, workspace)
                except Exception as e:  # any exception: the environment's own message says what to fix
                    kwargs = ", ".join(self.env_kwargs) or "none"
                    which = f"the first of type {task['type']!r}" if task.get("type") else "the first task"
                    raise ValueError(f"{label}: env {self.env!r} (env_kwargs: {kwargs}) cannot start task "
                                     f"{task['id']!r}, {which}: {type(e).__name__}: {e}") from e


MISSING_COACH_TEMPLATE = ("'coach_template' is missing or empty; it must be a non-empty string (or give "
                          "coach_templates)")


# The tests of the schema's values. Python counts YAML's true as the integer 1, so no number test takes a
# bool.
def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _positive(value) -> bool:
    return _number(value) and 0 < value < float("inf")


def _text(value) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _word(value) -> bool:
    return isinstance(value, str) and bool(AGENT_NAME_RE.fullmatch(value))


def _modules(value) -> bool:
    names = [value] if isinstance(value, str) else value
    return isinstance(names, list) and bool(names) and all(map(_text, names))


# The schema: one table per mapping of the YAML, a row per key (key, what its value must be, its type or a
# test, its default), in the order the messages list the keys. REQUIRED: no default. A test of None: parsed by
# hand after the table (sub-mappings, cross-field rules). null is accepted, as the default, where the default
# is None.
REQUIRED = object()
WORD = "a word of letters, digits, '_' and '-'"
TOPOLOGY_SCHEMA = (
    ("name", None, None, None),
    ("env", "a non-empty string", _text, REQUIRED),
    ("agents", None, None, None),
    ("coach_template", "a non-empty string (or give coach_templates)", _text, None),
    ("coach_templates", None, None, None),
    ("env_kwargs", "a mapping of keyword arguments for the environment", dict, None),
    ("score_key", "a word of letters, digits and '_' starting with a letter",
     lambda v: isinstance(v, str) and bool(SCORE_KEY_RE.fullmatch(v)), DEFAULT_SCORE_KEY),
    ("reward_scale", "a positive number (1.0: coach scores as given)", _positive, 1.0),
    ("max_episode_actions", "an integer >= 1 or left out (the sum of the agents' max_actions)", _count, None),
    ("review_template", "a non-empty string (or left out for the default hindsight prompt)", _text, None),
    ("problem_suffix", "a string (text added after every task)", str, ""),
    ("keep_reasoning", "true (an agent's earlier replies as generated, reasoning included) or false "
     "(as its chat template renders them)", bool, True),
    ("coach_input", "authors (the output as generated, the first 2,000 characters of its code's output) or "
     "ours (a cut-off output marked, the code's output as the agent saw it, files listed)",
     lambda v: v in ("authors", "ours"), "authors"),
    ("batch_strata", "a column of the task rows (each step's batch keeps its values' shares, as the authors' "
     "StratifiedBatchSampler) or left out (one shuffle per pass)", _text, None),
)
OVERRIDE = "a positive integer or left out"
AGENT_SCHEMA = (
    ("name", f"{WORD} (names become paths and metric keys)", _word, REQUIRED),
    ("model", "a non-empty string (or pass a model override)", _text, REQUIRED),
    ("role", "a non-empty string", _text, REQUIRED),
    ("prompt", "a non-empty string", _text, REQUIRED),
    ("max_actions", "an integer >= 1", _count, 1),
    ("runs_code", "true or false", bool, False),
    ("system", "a string", str, ""),
    ("num_gpus_per_node", OVERRIDE, _count, None),
    ("vllm_num_engines", OVERRIDE, _count, None),
    ("max_new_tokens", OVERRIDE, _count, None),
    ("ring_attn_size", OVERRIDE, _count, None),
    ("tensor_parallel_size", OVERRIDE, _count, None),
    ("view", None, None, "all"),
    ("lora", None, None, None),
)
LORA_SCHEMA = (
    ("rank", "an integer >= 1", _count, REQUIRED),
    ("alpha", "a positive number (the update is scaled by alpha / rank)", _positive, None),
    ("target_modules", "all-linear or a list of module names such as [q_proj, v_proj]", _modules,
     "all-linear"),
    ("dropout", "a number in [0, 1)", lambda v: _number(v) and 0 <= v < 1, 0.0),
    ("pool", WORD, _word, None),
)
VIEW_SCHEMA = (
    ("agents", None, None, "all"),
    ("actions", "all or last", lambda v: v in ("all", "last"), "all"),
    ("tool_output", "true or false", bool, True),
    ("strip_thinking", "false, true (the authors': <think> blocks and stray tags removed) or answer (only "
     "what follows the last </think>)", lambda v: isinstance(v, bool) or v == "answer", False),
)
STAGE_SCHEMA = (
    ("name", WORD, _word, REQUIRED),
    ("template", "a non-empty string", _text, REQUIRED),
    ("when", None, None, None),
)
TOPOLOGY_KEYS = tuple(row[0] for row in TOPOLOGY_SCHEMA)
AGENT_KEYS = tuple(row[0] for row in AGENT_SCHEMA)


def _read(raw: dict, schema: tuple, label: str, problems: list, allowed: str = "allowed",
          keys_label: Optional[str] = None) -> Optional[dict]:
    """One mapping checked against its schema table: an unknown key refused with the allowed ones (named with
    `keys_label`, default `label`), a required key missing or blank, a value its test rejects with what it
    must be; a key left out gets its default. Its problems go to `problems`, and its values come back only
    where it has none: the rules that read them may assume them valid."""
    before = len(problems)
    values = {}
    for key, what, test, default in schema:
        value = values[key] = raw.get(key, default)
        # null: left out
        checked = test is not None and key in raw and not (value is None and default is None)
        if value is REQUIRED or (default is REQUIRED and isinstance(value, str) and not value.strip()):
            problems.append(f"{label}'{key}' is missing or empty; it must be {what}")
        elif checked and not (isinstance(value, test) if isinstance(test, type) else test(value)):
            problems.append(f"{label}'{key}' must be {what}, got {value!r}")
    unknown = sorted(set(raw) - set(values))  # values: every key of the schema, in order
    if unknown:  # named before the values' problems
        problems.insert(
            before, f"{keys_label or label}unknown key(s) {unknown}; {allowed}: {', '.join(values)}"
        )
    return values if len(problems) == before else None


def _template_problems(template: str, allowed: tuple, label: str) -> list:
    """The first field str.format would not fill, or the template's broken braces (none: [])."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template)]
    except ValueError as e:
        return [f"{label}: broken template ({e}); write {{{{ and }}}} for literal braces"]
    for name in fields:
        if name is not None and name not in allowed:
            return [f"{label}: unknown field {{{name}}}; allowed fields: {', '.join(allowed)} "
                    "(write {{ and }} for literal braces, e.g. \\boxed{{}})"]
    return []


def check_template(template: str, allowed: tuple, label: str) -> None:
    """Reject fields str.format would not fill, where a template is loaded (the topology, a tool's template
    file): a bad template would otherwise fail mid-rollout."""
    problems = _template_problems(template, allowed, label)
    if problems:
        raise ValueError(problems[0])


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML silently keeps the last, so a
    second `max_actions:` would replace the first). Merge keys (<<) may still override."""

    def construct_mapping(self, node, deep=False):
        first = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if (key_node.tag == "tag:yaml.org,2002:merge"
                    or not isinstance(key, (str, int, float, bool, type(None)))):
                continue
            line = key_node.start_mark.line + 1
            if key in first:
                raise ValueError(
                    f"line {line}: duplicate key {key!r} (first on line {first[key]}): a mapping takes "
                    f"each key once; keep one of them"
                )
            first[key] = line
        return super().construct_mapping(node, deep)


def read_topology(path: str, model_override: Optional[str] = None) -> Topology:
    """Read and validate a topology YAML, apart from its environment (team.load_topology checks that and is
    what a run calls). `model_override` replaces every agent's model (tests, demos). Every problem found is
    named in one refusal, a line each; the rules that read a value run only once it passed its own checks."""
    with open(path, encoding="utf-8") as f:
        try:
            raw = yaml.load(f, Loader=UniqueKeyLoader)
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not valid YAML: {e}") from e
        except ValueError as e:  # UniqueKeyLoader's
            raise ValueError(f"{path}: {e}") from None
    if not isinstance(raw, dict):  # nothing else can be read
        raise ValueError(f"{path}: expected a mapping with keys " + ", ".join(TOPOLOGY_KEYS))
    problems = []
    top = _read_top(raw, model_override, problems)
    if problems:  # every check names what is wrong; the file is named here
        raise ValueError("\n".join(f"{path}: {problem}" for problem in problems))
    templates = [(f"coach_templates[{s.name!r}]", s.template) for s in top["coach_stages"]]
    if top["coach_template"]:
        templates.append(("coach_template", top["coach_template"]))
    for label, template in templates:
        if top["score_key"].lower() not in template.lower():
            # Not an error (JSON-schema output needs no such line), but a text coach not told the key states
            # its score some other way, and each such verdict costs a re-prompt or fails.
            logger.warning("%s: %s never names the score key %s; ask for a last line `%s: <0-10>` "
                           "or set score_key to the key it asks for", path, label, top["score_key"],
                           top["score_key"])
    if top["coach_stages"]:
        top["coach_template"] = top["coach_stages"][0].template
    top["name"] = str(top["name"] or os.path.splitext(os.path.basename(path))[0])
    top.update(env_kwargs=top["env_kwargs"] or {}, reward_scale=float(top["reward_scale"]))
    return Topology(**top)


def _read_top(raw: dict, model_override: Optional[str], problems: list) -> Optional[dict]:
    """The top-level mapping, its agents and its coach schedule, each checked alone, then the rules across
    keys: one coach prompt or a schedule, the templates' fields, the suffix."""
    top = _read(raw, TOPOLOGY_SCHEMA, "", problems, "allowed top-level keys")
    agents = _parse_agents(raw.get("agents"), model_override, problems)
    if top is None or agents is None:
        return None
    rows = top.pop("coach_templates")
    top["agents"] = agents
    top["coach_stages"] = [] if rows is None else _parse_stages(rows, [a.name for a in agents], problems)
    if rows is not None and top["coach_template"] is not None:
        problems.append(
            "give either 'coach_template' (one coach prompt) or 'coach_templates' (prompts that take "
            "over in turn, each after a switch rule), not both"
        )
    # Left out, coach_template is refused only where a coach is sent it (check_coach_template): the file is
    # read apart from the flags that say whether any coach reads it.
    for key, fields in (("coach_template", PROMPT_FIELDS), ("review_template", REVIEW_FIELDS)):
        if top[key] is not None:
            problems += _template_problems(top[key], fields, key)
    # In a double-quoted YAML string "\boxed" is a backspace and "oxed": refuse control characters other than
    # newlines and tabs, which no prompt means to send.
    odd = sorted({c for c in top["problem_suffix"] if ord(c) < 32 and c not in "\n\t"})
    if odd:
        problems.append(f"'problem_suffix' holds the control character(s) {', '.join(map(repr, odd))}; in a "
                        f"double-quoted YAML string a backslash is written \\\\ (\"\\\\boxed{{}}\")")
    return top


def _parse_agents(rows, model_override: Optional[str], problems: list) -> Optional[list]:
    """The agents in order, each checked alone, then together: distinct names, LoRA pools, and views naming
    only agents that exist. None where one is unreadable (the rules across agents need every name)."""
    if not isinstance(rows, list) or not rows:
        problems.append(
            "'agents' must be a non-empty list; each agent needs at least name, model, role and prompt"
        )
        return None
    agents = [_parse_agent(row, i, model_override, problems) for i, row in enumerate(rows)]
    if None in agents:
        return None
    names = [a.name for a in agents]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        problems.append(f"agent name(s) {duplicated} used more than once; every agent needs its own name")
    _check_pools(agents, problems)
    for i, (agent, row) in enumerate(zip(agents, rows)):
        agent.view = _parse_view(row.get("view", "all"), names, i, problems)
    return agents


def _parse_agent(row, index: int, model_override: Optional[str], problems: list) -> Optional[AgentSpec]:
    if not isinstance(row, dict):
        problems.append(f"agents[{index}] must be a mapping with keys {', '.join(AGENT_KEYS)}")
        return None
    label = f"agent {row.get('name', index)!r}"
    if model_override:
        row = dict(row, model=model_override)
    values = _read(row, AGENT_SCHEMA, f"{label}: ", problems, "allowed agent keys")
    if values is None:
        return None
    values["model"] = os.path.expanduser(values["model"])  # checked by team.check_model, before a run starts
    problems += _template_problems(values["prompt"], AGENT_PROMPT_FIELDS, f"{label}: prompt")
    del values["view"]  # checked once every agent's name is known (_parse_view)
    if values["lora"] is not None:
        values["lora"] = _parse_lora(values["lora"], label, problems)
    return AgentSpec(**values)


def _parse_lora(raw, label: str, problems: list) -> Optional[Lora]:
    label += ": lora"
    if not isinstance(raw, dict):
        keys = ", ".join(row[0] for row in LORA_SCHEMA)
        problems.append(f"{label} must be a mapping with keys {keys} (rank is required)")
        return None
    lora = _read(raw, LORA_SCHEMA, f"{label}: ", problems)
    if lora is None:
        return None
    targets = lora["target_modules"]
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    if lora["rank"] > VLLM_LORA_RANKS[-1]:
        problems.append(
            f"{label}: rank {lora['rank']} is larger than vLLM's engines serve (max_lora_rank at most "
            f"{VLLM_LORA_RANKS[-1]})"
        )
    if "all-linear" in targets and len(targets) > 1:
        problems.append(f"{label}: 'target_modules' is either all-linear or a list of module names, not both")
    return Lora(
        lora["rank"], float(lora["alpha"] or 2 * lora["rank"]), targets, float(lora["dropout"]), lora["pool"]
    )


def _check_pools(agents: list, problems: list) -> None:
    """The agents of one LoRA engine pool share what an engine has only one of: its base model and engine
    count."""
    pools = {}
    for a in agents:
        if a.lora is not None:
            pools.setdefault(a.pool, []).append(a)
    for pool, members in pools.items():
        for key, what in (("model", "base model"), ("vllm_num_engines", "vllm_num_engines")):
            values = {getattr(a, key) for a in members}
            if len(values) > 1:
                listed = ", ".join(f"{a.name} ({getattr(a, key)})" for a in members)
                problems.append(
                    f"LoRA engine pool {pool!r}: its agents differ in {what}: {listed}. One pool's "
                    f"engines serve one base model with every member's adapter; give them the same "
                    f"{what}, or different lora.pool names"
                )


def _parse_view(raw, names: list, index: int, problems: list) -> Optional[View]:
    """An agent's view, its names checked (whether they act before it depends on the env:
    team.load_topology)."""
    label = f"agent {names[index]!r}: view"
    view = _read(raw if isinstance(raw, dict) else {"agents": raw}, VIEW_SCHEMA, f"{label}: ", problems)
    if view is None:
        return None
    agents = view["agents"]
    if agents == "previous" and index == 0:
        problems.append(
            f"{label}: 'previous' names nobody: this is the first agent (write [] to show no other agent)"
        )
    elif agents == "previous":
        agents = (names[index - 1],)
    elif agents != "all" and (not isinstance(agents, list) or not all(isinstance(a, str) for a in agents)):
        problems.append(f"{label}: 'agents' must be all, previous or a list of agent names, got {agents!r}")
    elif agents != "all":
        agents = tuple(agents)
        for a in agents:
            if a not in names:
                problems.append(f"{label}: unknown agent {a!r}; the agents are {', '.join(names)}")
            elif a == names[index]:
                problems.append(
                    f"{label}: names the agent itself; its own earlier actions are always shown to it"
                )
    return View(agents, view["actions"], view["tool_output"], view["strip_thinking"])


def _parse_stages(rows, agent_names: list, problems: list) -> list:
    """coach_templates: a list of {name, template, when}; the first stage starts, each later one takes over
    after the first step whose metrics satisfy its `when` (checked only while the stage before it is in
    use)."""
    if not isinstance(rows, list) or len(rows) < 2:
        problems.append("'coach_templates' must be a list of at least two stages {name, template, when} (one "
                        "template: use coach_template)")
        return []
    stages = []
    for i, row in enumerate(rows):
        label = f"coach_templates[{i}]"
        if not isinstance(row, dict):
            problems.append(f"{label} must be a mapping with keys {', '.join(r[0] for r in STAGE_SCHEMA)}")
            continue
        named = f"{label} ({row['name']})" if _word(row.get("name")) else label  # named in what follows
        stage = _read(row, STAGE_SCHEMA, f"{named}: ", problems, keys_label=f"{label}: ")
        if stage is None:
            continue
        name, template, when = stage.values()
        if name in [s.name for s in stages]:
            problems.append(f"{label}: the name {name!r} is used twice; every stage needs its own name")
        problems += _template_problems(template, PROMPT_FIELDS, f"{named}: template")
        rule = SWITCH_RULE_RE.fullmatch(when) if isinstance(when, str) else None
        if i == 0 and when is not None:
            problems.append(
                f"{named}: the first stage is in use from step 1; a 'when' belongs to the stages after it"
            )
        elif i > 0 and not isinstance(when, str):
            problems.append(f"{named}: 'when' must be a switch rule '<metric> <op> <number>', e.g. "
                            f"'agent/{agent_names[-1]}/code_error_rate < 0.2' or 'step >= 50'")
        elif i > 0 and not rule:
            problems.append(
                f"{named}: when {when!r} is not '<metric> <op> <number>' with op one of <, <=, >, >= "
                f"(e.g. 'outcome/success_rate >= 0.5' or 'step >= 50')"
            )
        elif i > 0:
            _check_switch_metric(rule.group(1), agent_names, f"{named}: when {when!r}", problems)
        switch = (rule.group(1), rule.group(2), float(rule.group(3))) if rule and i > 0 else ()
        stages.append(CoachStage(name, template, *switch))
    return stages


def _check_switch_metric(metric: str, agent_names: list, label: str, problems: list) -> None:
    """A rule's metric must be one a step logs: a rule on a misspelt key would wait forever, silently."""
    parts = metric.split("/")
    namespaced = parts[0] in ("coach", "coach_bias") and len(parts) >= 2 and all(parts)  # coach/<metric>, ...
    if metric in ("step", "outcome/success_rate") or namespaced:
        return
    if parts[0] != "agent" or len(parts) != 3:
        problems.append(
            f"{label}: unknown metric name {metric!r}; a rule reads one of: {', '.join(SWITCH_NAMESPACES)}"
        )
        return
    if parts[1] not in agent_names:
        problems.append(f"{label}: unknown agent {parts[1]!r}; the agents are {', '.join(agent_names)}")
    if parts[2] not in AGENT_METRICS:
        problems.append(
            f"{label}: agents log no metric {parts[2]!r}; per-agent metrics: {', '.join(AGENT_METRICS)}"
        )
