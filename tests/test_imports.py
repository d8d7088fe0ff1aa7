"""DESIGN's import direction, read from the source with `ast`: every import in openrlhf_mappa/ (at module level
and inside functions alike) goes from a room to itself or to a room of a lower rank, and no package module
imports itself back through its module-level imports (no cycle)."""

import ast
import os

from conftest import REPO

PACKAGE = os.path.join(REPO, "openrlhf_mappa")

# DESIGN: "cli -> trainer -> launch/rollout/rewards -> coach/envs/episode -> topology", one line per rank, highest
# first. A room is a module or a sub-package of openrlhf_mappa/; it may import its own modules and the rooms of
# lower lines, never a room of its own line or above (so the coach and the environments never import each other).
# Where DESIGN is silent, a room sits just above what it needs:
#   episode is below the coach and the environments, which both speak its records (Verdict, ToolFeedback);
#   sandbox and console are utilities over those records (envs run code in the sandbox; console prints);
#   placement is the plan (launch, resume and the cli read it); report draws a finished run; paper_table is
#   report's paper figures; run_log writes a step's records (trainer and evaluation log through it); resume cuts
#   a run back; agent_trainer is one agent's OpenRLHF trainer, which launch starts; evaluation plays held-out
#   tasks through the rollout; health watches what launch started; doctor checks a machine as a run would;
#   compat (CPU patches), tiny_model (test models) and the package root import nothing of the package.
RANKS = [
    ("cli",),
    ("trainer", "doctor"),
    ("health",),
    ("launch", "evaluation"),
    ("agent_trainer", "run_log", "resume", "paper_table"),
    ("rollout", "rewards", "placement", "report"),
    ("coach", "envs"),
    ("sandbox", "console"),
    ("episode",),
    ("topology", "compat", "tiny_model", "patches", "openrlhf_mappa"),
]
RANK = {room: len(RANKS) - i for i, rooms in enumerate(RANKS) for room in rooms}
ROOM_OF = {"sandbox_launcher": "sandbox"}  # the sandbox's child process, started by path


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
    import rewards` imports the module openrlhf_mappa.rewards. Imports for type checkers only run nowhere and
    count only for the direction."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                   for n in ast.walk(node)}  # fmt: skip
    top = {id(n) for node in tree.body if id(node) not in typing_only for n in ast.walk(node)
           if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}  # fmt: skip
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
            found.append((node.lineno, target, id(node) in top))
    return found


def violations(modules: dict) -> list:
    found = []
    for module, path in sorted(modules.items()):
        here = room(module)
        for line, target in ((line, target) for line, target, _ in imports(path, modules)):
            there = room(target)
            if here != there and RANK[there] >= RANK[here]:
                where = os.path.relpath(path, REPO)
                found.append(f"{where}:{line} imports {target} (room {here} may not import room {there})")
    return found


def test_every_module_sits_in_a_room():
    unplaced = sorted({room(m) for m in package_modules()} - set(RANK))
    assert not unplaced, f"rooms in no rank: {unplaced}; add each to RANKS in tests/test_imports.py, after DESIGN"


def test_imports_follow_the_design_direction():
    found = violations(package_modules())
    assert not found, f"{len(found)} import(s) against DESIGN's direction:\n" + "\n".join(found)


def test_no_import_cycle_between_package_modules():
    modules = package_modules()
    graph = {m: {t for _, t, at_top in imports(path, modules) if at_top and t in modules and t != m}
             for m, path in modules.items()}  # fmt: skip
    state, cycles = {}, []  # state: 1 on the current path, 2 done

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
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_check_sees_lazy_imports_and_one_rank(tmp_path):
    """The check itself: a lazy import of a room of the same rank, and a module-level one of a higher rank."""
    files = {"coach/x.py": "def f():\n    from openrlhf_mappa.envs.mathchat import grade\n",
             "episode.py": "from openrlhf_mappa import rewards\n", "rewards.py": ""}
    modules = {}
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        modules["openrlhf_mappa." + name[: -len(".py")].replace("/", ".")] = str(path)
    assert [v.partition(" imports ")[2] for v in violations(modules)] == [
        "openrlhf_mappa.envs.mathchat (room coach may not import room envs)",
        "openrlhf_mappa.rewards (room episode may not import room rewards)"]
