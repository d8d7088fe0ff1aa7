"""A team of agents, their order, their environment and the coach prompt, read from one YAML file. Everything is
checked on load, so a typo fails in the first second with a message naming the file and what to fix, not an hour
later inside a Ray worker."""

import dataclasses
import difflib
import inspect
import logging
import operator
import os
import re
import string
from dataclasses import dataclass, field
from typing import Optional, Union

import yaml

from openrlhf_mappa import placement
from openrlhf_mappa.coach.base import DEFAULT_SCORE_KEY, PROMPT_FIELDS, REVIEW_FIELDS, SCORE_KEY_RE
from openrlhf_mappa.envs import load_env_class

logger = logging.getLogger(__name__)

AGENT_PROMPT_FIELDS = ("task", "history")
# Agent names become parts of checkpoint paths and metric keys.
AGENT_NAME_RE = re.compile(r"[A-Za-z0-9_-]+")
VIEW_KEYS = ("agents", "actions", "tool_output", "strip_thinking")
STAGE_KEYS = ("name", "template", "when")
# A switch rule of coach_templates: `<metric> <op> <number>`, the metric a key of metrics.jsonl or `step`.
SWITCH_RULE_RE = re.compile(r"\s*(\S+)\s*(<=|>=|<|>)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*")
SWITCH_OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}
SWITCH_NAMESPACES = ("step", "agent/<agent>/<metric>", "outcome/success_rate", "coach/<metric>", "coach_bias/<...>")
# The per-agent keys a step logs (run_log.step_metrics, evaluation.behaviour_metrics; tests/test_criteria.py
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
    """Which earlier actions of OTHER agents an agent's {history} shows (its own always follow its prompt as chat
    turns, as the authors' agents saw them). YAML: `view: all | previous | [names]`, or a mapping of these."""

    agents: Union[str, tuple] = "all"  # "all", or a tuple of agent names ("previous" is resolved when the file loads)
    actions: str = "all"  # "last": each agent's final reply (and, with tool_output, its latest code run) only
    tool_output: bool = True  # show what their code printed
    strip_thinking: bool = False  # drop <think>...</think> from their replies


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
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
            return False
        return SWITCH_OPS[self.op](value, self.threshold)

    @property
    def when(self) -> str:
        return f"{self.metric} {self.op} {self.threshold:g}"


LORA_KEYS = ("rank", "alpha", "target_modules", "dropout", "pool")


@dataclass(frozen=True)
class Lora:
    """An agent's LoRA adapter (key `lora`), trained on a frozen base that is its reference with the adapter off;
    it generates on its pool's engines, which serve the base once and each member's adapter by request."""

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

    @property
    def pool(self) -> Optional[str]:
        """The engine pool of a LoRA agent (its base model unless named), None for a full-weights agent."""
        return None if self.lora is None else self.lora.pool or self.model


@dataclass
class Topology:
    name: str
    env: str  # "package.module:Class", or a built-in short name such as "mathchat"
    agents: list  # list[AgentSpec]; in the order they act, unless the env's next_agents decides otherwise
    # str.format template, fields PROMPT_FIELDS (with coach_templates: the first's); None only where no coach is
    # sent it (check_coach_template).
    coach_template: Optional[str]
    env_kwargs: dict = field(default_factory=dict)  # extra keyword arguments of the env's constructor
    score_key: str = DEFAULT_SCORE_KEY  # a text reply of the coach states its score on a line `<score_key>: <n>`
    reward_scale: float = 1.0  # every reward is multiplied by it (coach score and outcome alike; see rewards.py)
    coach_stages: list = field(default_factory=list)  # coach_templates' stages in order; empty: coach_template
    max_episode_actions: Optional[int] = None  # None: the max_actions summed; past it, stopped as a failure
    review_template: Optional[str] = None  # hindsight prompt (fields: coach.REVIEW_FIELDS); None: the default
    problem_suffix: str = ""  # appended to every task's text, as the agents, the coach and evaluation see it
    # An agent's own earlier replies as generated, <think> included (the authors'); False: as its chat template
    # renders them (Qwen3's drops the reasoning of turns before the last user message).
    keep_reasoning: bool = True

    def check_coach_template(self, path: str, kind: str, mode: str, scored: bool = True) -> None:
        """Refuse a missing coach_template where a coach is sent it: an openai coach asked per action (mode
        per_action or both) in a run that asks it at all (`scored`: not an outcome baseline). Hindsight sends
        review_template alone; the heuristic coach reads no prompt."""
        if self.coach_template is None and kind == "openai" and mode != "hindsight" and scored:
            raise ValueError(f"{path}: {MISSING_COACH_TEMPLATE}: coach mode {mode} sends it to the coach with every "
                             f"action (mode hindsight needs none: it sends one review prompt per episode, "
                             f"review_template)")

    def most_actions(self, spec, shared_policy: bool = False) -> int:
        """The most actions `spec`'s weights take in one episode (under --mappa.shared_policy, every role's)."""
        n = sum(a.max_actions for a in self.agents) if shared_policy else spec.max_actions
        return min(n, self.max_episode_actions or n)

    def env_class(self) -> type:
        return load_env_class(self.env)

    def make_env(self, task: dict, workspace: str):
        """One environment instance for one episode (task is one row of load_tasks)."""
        return self.env_class()(self, task, workspace, **self.env_kwargs)

    def check_env(self, tasks: list, label: str) -> None:
        """Build the env once per task type (its first task, a scratch workspace): env_kwargs it rejects (a wrong
        type, a goal that is no regex) are refused with its message before a run, not in the first rollout."""
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
                    raise ValueError(f"{label}: env {self.env!r} (env_kwargs: {kwargs}) cannot start task "
                                     f"{task['id']!r}, the first of type {task.get('type')!r}: {type(e).__name__}: "
                                     f"{e}") from e


MISSING_COACH_TEMPLATE = ("'coach_template' is missing or empty; it must be a non-empty string (or give "
                          "coach_templates)")
TOPOLOGY_KEYS = ("name", "env", "agents", "coach_template", "coach_templates", "env_kwargs", "score_key",
                 "reward_scale", "max_episode_actions", "review_template", "problem_suffix", "keep_reasoning")
AGENT_KEYS = tuple(f.name for f in dataclasses.fields(AgentSpec) if f.name != "lr")  # lr: the trained coach's


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML silently keeps the last, so a second
    `max_actions:` would replace the first). Merge keys (<<) may still override."""

    def construct_mapping(self, node, deep=False):
        first = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key, (str, int, float, bool, type(None))):
                continue
            line = key_node.start_mark.line + 1
            if key in first:
                raise ValueError(f"line {line}: duplicate key {key!r} (first on line {first[key]}): a mapping takes "
                                 f"each key once; keep one of them")
            first[key] = line
        return super().construct_mapping(node, deep)


def load_topology(path: str, model_override: Optional[str] = None) -> Topology:
    """Read and validate a topology YAML. `model_override` replaces every agent's model (tests, demos)."""
    with open(path, encoding="utf-8") as f:
        try:
            raw = yaml.load(f, Loader=UniqueKeyLoader)
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not valid YAML: {e}") from e
        except ValueError as e:  # UniqueKeyLoader's
            raise ValueError(f"{path}: {e}") from None

    def fail(msg):
        raise ValueError(f"{path}: {msg}")

    if not isinstance(raw, dict):
        fail("expected a mapping with keys " + ", ".join(TOPOLOGY_KEYS))
    _check_keys(raw, TOPOLOGY_KEYS, "", fail, "allowed top-level keys")
    team = _parse_team_keys(raw, fail)
    try:
        env_cls = load_env_class(raw["env"])
    except ValueError as e:
        fail(str(e))
    agents = _parse_agents(raw.get("agents"), env_cls, model_override, fail)
    stages = _parse_stages(raw["coach_templates"], [a.name for a in agents], fail) if "coach_templates" in raw else []
    templates = [(f"coach_templates[{s.name!r}]", s.template) for s in stages]
    if team["coach_template"]:
        templates.append(("coach_template", team["coach_template"]))
    for label, template in templates:
        if team["score_key"].lower() not in template.lower():
            # Not an error (JSON-schema output needs no such line), but a text coach not told the key states its
            # score some other way, and each such verdict costs a re-prompt or fails.
            logger.warning("%s: %s never names the score key %s; ask for a last line `%s: <0-10>` "
                           "or set score_key to the key it asks for", path, label, team["score_key"], team["score_key"])
    if stages:
        team["coach_template"] = stages[0].template
    topology = Topology(name=str(raw.get("name") or os.path.splitext(os.path.basename(path))[0]), agents=agents,
                        coach_stages=stages, **team)
    _check_env_kwargs(env_cls, topology, fail)
    return topology


def _parse_team_keys(raw: dict, fail) -> dict:
    """The top-level keys other than name, agents and coach_templates, checked, as Topology's fields."""
    if not isinstance(raw.get("env"), str) or not raw["env"].strip():
        fail("'env' is missing or empty; it must be a non-empty string")
    if "coach_templates" in raw and "coach_template" in raw:
        fail("give either 'coach_template' (one coach prompt) or 'coach_templates' (prompts that take over in "
             "turn, each after a switch rule), not both")
    # Left out, it is refused only where a coach is sent it (check_coach_template): the file is read apart from
    # the flags that say whether any coach reads it.
    if "coach_template" in raw:
        if not isinstance(raw["coach_template"], str) or not raw["coach_template"].strip():
            fail(MISSING_COACH_TEMPLATE)
        _check_template(raw["coach_template"], PROMPT_FIELDS, "coach_template", fail)
    score_key = raw.get("score_key", DEFAULT_SCORE_KEY)
    if not isinstance(score_key, str) or not SCORE_KEY_RE.fullmatch(score_key):
        fail(f"'score_key' must be a word of letters, digits and '_' starting with a letter, got {score_key!r}")
    review_template = raw.get("review_template")
    if review_template is not None:
        if not isinstance(review_template, str) or not review_template.strip():
            fail("'review_template' must be a non-empty string (or left out for the default hindsight prompt)")
        _check_template(review_template, REVIEW_FIELDS, "review_template", fail)
    env_kwargs = raw.get("env_kwargs") or {}
    if not isinstance(env_kwargs, dict):
        fail("'env_kwargs' must be a mapping of keyword arguments for the environment")
    reward_scale = raw.get("reward_scale", 1.0)
    is_number = isinstance(reward_scale, (int, float)) and not isinstance(reward_scale, bool)
    if not (is_number and 0 < reward_scale < float("inf")):
        fail(f"'reward_scale' must be a positive number (1.0: coach scores as given), got {reward_scale!r}")
    limit = raw.get("max_episode_actions")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        fail(f"'max_episode_actions' must be an integer >= 1 or left out (the sum of the agents' max_actions), "
             f"got {limit!r}")
    suffix = raw.get("problem_suffix", "")
    if not isinstance(suffix, str):
        fail(f"'problem_suffix' must be a string (text added after every task), got {suffix!r}")
    # In a double-quoted YAML string "\boxed" is a backspace and "oxed": refuse control characters other than
    # newlines and tabs, which no prompt means to send.
    odd = sorted({c for c in suffix if ord(c) < 32 and c not in "\n\t"})
    if odd:
        fail(f"'problem_suffix' holds the control character(s) {', '.join(map(repr, odd))}; in a double-quoted "
             f"YAML string a backslash is written \\\\ (\"\\\\boxed{{}}\")")
    keep_reasoning = raw.get("keep_reasoning", True)
    if not isinstance(keep_reasoning, bool):
        fail(f"'keep_reasoning' must be true (an agent's earlier replies as generated, reasoning included) or "
             f"false (as its chat template renders them), got {keep_reasoning!r}")
    return dict(env=raw["env"], coach_template=raw.get("coach_template"), env_kwargs=env_kwargs, score_key=score_key,
                reward_scale=float(reward_scale), max_episode_actions=limit, review_template=review_template,
                problem_suffix=suffix, keep_reasoning=keep_reasoning)


def _parse_agents(rows, env_cls: type, model_override: Optional[str], fail) -> list:
    """The agents in order, each checked alone, then together: distinct names, LoRA pools, and views naming
    only agents that exist (and, in a chain, act before them)."""
    if not isinstance(rows, list) or not rows:
        fail("'agents' must be a non-empty list; each agent needs at least name, model, role and prompt")
    agents = [_parse_agent(row, i, model_override, fail) for i, row in enumerate(rows)]
    names = [a.name for a in agents]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        fail(f"agent name(s) {duplicated} used more than once; every agent needs its own name")
    _check_pools(agents, fail)
    # Only the default workflow (MultiAgentEnv's own next_agents, a chain) fixes who acts before whom; an env
    # with its own next_agents may let any agent see any other.
    chain = getattr(getattr(env_cls, "next_agents", None), "chain", False)
    for i, (agent, row) in enumerate(zip(agents, rows)):
        agent.view = _parse_view(row.get("view", "all"), names, i, chain, fail)
    return agents


def _check_env_kwargs(env_cls: type, topology: Topology, fail) -> None:
    """A misspelt env_kwargs key fails here, not in the first rollout. A constructor's **kwargs usually go on to
    super().__init__, so the keys taken are the named ones of each __init__ in the MRO up to one without
    **kwargs; where the last **kwargs reach no further __init__ (the class reads them), any key passes here."""
    accepted, readers = [], []
    for cls in env_cls.__mro__[:-1]:  # not object
        if "__init__" not in vars(cls):
            continue
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]  # not self
        # make_env passes topology, task and workspace by position: the first three positional parameters
        passed = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:3]
        accepted += [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p not in passed]
        readers.append(cls.__name__)
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    else:  # the last **kwargs go to no further __init__: its class reads them itself
        accepted = None

    def named(key: str) -> str:
        close = difflib.get_close_matches(key, accepted, n=1)
        return f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key)

    unknown = [key for key in topology.env_kwargs if key not in accepted] if accepted is not None else []
    if unknown:
        through = (f" (the __init__ of {readers[0]} and, through **kwargs, of {', '.join(readers[1:])})"
                   if readers[1:] else "")
        fail(f"env_kwargs do not fit {topology.env}: unknown key(s) {', '.join(map(named, unknown))}; "
             f"{env_cls.__name__} takes {', '.join(accepted) or 'none'}{through}")
    try:  # a required argument left out (relay's goals), a key given twice
        inspect.signature(env_cls).bind(topology, {}, "", **topology.env_kwargs)
    except TypeError as e:
        fail(f"env_kwargs do not fit {topology.env}: {e}")


def _parse_agent(row, index: int, model_override: Optional[str], fail) -> AgentSpec:
    if not isinstance(row, dict):
        fail(f"agents[{index}] must be a mapping with keys {', '.join(AGENT_KEYS)}")
    label = f"agent {row.get('name', index)!r}"
    _check_keys(row, AGENT_KEYS, f"{label}: ", fail, "allowed agent keys")
    row = dict(row)
    row.pop("view", None)  # checked once every agent's name is known (_parse_view)
    if model_override:
        row["model"] = model_override
    for key in ("name", "model", "role", "prompt"):
        if not isinstance(row.get(key), str) or not row[key].strip():
            hint = " (or pass a model override)" if key == "model" else ""
            fail(f"{label}: '{key}' is missing or empty{hint}")
    row["model"] = os.path.expanduser(row["model"])  # the model is checked by check_model, before a run starts
    if not AGENT_NAME_RE.fullmatch(row["name"]):
        fail(f"{label}: names may only use letters, digits, '_' and '-' (they become paths and metric keys)")
    _check_template(row["prompt"], AGENT_PROMPT_FIELDS, f"{label}: prompt", fail)
    if not isinstance(row.get("system", ""), str):
        fail(f"{label}: 'system' must be a string")
    if not isinstance(row.get("runs_code", False), bool):
        fail(f"{label}: 'runs_code' must be true or false")
    max_actions = row.get("max_actions", 1)
    if isinstance(max_actions, bool) or not isinstance(max_actions, int) or max_actions < 1:
        fail(f"{label}: 'max_actions' must be an integer >= 1, got {max_actions!r}")
    for key in ("num_gpus_per_node", "vllm_num_engines", "max_new_tokens", "ring_attn_size", "tensor_parallel_size"):
        value = row.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            fail(f"{label}: '{key}' must be a positive integer or left out, got {value!r}")
    if row.get("lora") is not None:
        row["lora"] = _parse_lora(row["lora"], label, fail)
    return AgentSpec(**row)


def _parse_lora(raw, label: str, fail) -> Lora:
    label += ": lora"
    if not isinstance(raw, dict):
        fail(f"{label} must be a mapping with keys {', '.join(LORA_KEYS)} (rank is required)")
    _check_keys(raw, LORA_KEYS, f"{label}: ", fail)
    rank = raw.get("rank")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        fail(f"{label}: 'rank' must be an integer >= 1, got {rank!r}")
    if rank > placement.VLLM_LORA_RANKS[-1]:
        fail(f"{label}: rank {rank} is larger than vLLM's engines serve (max_lora_rank at most "
             f"{placement.VLLM_LORA_RANKS[-1]})")
    alpha = raw.get("alpha", 2 * rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < float("inf"):
        fail(f"{label}: 'alpha' must be a positive number (the update is scaled by alpha / rank), got {alpha!r}")
    targets = raw.get("target_modules", "all-linear")
    targets = [targets] if isinstance(targets, str) else targets
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t.strip() for t in targets):
        fail(f"{label}: 'target_modules' must be all-linear or a list of module names such as [q_proj, v_proj], "
             f"got {raw.get('target_modules')!r}")
    if "all-linear" in targets and len(targets) > 1:
        fail(f"{label}: 'target_modules' is either all-linear or a list of module names, not both")
    dropout = raw.get("dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        fail(f"{label}: 'dropout' must be a number in [0, 1), got {dropout!r}")
    pool = raw.get("pool")
    if pool is not None and (not isinstance(pool, str) or not AGENT_NAME_RE.fullmatch(pool)):
        fail(f"{label}: 'pool' must be a word of letters, digits, '_' and '-', got {pool!r}")
    return Lora(rank, float(alpha), tuple(targets), float(dropout), pool)


def _check_pools(agents: list, fail) -> None:
    """The agents of one LoRA engine pool share what an engine has only one of: its base model and engine count."""
    pools = {}
    for a in agents:
        if a.lora is not None:
            pools.setdefault(a.pool, []).append(a)
    for pool, members in pools.items():
        for key, what in (("model", "base model"), ("vllm_num_engines", "vllm_num_engines")):
            values = {getattr(a, key) for a in members}
            if len(values) > 1:
                listed = ", ".join(f"{a.name} ({getattr(a, key)})" for a in members)
                fail(f"LoRA engine pool {pool!r}: its agents differ in {what}: {listed}. One pool's engines serve one "
                     f"base model with every member's adapter; give them the same {what}, or different lora.pool names")


def _parse_view(raw, names: list, index: int, chain: bool, fail) -> View:
    """An agent's view, its names checked; in a chain (the default workflow) only agents listed before it."""
    label = f"agent {names[index]!r}: view"
    if not isinstance(raw, dict):
        raw = {"agents": raw}
    _check_keys(raw, VIEW_KEYS, f"{label}: ", fail)
    agents = raw.get("agents", "all")
    if agents == "previous":
        if index == 0:
            fail(f"{label}: 'previous' names nobody: this is the first agent (write [] to show no other agent)")
        agents = [names[index - 1]]
    if agents != "all":
        if not isinstance(agents, list) or not all(isinstance(a, str) for a in agents):
            fail(f"{label}: 'agents' must be all, previous or a list of agent names, got {agents!r}")
        for a in agents:
            if a not in names:
                fail(f"{label}: unknown agent {a!r}; the agents are {', '.join(names)}")
            if a == names[index]:
                fail(f"{label}: names the agent itself; its own earlier actions are always shown to it")
            if chain and names.index(a) > index:
                fail(f"{label}: names {a!r}, which acts after it (agents act in the listed order)")
        agents = tuple(agents)
    if raw.get("actions", "all") not in ("all", "last"):
        fail(f"{label}: 'actions' must be all or last, got {raw['actions']!r}")
    for key in ("tool_output", "strip_thinking"):
        if not isinstance(raw.get(key, False), bool):
            fail(f"{label}: '{key}' must be true or false, got {raw[key]!r}")
    return View(agents, raw.get("actions", "all"), raw.get("tool_output", True), raw.get("strip_thinking", False))


def _parse_stages(rows, agent_names: list, fail) -> list:
    """coach_templates: a list of {name, template, when}; the first stage starts, each later one takes over
    after the first step whose metrics satisfy its `when` (checked only while the stage before it is in use)."""
    if not isinstance(rows, list) or len(rows) < 2:
        fail("'coach_templates' must be a list of at least two stages {name, template, when} (one template: "
             "use coach_template)")
    stages = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            fail(f"coach_templates[{i}] must be a mapping with keys {', '.join(STAGE_KEYS)}")
        _check_keys(row, STAGE_KEYS, f"coach_templates[{i}]: ", fail)
        name = row.get("name")
        if not isinstance(name, str) or not AGENT_NAME_RE.fullmatch(name):
            fail(f"coach_templates[{i}]: 'name' must be a word of letters, digits, '_' and '-', got {name!r}")
        if name in [s.name for s in stages]:
            fail(f"coach_templates[{i}]: the name {name!r} is used twice; every stage needs its own name")
        label = f"coach_templates[{i}] ({name})"
        template = row.get("template")
        if not isinstance(template, str) or not template.strip():
            fail(f"{label}: 'template' is missing or empty")
        _check_template(template, PROMPT_FIELDS, f"{label}: template", fail)
        when = row.get("when")
        if i == 0:
            if when is not None:
                fail(f"{label}: the first stage is in use from step 1; a 'when' belongs to the stages after it")
            stages.append(CoachStage(name, template))
            continue
        if not isinstance(when, str):
            fail(f"{label}: 'when' must be a switch rule '<metric> <op> <number>', e.g. "
                 f"'agent/{agent_names[-1]}/code_error_rate < 0.2' or 'step >= 50'")
        rule = SWITCH_RULE_RE.fullmatch(when)
        if not rule:
            fail(f"{label}: when {when!r} is not '<metric> <op> <number>' with op one of <, <=, >, >= "
                 f"(e.g. 'outcome/success_rate >= 0.5' or 'step >= 50')")
        metric, op, threshold = rule.group(1), rule.group(2), float(rule.group(3))
        _check_switch_metric(metric, agent_names, f"{label}: when {when!r}", fail)
        stages.append(CoachStage(name, template, metric, op, threshold))
    return stages


def _check_switch_metric(metric: str, agent_names: list, label: str, fail) -> None:
    """A rule's metric must be one a step logs: a rule on a misspelt key would wait forever, silently."""
    parts = metric.split("/")
    if metric == "step" or metric == "outcome/success_rate":
        return
    if parts[0] in ("coach", "coach_bias") and len(parts) >= 2 and all(parts):
        return
    if parts[0] == "agent" and len(parts) == 3:
        if parts[1] not in agent_names:
            fail(f"{label}: unknown agent {parts[1]!r}; the agents are {', '.join(agent_names)}")
        if parts[2] not in AGENT_METRICS:
            fail(f"{label}: agents log no metric {parts[2]!r}; per-agent metrics: {', '.join(AGENT_METRICS)}")
        return
    fail(f"{label}: unknown metric name {metric!r}; a rule reads one of: {', '.join(SWITCH_NAMESPACES)}")


def _check_keys(raw: dict, keys: tuple, label: str, fail, allowed: str = "allowed") -> None:
    unknown = sorted(set(raw) - set(keys))
    if unknown:
        fail(f"{label}unknown key(s) {unknown}; {allowed}: {', '.join(keys)}")


def _check_template(template: str, allowed: tuple, label: str, fail) -> None:
    """Reject fields str.format would not fill; a bad template would otherwise fail mid-rollout."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        fail(f"{label}: broken template ({e}); write {{{{ and }}}} for literal braces")
    for name in fields:
        if name not in allowed:
            shown = "{" + name + "}"
            fail(f"{label}: unknown field {shown}; allowed fields: {', '.join(allowed)} "
                 "(write {{ and }} for literal braces, e.g. \\boxed{{}})")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
HUB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+")  # org/name


def check_model(model: str, label: str) -> None:
    """Refuse, before any cluster starts, a model the actors could not load: a directory without config.json and
    a tokenizer (it would fail with a misleading sentencepiece error), or not a hub id (org/name) on the hub or,
    offline, in the cache (a typo would be looked up inside a Ray actor minutes later)."""
    if os.path.isdir(model):
        missing = [] if os.path.isfile(os.path.join(model, "config.json")) else ["config.json"]
        if not any(os.path.isfile(os.path.join(model, name)) for name in TOKENIZER_FILES):
            missing.append("tokenizer files (one of " + ", ".join(TOKENIZER_FILES) + ")")
        if missing:
            raise ValueError(f"{label}: {model} is not a Hugging Face model directory: it has no "
                             f"{' and no '.join(missing)}")
        return
    where = "" if os.path.isabs(model) else f" (relative to {os.getcwd()})"
    if not HUB_ID_RE.fullmatch(model) or os.path.isdir(model.split("/")[0]):
        raise ValueError(f"{label}: model {model!r} is not a directory{where}; give a local model directory or a "
                         f"Hugging Face id (org/name)")
    from huggingface_hub import constants, errors, get_session, hf_hub_download, is_offline_mode, try_to_load_from_cache

    if is_offline_mode():
        if not isinstance(try_to_load_from_cache(model, "config.json"), str):
            raise ValueError(f"{label}: model {model!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
                             f"and downloads are off (HF_HUB_OFFLINE): download it first, or unset HF_HUB_OFFLINE")
        return
    # Resolved on the hub now, its config.json into the cache (the plan reads it): a typo, a gated model or a hub
    # out of reach is named here, not inside every Ray actor after the cluster started.
    try:
        # One plain request first: hf_hub_download retries a hub out of reach for a long while before saying so.
        get_session().head(constants.ENDPOINT, timeout=constants.HF_HUB_ETAG_TIMEOUT)
        hf_hub_download(model, "config.json")
    except errors.GatedRepoError:
        raise ValueError(f"{label}: model {model!r} is gated on the Hugging Face hub: accept its terms there and "
                         f"export HF_TOKEN (on the head node, before `ray start`)") from None
    except errors.RepositoryNotFoundError:
        raise ValueError(f"{label}: model {model!r} is not a local directory{where}, nor a model on the Hugging Face "
                         f"hub ({constants.ENDPOINT}): check the path or name (a private model needs HF_TOKEN)") \
            from None
    except errors.RemoteEntryNotFoundError:
        raise ValueError(f"{label}: the hub repository {model!r} has no config.json: not a transformers "
                         f"model") from None
    except (errors.LocalEntryNotFoundError, errors.HTTPError, OSError) as e:
        raise ValueError(f"{label}: model {model!r} is not a local directory{where}, and the Hugging Face hub "
                         f"({constants.ENDPOINT}) could not be reached to fetch its config.json ({type(e).__name__}): "
                         f"check the path, the network or HF_ENDPOINT; or download the model first and set "
                         f"HF_HUB_OFFLINE=1") from None


def check_lora(spec: AgentSpec, label: str) -> None:
    """Refuse, before any cluster starts, LoRA target modules the model lacks (peft would fail inside a Ray actor
    minutes later): its linear layers from a meta-device build (placement.model_size)."""
    if spec.lora is None or spec.lora.target_modules == ("all-linear",):
        return
    size = placement.model_size(spec.model)
    missing = [t for t in spec.lora.target_modules if t not in size.linear_names]
    if missing:
        raise ValueError(f"{label}: lora target_modules {missing} are not linear layers of {spec.model} "
                         f"({size.kind}); its linear layers: {', '.join(size.linear_names)} (or all-linear)")
