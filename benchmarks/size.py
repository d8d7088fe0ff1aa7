"""The code's size by layer, in statements, and its density: the counter of the size-and-shape review
(Appendix B), so that a change to any layer is measured the same way every time.

    python benchmarks/size.py            # the table
    python benchmarks/size.py --files    # and every file

Layers:
- core: the import closure of the launcher (`openrlhf_mappa/cli/train_mappa_ray.py`), of the built-in
  environments (`envs.BUILTIN_ENVS`, imported by name) and of the sandbox's child process (started by its path),
  every package import followed, at module level and inside functions: everything a training run can import;
  it never holds a module of `openrlhf_mappa/tools/` (the script stops, naming the importer, if it does);
- tools: `openrlhf_mappa/tools/` (the `mappa` commands and what only they import), and any other package
  module outside the core's closure (listed apart as "outside the closure");
- patches: `patches/`, the CPU patches.
Statements exclude docstrings (bare string statements), so a longer docstring never costs a budget. Density:
lines over 110 columns, comprehensions, lambdas and conditional expressions (all Python files of the package
and the patches), and calls of core functions with more than 6 positional arguments."""

import argparse
import ast
import io
import os
import tokenize

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = "openrlhf_mappa.cli.train_mappa_ray"
TOOLS = "openrlhf_mappa.tools"
BUDGET = {"core": 4800, "tools": 1300, "patches": 260}
SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
        tokenize.ENDMARKER}


def is_docstring(node) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def count(source: str) -> dict:
    """Code lines (tokens outside docstrings and comments), statements without docstrings, and density."""
    tree = ast.parse(source)
    doc_lines = set()
    for node in ast.walk(tree):
        if is_docstring(node):
            doc_lines.update(range(node.lineno, node.end_lineno + 1))
    code = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in SKIP:
            code.update(line for line in range(token.start[0], token.end[0] + 1) if line not in doc_lines)
    nodes = list(ast.walk(tree))
    statements = [node for node in nodes if isinstance(node, ast.stmt) and not is_docstring(node)]
    comprehensions = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
    return {
        "code": len(code),
        "statements": len(statements),
        "long_lines": sum(len(line) > 110 for line in source.splitlines()),
        "comprehensions": sum(isinstance(node, comprehensions) for node in nodes),
        "lambdas": sum(isinstance(node, ast.Lambda) for node in nodes),
        "conditionals": sum(isinstance(node, ast.IfExp) for node in nodes),
    }


def modules() -> dict:
    """{dotted name: path} of every package module and patch."""
    found = {}
    for top, prefix in (("openrlhf_mappa", "openrlhf_mappa"), ("patches", "openrlhf_mappa.patches")):
        for folder, _, files in os.walk(os.path.join(REPO, top)):
            for name in sorted(files):
                if name.endswith(".py"):
                    parts = os.path.relpath(os.path.join(folder, name), os.path.join(REPO, top))[:-3]
                    dotted = ".".join([prefix] + [p for p in parts.split(os.sep) if p != "__init__"])
                    found[dotted] = os.path.join(folder, name)
    return found


def imported(path: str, known: dict) -> set:
    """The package modules a file imports anywhere in it (`from pkg import module` names the module)."""
    targets = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                targets.add(name)
    return targets


def closure(start: str, known: dict) -> dict:
    """The modules `start` reaches through imports, parents included (importing a.b runs a/__init__): {module:
    the module that imports it first}."""
    seen, todo = {}, [(start, None)]
    while todo:
        name, by = todo.pop()
        if name in seen:
            continue
        seen[name] = by
        if name not in known:
            raise SystemExit(f"{name}: no such package module (a root of the core moved?)")
        parent = name.rpartition(".")[0]
        targets = ([parent] if parent in known else []) + sorted(imported(known[name], known))
        todo.extend((target, name) for target in targets)
    return seen


def core_modules(known: dict, starts: list) -> set:
    """The core: every module the starts reach. It never holds a tool (tests/test_imports.py): a tool reached
    is an import to remove, not a module to count, so this stops and names who imports it."""
    reached = {}
    for start in starts:
        reached.update(closure(start, known))
    tools = [f"{name} (imported by {by})" for name, by in sorted(reached.items()) if is_tool(name)]
    if tools:
        raise SystemExit(f"the core imports the tools, which it never may: {'; '.join(tools)}")
    return set(reached)


def is_tool(name: str) -> bool:
    return name == TOOLS or name.startswith(TOOLS + ".")


def roots() -> list:
    """Where a training run starts importing: the launcher, the built-in environments, the sandbox's child."""
    found = [LAUNCHER, "openrlhf_mappa.sandbox_launcher"]
    tree = ast.parse(open(os.path.join(REPO, "openrlhf_mappa", "envs", "__init__.py"), encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.endswith("Env"):
            found.append(node.value.partition(":")[0])
    return found


def wide_calls(paths: list, core_functions: set) -> list:
    """Calls of core functions (by name) with more than 6 positional arguments: (file, line, name)."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.Call) and len(node.args) > 6:
                name = getattr(node.func, "id", getattr(node.func, "attr", None))
                if name in core_functions:
                    found.append((os.path.relpath(path, REPO), node.lineno, name))
    return found


def layers() -> tuple:
    """({layer: {dotted module: path}}, the modules outside the core's closure and outside tools/)."""
    known = modules()
    core = core_modules(known, roots())
    split, outside = {"core": {}, "tools": {}, "patches": {}}, []
    for name, path in known.items():
        layer = "patches" if name.startswith("openrlhf_mappa.patches") else "core" if name in core else "tools"
        split[layer][name] = path
        if layer == "tools" and not is_tool(name):
            outside.append(os.path.relpath(path, REPO))
    return split, outside


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", action="store_true", help="every file's counts too")
    args = parser.parse_args()
    split, outside = layers()
    core_functions = set()
    for path in split["core"].values():
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                core_functions.add(node.name)
    keys = ["code", "statements", "long_lines", "comprehensions", "lambdas", "conditionals"]
    total = dict.fromkeys(keys, 0)
    print(f"{'layer':<10}{'files':>6}" + "".join(f"{k:>15}" for k in keys) + f"{'budget':>9}")
    for layer, members in split.items():
        sums = dict.fromkeys(keys, 0)
        for name, path in sorted(members.items()):
            counts = count(open(path, encoding="utf-8").read())
            for key in keys:
                sums[key] += counts[key]
                total[key] += counts[key]
            if args.files:
                print(f"  {os.path.relpath(path, REPO):<50}" + "".join(f"{counts[k]:>8}" for k in keys[:2]))
        print(f"{layer:<10}{len(members):>6}" + "".join(f"{sums[k]:>15}" for k in keys)
              + f"{'<= ' + str(BUDGET[layer]):>9}")
    print(f"{'all':<16}" + "".join(f"{total[k]:>15}" for k in keys))
    if outside:
        print(f"outside the closure (counted as tools, not under openrlhf_mappa/tools/): "
              f"{', '.join(sorted(outside))}")
    paths = [p for members in split.values() for p in members.values()]
    wide = wide_calls(paths, core_functions)
    print(f"calls of core functions with more than 6 positional arguments: {len(wide)}")
    for where in wide:
        print("  %s:%d %s" % where)


if __name__ == "__main__":
    main()
