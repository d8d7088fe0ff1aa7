"""A topology as a run uses it: the YAML read and checked by topology.py, then checked against what topology (the
bottom room) may not import: its environment's class (the env's name, the views its turn order allows, the
env_kwargs its constructors take: load_topology, which every tool loads a topology with) and its models (a
directory or the hub: check_model; LoRA targets: check_lora), before any cluster starts."""

import difflib
import inspect
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional, Union

from openrlhf_mappa import placement
from openrlhf_mappa.envs import load_env_class
from openrlhf_mappa.topology import AgentSpec, Topology, read_topology


def load_topology(path: str, model_override: Optional[str] = None) -> Topology:
    """Read and validate a topology YAML and its environment. `model_override` replaces every agent's model
    (tests, demos)."""
    topology = read_topology(path, model_override)
    try:
        topology.env_cls = load_env_class(topology.env)
    except ValueError as e:
        problems = [str(e)]
    else:  # two independent rules: both named in one refusal
        problems = _chain_view_problems(topology) + _env_kwargs_problems(topology)
    if problems:
        raise ValueError("\n".join(f"{path}: {problem}" for problem in problems))
    return topology


class PlayedAction(NamedTuple):
    agent: str
    turn: int  # the agent's own action index, from 0
    round: int  # the episode's round, from 0
    messages: list  # its input: what env.observe gave it
    reply: str
    result: object  # env.step's StepResult (its feedback, done)
    grade: Optional[tuple]  # env.judge's (score, why, failed), or None: the offline heuristic coach's rule


@dataclass
class Played:
    env: object  # the environment after the episode: env.history, env.task...
    actions: list = field(default_factory=list)  # PlayedAction, in the order taken
    outcome: dict = field(default_factory=dict)  # env.outcome(); success False where a limit stopped it
    action_limit: str = ""  # which limit stopped it, "" if it ended by itself


def play(topology: Union[Topology, str], task: dict, replies: Union[list, Callable], workspace: str = None,
         truncated_at: Optional[int] = None) -> Played:
    """One episode of `topology` (a Topology, or a topology YAML's path) on `task` (a task row), the agents
    answering with scripted replies: a list taken in the order they act, or a function (agent name, turn) ->
    reply. Rounds, limits and the environment's calls are the rollout's, without models, coach or cluster: a
    unit test of an environment. `workspace`: where its code runs (default: a new temporary directory);
    `truncated_at`: the token limit every reply is taken as cut off at (what judge hears), None: whole
    replies. Each hook's return is checked as the rollout checks it: a wrong one is a ValueError naming the
    hook."""
    from openrlhf_mappa.envs.base import returned_problem
    from openrlhf_mappa.rollout import ended, rounds

    if isinstance(topology, str):
        topology = load_topology(topology)
    env = topology.make_env(task, workspace or tempfile.mkdtemp(prefix="mappa-play-"))

    def call(hook: str, fn, *args):
        value = fn(*args)
        problem = returned_problem(hook, value)
        if problem:
            raise ValueError(f"{type(env).__name__}.{hook} returned {value!r:.200}: {problem}")
        return value

    scripted = None if callable(replies) else list(replies)
    played = Played(env)
    call("task_type", getattr, env, "task_type")
    call("task_text", getattr, env, "task_text")
    for round_, agents, turns, last in rounds(topology, env, call, played):
        # the history as it was before the round
        inputs = [call("observe", env.observe, spec, turns[spec.name]) for spec in agents]
        for spec, messages in zip(agents, inputs):
            turn = turns[spec.name]
            if scripted == []:
                raise ValueError(f"play: no reply left for agent {spec.name!r}'s action {turn} (action "
                                 f"{len(played.actions)} of the episode)")
            reply = replies(spec.name, turn) if scripted is None else scripted.pop(0)
            result = last[spec.name] = call("step", env.step, spec, turn, reply)
            call("answer_formatted", env.answer_formatted, spec, reply)
            call("coach_ground_truth", env.coach_ground_truth, spec)
            grade = call("judge", env.judge, spec, reply, result.feedback, truncated_at)
            played.actions.append(PlayedAction(spec.name, turn, round_, messages, reply, result, grade))
    played.outcome = ended(played, call("outcome", env.outcome))
    return played


def _chain_view_problems(topology: Topology) -> list:
    """Only the default workflow (MultiAgentEnv's own next_agents, a chain) fixes who acts before whom, so there
    a view names only agents listed before it; an env with its own next_agents may let any agent see any other."""
    if not getattr(getattr(topology.env_cls, "next_agents", None), "chain", False):
        return []
    names, problems = [a.name for a in topology.agents], []
    for i, agent in enumerate(topology.agents):
        shown = () if agent.view.agents == "all" else agent.view.agents
        later = [name for name in shown if names.index(name) > i]
        if later:
            problems.append(f"agent {agent.name!r}: view: names {later[0]!r}, which acts after it (agents act in the "
                            f"listed order)")
    return problems


def _env_kwargs_problems(topology: Topology) -> list:
    """A misspelt env_kwargs key fails here, with the nearest key taken, in `mappa plan` too (check_env, which
    builds the env, runs only where tasks are read, and says no more than Python's TypeError). A constructor's
    **kwargs usually go on to super().__init__, so the keys taken are the named ones of each __init__ in the MRO up
    to one without **kwargs (MultiAgentEnv's at the latest): a class that reads its own **kwargs names them."""
    env_cls = topology.env_cls
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
            break  # MultiAgentEnv's at the latest

    def named(key: str) -> str:
        close = difflib.get_close_matches(key, accepted, n=1)
        return f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key)

    unknown = [key for key in topology.env_kwargs if key not in accepted]
    if unknown:
        through = (f" (the __init__ of {readers[0]} and, through **kwargs, of {', '.join(readers[1:])})"
                   if readers[1:] else "")
        return [f"env_kwargs do not fit {topology.env}: unknown key(s) {', '.join(map(named, unknown))}; "
                f"{env_cls.__name__} takes {', '.join(accepted) or 'none'}{through}"]
    try:  # a required argument left out (relay's goals), a key given twice
        inspect.signature(env_cls).bind(topology, {}, "", **topology.env_kwargs)
    except TypeError as e:
        return [f"env_kwargs do not fit {topology.env}: {e}"]
    return []


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
HUB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+")  # org/name


def check_model(model: str, label: str) -> None:
    """Refuse, before any cluster starts, a model the actors could not load: a directory without config.json and
    a tokenizer (it would fail with a misleading sentencepiece error), or not a hub id (org/name) on the hub or,
    offline, in the cache (a typo would be looked up inside a Ray actor minutes later)."""
    where = "" if os.path.isabs(model) else f" (relative to {os.getcwd()})"
    if os.path.isdir(model):
        missing = [] if os.path.isfile(os.path.join(model, "config.json")) else ["config.json"]
        if not any(os.path.isfile(os.path.join(model, name)) for name in TOKENIZER_FILES):
            missing.append("tokenizer files (one of " + ", ".join(TOKENIZER_FILES) + ")")
        problem = f"{model} is not a Hugging Face model directory: it has no {' and no '.join(missing)}"
        problem = problem if missing else ""
    elif not HUB_ID_RE.fullmatch(model) or os.path.isdir(model.split("/")[0]):
        problem = (f"model {model!r} is not a directory{where}; give a local model directory or a Hugging Face id "
                   f"(org/name)")
    else:
        problem = _hub_problem(model, where)
    if problem:
        raise ValueError(f"{label}: {problem}")


def _hub_problem(model: str, where: str) -> str:
    """Why hub id `model` cannot be loaded ("" if it can): offline, not in the cache; online, resolved on the hub
    now, its config.json into the cache (the plan reads it), so that a typo, a gated model or a hub out of reach
    is named here, not inside every Ray actor after the cluster started."""
    from huggingface_hub import constants, errors, get_session, hf_hub_download, is_offline_mode, try_to_load_from_cache

    if is_offline_mode():
        if isinstance(try_to_load_from_cache(model, "config.json"), str):
            return ""
        return (f"model {model!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and downloads are off "
                f"(HF_HUB_OFFLINE): download it first, or unset HF_HUB_OFFLINE")
    try:
        # One plain request first: hf_hub_download retries a hub out of reach for a long while before saying so.
        get_session().head(constants.ENDPOINT, timeout=constants.HF_HUB_ETAG_TIMEOUT)
        hf_hub_download(model, "config.json")
    except errors.GatedRepoError:
        return (f"model {model!r} is gated on the Hugging Face hub: accept its terms there and export HF_TOKEN (on "
                f"the head node, before `ray start`)")
    except errors.RepositoryNotFoundError:
        return (f"model {model!r} is not a local directory{where}, nor a model on the Hugging Face hub "
                f"({constants.ENDPOINT}): check the path or name (a private model needs HF_TOKEN)")
    except errors.RemoteEntryNotFoundError:
        return f"the hub repository {model!r} has no config.json: not a transformers model"
    except (errors.LocalEntryNotFoundError, errors.HTTPError, OSError) as e:
        return (f"model {model!r} is not a local directory{where}, and the Hugging Face hub ({constants.ENDPOINT}) "
                f"could not be reached to fetch its config.json ({type(e).__name__}): check the path, the network "
                f"or HF_ENDPOINT; or download the model first and set HF_HUB_OFFLINE=1")
    return ""


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
