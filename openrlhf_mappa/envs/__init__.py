"""The environments: `base.py` holds what every pipeline shares, one module per pipeline the rest. A
topology's `env:` names one of BUILTIN_ENVS or any "package.module:Class"; load_env_class imports it only when
asked, so that parsing a topology does not depend on the environments' code."""

import importlib
import traceback

BUILTIN_ENVS = {
    "mathchat": "openrlhf_mappa.envs.mathchat:MathChatEnv",
    "debate": "openrlhf_mappa.envs.debate:MathDebateEnv",
    "dsbench": "openrlhf_mappa.envs.dsbench:DSBenchEnv",
    "relay": "openrlhf_mappa.envs.relay:RelayEnv",
}


def load_env_class(spec: str) -> type:
    """Resolve "package.module:Class" or a built-in short name (see BUILTIN_ENVS) to the class, a
    MultiAgentEnv."""
    target = BUILTIN_ENVS.get(spec, spec)
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ValueError(f"env {spec!r}: expected 'package.module:Class' or a built-in name "
                         f"({', '.join(BUILTIN_ENVS)})")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"env {spec!r}: cannot import module {module_name!r}: {e}") from e
    except SyntaxError as e:
        raise ValueError(
            f"env {spec!r}: module {module_name!r} has a syntax error: {e.filename}, line {e.lineno}: "
            f"{e.msg}"
        ) from e
    except Exception as e:  # the module raised while it was imported
        where = traceback.extract_tb(e.__traceback__)[-1]
        raise ValueError(f"env {spec!r}: importing module {module_name!r} raised {type(e).__name__}: {e} "
                         f"({where.filename}, line {where.lineno})") from e
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise ValueError(f"env {spec!r}: module {module_name!r} has no class {attr!r}")
    from openrlhf_mappa.envs.base import MultiAgentEnv

    if not issubclass(cls, MultiAgentEnv):
        raise ValueError(
            f"env {spec!r}: {module_name}.{attr} is not a MultiAgentEnv subclass; write it as "
            f"class {attr}(openrlhf_mappa.envs.base.MultiAgentEnv) (docs/reference.md, \"Your own "
            f"environment\")"
        )
    return cls
