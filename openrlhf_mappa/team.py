"""A topology as a run uses it: the YAML read and checked by topology.py, then checked against its environment's
class, which topology (the bottom room) may not import: the env's name, the views its turn order allows, and the
env_kwargs its constructors take. Every tool loads a topology through load_topology."""

import difflib
import inspect
from typing import Optional

from openrlhf_mappa.envs import load_env_class
from openrlhf_mappa.topology import Topology, read_topology


def load_topology(path: str, model_override: Optional[str] = None) -> Topology:
    """Read and validate a topology YAML and its environment. `model_override` replaces every agent's model
    (tests, demos)."""
    topology = read_topology(path, model_override)
    try:
        topology.env_cls = load_env_class(topology.env)
        _check_chain_views(topology)
        _check_env_kwargs(topology)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return topology


def _check_chain_views(topology: Topology) -> None:
    """Only the default workflow (MultiAgentEnv's own next_agents, a chain) fixes who acts before whom, so there
    a view names only agents listed before it; an env with its own next_agents may let any agent see any other."""
    if not getattr(getattr(topology.env_cls, "next_agents", None), "chain", False):
        return
    names = [a.name for a in topology.agents]
    for i, agent in enumerate(topology.agents):
        later = [name for name in agent.view.agents if names.index(name) > i] if agent.view.agents != "all" else []
        if later:
            raise ValueError(f"agent {agent.name!r}: view: names {later[0]!r}, which acts after it (agents act in the "
                             f"listed order)")


def _check_env_kwargs(topology: Topology) -> None:
    """A misspelt env_kwargs key fails here, with the nearest key taken, in `mappa plan` too (check_env, which
    builds the env, runs only where tasks are read, and says no more than Python's TypeError). A constructor's
    **kwargs usually go on to super().__init__, so the keys taken are the named ones of each __init__ in the MRO up
    to one without **kwargs; where the last **kwargs reach no further __init__ (the class reads them), any key
    passes here."""
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
        raise ValueError(f"env_kwargs do not fit {topology.env}: unknown key(s) {', '.join(map(named, unknown))}; "
                         f"{env_cls.__name__} takes {', '.join(accepted) or 'none'}{through}")
    try:  # a required argument left out (relay's goals), a key given twice
        inspect.signature(env_cls).bind(topology, {}, "", **topology.env_kwargs)
    except TypeError as e:
        raise ValueError(f"env_kwargs do not fit {topology.env}: {e}") from None
