"""A team of agents, their order, their environment and the coach prompt, read from one YAML file.

Everything is checked when the file is loaded, so a typo fails in the first second of a run with a message
that names the file and what to fix, not an hour later inside a Ray worker.
"""

import dataclasses
import inspect
import logging
import os
import re
import string
from dataclasses import dataclass, field
from typing import Optional, Union

import yaml

from openrlhf_mappa.coach import DEFAULT_SCORE_KEY, REVIEW_FIELDS, SCORE_KEY_RE
from openrlhf_mappa.envs.base import load_env_class

logger = logging.getLogger(__name__)

AGENT_PROMPT_FIELDS = ("task", "history")
COACH_PROMPT_FIELDS = (
    "task", "role", "agent", "turn", "task_type", "agent_input", "agent_output", "feedback", "ground_truth",
)  # fmt: skip
# Agent names become parts of checkpoint paths and metric keys.
AGENT_NAME_RE = re.compile(r"[A-Za-z0-9_-]+")
VIEW_KEYS = ("agents", "actions", "tool_output", "strip_thinking")


@dataclass(frozen=True)
class View:
    """Which earlier actions of OTHER agents an agent's {history} shows. Its own earlier actions in the episode
    always follow its prompt as turns of the chat (its reply, then its tool output), as the authors' agents
    saw them. YAML: `view: all | previous | [names]`, or a mapping of these fields."""

    agents: Union[str, tuple] = "all"  # "all", or a tuple of agent names ("previous" is resolved when the file loads)
    actions: str = "all"  # "last": each agent's final reply (and, with tool_output, its latest code run) only
    tool_output: bool = True  # show what their code printed
    strip_thinking: bool = False  # drop <think>...</think> from their replies


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
    view: View = field(default_factory=View)


@dataclass
class Topology:
    name: str
    env: str  # "package.module:Class", or a built-in short name such as "mathchat"
    agents: list  # list[AgentSpec], in the order they act
    coach_template: str  # str.format template; fields: COACH_PROMPT_FIELDS
    env_kwargs: dict = field(default_factory=dict)  # extra keyword arguments of the env's constructor
    score_key: str = DEFAULT_SCORE_KEY  # a text reply of the coach states its score on a line `<score_key>: <n>`
    reward_scale: float = 1.0  # every reward is multiplied by it (coach score and outcome alike; see rewards.py)
    review_template: Optional[str] = None  # hindsight prompt (fields: coach.REVIEW_FIELDS); None: the default

    def env_class(self) -> type:
        return load_env_class(self.env)

    def make_env(self, task: dict, workspace: str):
        """One environment instance for one episode (task is one row of load_tasks)."""
        return self.env_class()(self, task, workspace, **self.env_kwargs)


TOPOLOGY_KEYS = ("name", "env", "agents", "coach_template", "env_kwargs", "score_key", "reward_scale", "review_template")
AGENT_KEYS = tuple(f.name for f in dataclasses.fields(AgentSpec))


def load_topology(path: str, model_override: Optional[str] = None) -> Topology:
    """Read and validate a topology YAML. `model_override` replaces every agent's model (tests, demos)."""
    with open(path, encoding="utf-8") as f:
        try:
            raw = yaml.safe_load(f)
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not valid YAML: {e}") from e

    def fail(msg):
        raise ValueError(f"{path}: {msg}")

    if not isinstance(raw, dict):
        fail("expected a mapping with keys " + ", ".join(TOPOLOGY_KEYS))
    unknown = sorted(set(raw) - set(TOPOLOGY_KEYS))
    if unknown:
        fail(f"unknown key(s) {unknown}; allowed top-level keys: {', '.join(TOPOLOGY_KEYS)}")
    for key in ("env", "coach_template"):
        if not isinstance(raw.get(key), str) or not raw[key].strip():
            fail(f"'{key}' is missing or empty; it must be a non-empty string")
    _check_template(raw["coach_template"], COACH_PROMPT_FIELDS, "coach_template", fail)
    score_key = raw.get("score_key", DEFAULT_SCORE_KEY)
    if not isinstance(score_key, str) or not SCORE_KEY_RE.fullmatch(score_key):
        fail(f"'score_key' must be a word of letters, digits and '_' starting with a letter, got {score_key!r}")
    if score_key.lower() not in raw["coach_template"].lower():
        # Not an error (a server with JSON-schema output never needs the line), but a text coach that is not
        # told the key states its score some other way, and every such verdict costs a re-prompt or fails.
        logger.warning("%s: coach_template never names the score key %s; ask for a last line `%s: <0-10>` "
                       "or set score_key to the key it asks for", path, score_key, score_key)
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

    agent_rows = raw.get("agents")
    if not isinstance(agent_rows, list) or not agent_rows:
        fail("'agents' must be a non-empty list; each agent needs at least name, model, role and prompt")
    agents = [_parse_agent(row, i, model_override, fail) for i, row in enumerate(agent_rows)]
    names = [a.name for a in agents]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        fail(f"agent name(s) {duplicated} used more than once; every agent needs its own name")
    for i, (agent, row) in enumerate(zip(agents, agent_rows)):
        agent.view = _parse_view(row.get("view", "all"), names, i, fail)

    try:
        env_cls = load_env_class(raw["env"])
    except ValueError as e:
        fail(str(e))
    topology = Topology(
        name=str(raw.get("name") or os.path.splitext(os.path.basename(path))[0]),
        env=raw["env"],
        agents=agents,
        coach_template=raw["coach_template"],
        env_kwargs=env_kwargs,
        score_key=score_key,
        reward_scale=float(reward_scale),
        review_template=review_template,
    )
    # Bind the constructor's arguments now so a misspelled env_kwargs key fails here, not in the first rollout.
    try:
        inspect.signature(env_cls).bind(topology, {}, "", **env_kwargs)
    except TypeError as e:
        fail(f"env_kwargs do not fit {raw['env']}: {e}")
    return topology


def _parse_agent(row, index: int, model_override: Optional[str], fail) -> AgentSpec:
    if not isinstance(row, dict):
        fail(f"agents[{index}] must be a mapping with keys {', '.join(AGENT_KEYS)}")
    label = f"agent {row.get('name', index)!r}"
    unknown = sorted(set(row) - set(AGENT_KEYS))
    if unknown:
        fail(f"{label}: unknown key(s) {unknown}; allowed agent keys: {', '.join(AGENT_KEYS)}")
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
    for key in ("num_gpus_per_node", "vllm_num_engines", "max_new_tokens"):
        value = row.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            fail(f"{label}: '{key}' must be a positive integer or left out, got {value!r}")
    return AgentSpec(**row)


def _parse_view(raw, names: list, index: int, fail) -> View:
    """An agent's view, its names checked: agents act once each, in the listed order, so a view may only name
    agents listed before it (later ones have not acted yet; its own actions are always shown)."""
    label = f"agent {names[index]!r}: view"
    if not isinstance(raw, dict):
        raw = {"agents": raw}
    unknown = sorted(set(raw) - set(VIEW_KEYS))
    if unknown:
        fail(f"{label}: unknown key(s) {unknown}; allowed: {', '.join(VIEW_KEYS)}")
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
            if names.index(a) > index:
                fail(f"{label}: names {a!r}, which acts after it (agents act in the listed order)")
        agents = tuple(agents)
    if raw.get("actions", "all") not in ("all", "last"):
        fail(f"{label}: 'actions' must be all or last, got {raw['actions']!r}")
    for key in ("tool_output", "strip_thinking"):
        if not isinstance(raw.get(key, False), bool):
            fail(f"{label}: '{key}' must be true or false, got {raw[key]!r}")
    return View(agents, raw.get("actions", "all"), raw.get("tool_output", True), raw.get("strip_thinking", False))


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
                 "(write {{ and }} for literal braces, e.g. \\boxed{{}})")  # fmt: skip


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
HUB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+")  # org/name


def check_model(model: str, label: str) -> None:
    """Refuse, before any cluster starts, a model the actors could not load: a local directory needs a
    config.json and a tokenizer; anything else must look like a hub id (org/name, its org not a local
    directory) and, offline (HF_HUB_OFFLINE), be in the local cache. Otherwise a typo is looked up on the
    hub inside a Ray actor minutes later, and a non-model directory fails with a misleading sentencepiece error."""
    if os.path.isdir(model):
        missing = [] if os.path.isfile(os.path.join(model, "config.json")) else ["config.json"]
        if not any(os.path.isfile(os.path.join(model, name)) for name in TOKENIZER_FILES):
            missing.append("tokenizer files (one of " + ", ".join(TOKENIZER_FILES) + ")")
        if missing:
            raise ValueError(f"{label}: {model} is not a Hugging Face model directory: it has no {' and no '.join(missing)}")
        return
    if not HUB_ID_RE.fullmatch(model) or os.path.isdir(model.split("/")[0]):
        where = "" if os.path.isabs(model) else f" (relative to {os.getcwd()})"
        raise ValueError(f"{label}: model {model!r} is not a directory{where}; give a local model directory or a "
                         f"Hugging Face id (org/name)")
    from huggingface_hub import constants, is_offline_mode, try_to_load_from_cache

    if is_offline_mode() and not isinstance(try_to_load_from_cache(model, "config.json"), str):
        raise ValueError(f"{label}: model {model!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                         f"downloads are off (HF_HUB_OFFLINE): download it first, or unset HF_HUB_OFFLINE")
