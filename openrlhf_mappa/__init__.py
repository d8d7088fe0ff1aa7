"""openrlhf_mappa: train teams of LLM agents, each with its own weights, from per-action coach rewards
(MAPPA) on OpenRLHF's Ray + vLLM + DeepSpeed stack."""

import importlib.util as _util
import os as _os
import sys as _sys

__version__ = "0.1.0"

# The patches (patches/) are the package openrlhf_mappa.patches once installed (setup.py maps them). In a
# source tree, a checkout or the copy that `ray job submit --working-dir .` puts first on every process's
# PYTHONPATH, they are the top-level folder beside this one: load them from there, so that the patches always
# come from the same tree as the package, whatever else is installed.
_here = _os.path.dirname(_os.path.abspath(__file__))
_source = _os.path.join(_os.path.dirname(_here), "patches")
if (not _os.path.isdir(_os.path.join(_here, "patches"))
        and _os.path.isfile(_os.path.join(_source, "__init__.py"))):
    _spec = _util.spec_from_file_location(f"{__name__}.patches", _os.path.join(_source, "__init__.py"),
                                          submodule_search_locations=[_source])
    patches = _util.module_from_spec(_spec)
    _sys.modules[_spec.name] = patches
    _spec.loader.exec_module(patches)
