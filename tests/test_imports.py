"""DESIGN's import direction, read from the source with `ast`: every import in openrlhf_mappa/ (at module
level and inside functions alike) goes from a room to itself or to a room of a lower rank, no package
module imports itself back through module-level imports (no cycle), and the core (what a training run
imports: benchmarks/size.py's closure) holds no tool."""

import ast
import os
import sys

import pytest
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import size  # noqa: E402  benchmarks/size.py: the layers, as the size counter draws them

PACKAGE = os.path.join(REPO, "openrlhf_mappa")

# DESIGN: "cli -> trainer -> launch/rollout/rewards -> coach/envs/episode -> topology". One line per rank,
# highest first. A room is a module or a sub-package of openrlhf_mappa/; it may import its own modules and the
# rooms of lower lines, never a room of its own line or above: so the coach and the environments never import
# each other, and topology imports no room. Where DESIGN names no place, a room sits just above what it needs:
#   tools (the `mappa` command, the doctor, the report, the paper table, DSBench's import, the tiny model, the
#   coach's distillation and re-scoring) on top: they may import the core, the core never imports them
#   (test_the_core_imports_no_tool);
#   episode under the coach and the environments, which both speak its records (Verdict, ToolFeedback);
#   sandbox (the envs run code in it) and console (prints) are utilities over those records;
#   placement is the plan that launch, resume and the cli read; run_log writes what a run logs (the trainer
#   logs through it, evaluation reports its behaviour metrics); resume cuts a run back; agent_trainer is one
#   agent's OpenRLHF trainer, started by launch; evaluation plays held-out tasks through the rollout; health
#   watches what launch started; compat (the CPU patches), the patches and the package root import nothing of
#   the package.
RANKS = [
    ("tools",),
    ("cli",),
    ("trainer",),
    ("health",),
    ("launch", "evaluation"),
    ("agent_trainer", "run_log", "resume", "team"),
    ("rollout", "rewards", "placement"),
    ("coach", "envs"),
    ("sandbox", "console"),
    ("episode",),
    ("topology", "compat", "patches", "openrlhf_mappa"),
]
RANK = {room: len(RANKS) - i for i, rooms in enumerate(RANKS) for room in rooms}
ROOM_OF = {"sandbox_launcher": "sandbox"}  # the sandbox's child process, started by its path


def room(module: str) -> str:
    """openrlhf_mappa.coach.heuristic -> coach; the package root is its own room."""
    parts = module.split(".")
    return ROOM_OF.get(parts[1], parts[1]) if len(parts) > 1 else parts[0]


def package_modules() -> dict:
    """{dotted module name: its source file}, every .py file of the package."""
    modules = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                parts = os.path.relpath(path, REPO)[: -len(".py")].split(os.sep)
                modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports(path: str, modules: dict) -> list:
    """(line, imported module, at module level) of every package import in the file; `from openrlhf_mappa
    import rewards` imports the module openrlhf_mappa.rewards. An import for type checkers only (under `if
    TYPE_CHECKING:`) never runs: it counts for the direction, not as a module-level import."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    at_top = set()  # the nodes a module-level import can be
    for statement in tree.body:
        typing_only = isinstance(statement, ast.If) and "TYPE_CHECKING" in ast.unparse(statement.test)
        definition = isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        if not typing_only and not definition:
            at_top.update(id(node) for node in ast.walk(statement))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            submodules = [f"{node.module}.{alias.name}" for alias in node.names]
            targets = [m if m in modules or m.endswith(".patches") else node.module for m in submodules]
        else:
            continue
        for target in dict.fromkeys(t for t in targets if t.split(".")[0] == "openrlhf_mappa"):
            found.append((node.lineno, target, id(node) in at_top))
    return found


def violations(modules: dict) -> list:
    """`file:line imports X (room A may not import room B)` for each import against the ranks."""
    found = []
    for module, path in sorted(modules.items()):
        here = room(module)
        for line, target, _ in imports(path, modules):
            there = room(target)
            if here != there and RANK[there] >= RANK[here]:
                where = os.path.relpath(path, REPO)
                found.append(f"{where}:{line} imports {target} (room {here} may not import room {there})")
    return found


def import_cycles(modules: dict) -> list:
    """Each cycle of module-level imports between package modules, as `a -> b -> a`."""
    graph = {}
    for module, path in modules.items():
        top = {target for _, target, at_top in imports(path, modules) if at_top}
        graph[module] = top & set(modules) - {module}
    state, cycles = {}, []  # state: 1 while on the current path, 2 once done

    def visit(module, path):
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target) :] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return cycles


def test_every_module_sits_in_a_room():
    unplaced = sorted({room(m) for m in package_modules()} - set(RANK))
    assert not unplaced, f"rooms in no rank: {unplaced}; add each to RANKS in tests/test_imports.py"


def test_imports_follow_the_design_direction():
    found = violations(package_modules())
    assert not found, f"{len(found)} import(s) against DESIGN's direction:\n" + "\n".join(found)


def test_no_import_cycle_between_package_modules():
    cycles = import_cycles(package_modules())
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checks_see_lazy_imports_one_rank_and_cycles(tmp_path):
    """The checks themselves: a lazy import of a room of the same rank, a module-level one of a higher rank,
    and a cycle of module-level imports (an import inside a function or for type checkers closes none)."""
    files = {"coach/x.py": "def f():\n    from openrlhf_mappa.envs.mathchat import grade\n",
             "episode.py": "from openrlhf_mappa import rewards\n",
             "rewards.py": "import openrlhf_mappa.episode\n"
                           "if TYPE_CHECKING:\n    from openrlhf_mappa.coach import x\n"}
    modules = {}
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        modules["openrlhf_mappa." + name[: -len(".py")].replace("/", ".")] = str(path)
    assert [v.partition(" imports ")[2] for v in violations(modules)] == [
        "openrlhf_mappa.envs.mathchat (room coach may not import room envs)",
        "openrlhf_mappa.rewards (room episode may not import room rewards)"]
    cycle = "openrlhf_mappa.episode -> openrlhf_mappa.rewards -> openrlhf_mappa.episode"
    assert import_cycles(modules) == [cycle]


def test_the_core_imports_no_tool():
    """The core (benchmarks/size.py's closure of the launcher, the built-in environments and the sandbox's
    child: everything a training run imports, lazily too) holds no module of openrlhf_mappa.tools, which the
    launcher reaches only as a command (`mappa report` after a run)."""
    known = size.modules()
    core = size.core_modules(known, size.roots())  # stops, naming the importer, at a tool
    assert size.LAUNCHER in core and "openrlhf_mappa.tools.report" in set(known) - core


def test_the_core_check_sees_a_lazy_import_of_a_tool(tmp_path):
    """The check itself: a core module importing a tool inside a function puts the tool in the core's closure,
    and the check names it and its importer; a tool importing the core is fine."""
    files = {"cli/train_mappa_ray.py": "from openrlhf_mappa import rollout\n",
             "rollout.py": "def done(run_dir):\n    from openrlhf_mappa.tools.report import write_report\n",
             "tools/__init__.py": "", "tools/report.py": "from openrlhf_mappa.rollout import done\n"}
    known = {}
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        known["openrlhf_mappa." + name[: -len(".py")].replace("/", ".").removesuffix(".__init__")] = str(path)
    named = r"openrlhf_mappa\.tools\.report \(imported by openrlhf_mappa\.rollout\)"
    with pytest.raises(SystemExit, match=named):
        size.core_modules(known, [size.LAUNCHER])
    (tmp_path / "rollout.py").write_text("def done(run_dir):\n    pass\n")
    assert size.core_modules(known, [size.LAUNCHER]) == {size.LAUNCHER, "openrlhf_mappa.rollout"}
