"""The package's import graph, read from the source with `ast` (nothing is imported): no module of mmpg/ reaches
itself through imports of mmpg modules, the evaluation, run-directory and app code stay off the trainer, nothing a
real run needs reaches the toy world (mmpg/toy) and the tools load it only inside functions, and no library code
imports a test module (tests/synthetic_run.py and the other helpers beside the tests).

An edge A -> B is any `import mmpg.x` / `from mmpg.x import y` / relative import in A that names module B (or the
package B when y is not a module of it), at module level or inside a function: an import deferred into a function
to dodge a circle at import time is still a circle in the design. Importing a submodule also runs its packages'
__init__, but that edge is not counted (every submodule would otherwise "import" its parent).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _modules(package: str = "mmpg", name: str | None = None) -> dict[str, Path]:
    """{module name: file} of one folder; `name` is the package's import name where it differs from the folder's
    (app/ installs as mmpg_app)."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join([name or parts[0], *parts[1:]])] = path
    return out


def _imported(node: ast.AST, module: str, is_package: bool, known) -> list[str]:
    """The mmpg modules an import statement names (each `from X import y` names X.y when that is a module, else X)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: from the module's package, one level up per extra dot
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join(package + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def import_graph(files: dict[str, Path] | None = None) -> dict[str, dict[str, int]]:
    """{module: {imported mmpg module: the line of its first import there}} over every import statement."""
    files = files if files is not None else _modules()
    graph: dict[str, dict[str, int]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            for name in _imported(node, module, path.name == "__init__.py", files):
                while name and name not in files:  # `import mmpg.a.b.C`-style names: the longest module prefix
                    name = name.rpartition(".")[0]
                if name and name != module and name.split(".")[0] in ("mmpg", "mmpg_app"):
                    edges = graph.setdefault(module, {})
                    edges[name] = min(edges.get(name, node.lineno), node.lineno)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted; [] when there is no circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _describe(graph, component: list[str]) -> str:
    edges = [f"{a} -> {b} (line {line})" for a in component for b, line in sorted(graph.get(a, {}).items())
             if b in component]
    return "import circle: " + "; ".join(edges)


def test_the_graph_sees_imports_at_every_depth(tmp_path):
    # the checker itself: module-level, function-level and relative imports are edges; a loop is found
    pkg = tmp_path / "mmpg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .a import f\n")
    (pkg / "sub" / "a.py").write_text("def f():\n    from mmpg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("import os\nfrom mmpg.sub.a import f\n")
    files = {name: tmp_path / path for name, path in [
        ("mmpg", "mmpg/__init__.py"), ("mmpg.sub", "mmpg/sub/__init__.py"), ("mmpg.sub.a", "mmpg/sub/a.py"),
        ("mmpg.sub.b", "mmpg/sub/b.py")]}
    graph = import_graph(files)
    assert graph == {"mmpg.sub": {"mmpg.sub.a": 1}, "mmpg.sub.a": {"mmpg.sub.b": 2}, "mmpg.sub.b": {"mmpg.sub.a": 2}}
    assert cycles(graph) == [["mmpg.sub.a", "mmpg.sub.b"]]


def test_no_import_circle_in_mmpg():
    graph = import_graph()
    assert "mmpg.bench.measure" in graph and "mmpg.bench.runner" in graph  # the walk saw the package
    found = cycles(graph)
    assert not found, "\n".join(_describe(graph, c) for c in found)


def _inside(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _chains(graph: dict[str, dict[str, int]], starts, targets) -> list[str]:
    """Each module inside the packages `targets` that a module of `starts` reaches, as the shortest chain of imports
    from it: "a (line of its import of b) -> b (line ...) -> target"; [] when none is reached."""
    bad = []
    for start in sorted(m for m in starts if m in graph):
        parent, todo = {start: None}, [start]
        for module in todo:  # breadth first: the shortest chain to each module reached
            for target in graph.get(module, {}):
                if target not in parent:
                    parent[target] = module
                    todo.append(target)
        for target in sorted(t for t in parent if _inside(t, targets)):
            chain = [target]
            while parent[chain[-1]] is not None:
                chain.append(parent[chain[-1]])
            chain.reverse()  # start -> ... -> target, each step "module (line of its import of the next)"
            bad.append(" -> ".join(f"{m} (line {graph[m][n]})" for m, n in zip(chain, chain[1:])) + f" -> {target}")
    return bad


def test_eval_runs_and_app_do_not_import_the_trainer():
    # evaluation, run records and the app read runs: no chain of imports from them reaches the training code
    graph = import_graph({**_modules("mmpg"), **_modules("app", "mmpg_app")})
    assert "mmpg_app.server" in graph  # the walk saw the app
    readers = [m for m in graph if _inside(m, ("mmpg.eval", "mmpg.runs", "mmpg_app"))]
    bad = _chains(graph, readers, ("mmpg.train", "mmpg.rl", "mmpg.sft"))
    assert not bad, "imports reaching the trainer:\n" + "\n".join(bad)


# The arrows of a run point one way: the commands -> the recipes (mmpg.rl, mmpg.sft) -> the shared trainer
# (mmpg.train: batches, packing, setup, the loop, checkpoints) -> the engines below it (rollout, grouping, data,
# models). Nothing below reaches up; the two recipes do not reach each other.
LAYERS = [("mmpg.train", ("mmpg.rl", "mmpg.sft")),
          (("mmpg.rollout", "mmpg.grouping", "mmpg.data", "mmpg.models"), ("mmpg.train", "mmpg.rl", "mmpg.sft")),
          ("mmpg.sft", ("mmpg.rl",)), ("mmpg.rl", ("mmpg.sft",))]


@pytest.mark.parametrize("below, above", LAYERS, ids=lambda x: x if isinstance(x, str) else "+".join(x))
def test_recipes_train_and_engines_import_one_way(below, above):
    graph = import_graph()
    below = (below,) if isinstance(below, str) else below
    starts = [m for m in graph if _inside(m, below)]
    assert starts, below
    bad = _chains(graph, starts, above)
    assert not bad, "imports pointing back up:\n" + "\n".join(bad)


# The toy world (mmpg/toy: tiny checkpoints, their tokenizer, synthetic videos, the demo) is built for tests, the demo
# and CPU benchmarks. The tools may use it, inside the functions that need it; everything else of mmpg/ and app/ is
# what a real run needs, and no chain of imports from there reaches it.
TOY = "mmpg.toy"
TOOLS = ("mmpg.cli", "mmpg.__main__", "mmpg.bench", "mmpg.doctor", "mmpg.plan")  # __main__: `python -m mmpg`


def _real_run(files) -> list[str]:
    return sorted(m for m in files if not _inside(m, (TOY, *TOOLS)))


def module_level_imports(path: Path, module: str, files) -> list[tuple[str, int]]:
    """(mmpg module, line) of every import that runs when the module is imported: outside any function body."""
    found, todo = [], list(ast.parse(path.read_text(), filename=str(path)).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        found += [(name, node.lineno) for name in _imported(node, module, path.name == "__init__.py", files)]
        todo += list(ast.iter_child_nodes(node))
    return sorted(found, key=lambda x: x[1])


def test_the_toy_rule_sees_chains_through_tools_and_module_level_imports(tmp_path):
    # the checker itself: a real-run module reaching the toy world through a tool is a chain; a tool's import of it
    # inside a function is allowed, one at module level (also under a class or an `if`) is not
    (tmp_path / "mmpg" / "toy").mkdir(parents=True)
    sources = {"mmpg/train.py": "def f():\n    from mmpg import bench\n",
               "mmpg/bench.py": "def g():\n    import mmpg.toy.models\n\nclass C:\n    if True:\n"
                                "        from mmpg.toy import videos\n",
               "mmpg/toy/models.py": "", "mmpg/toy/videos.py": ""}
    for name, text in sources.items():
        (tmp_path / name).write_text(text)
    files = {name[:-3].replace("/", "."): tmp_path / name for name in sources}
    graph = import_graph(files)
    assert _real_run(files) == ["mmpg.train"]
    assert _chains(graph, _real_run(files), (TOY,)) == [
        "mmpg.train (line 2) -> mmpg.bench (line 2) -> mmpg.toy.models",
        "mmpg.train (line 2) -> mmpg.bench (line 6) -> mmpg.toy.videos"]
    assert module_level_imports(files["mmpg.bench"], "mmpg.bench", files) == [("mmpg.toy.videos", 6)]


def test_nothing_a_real_run_needs_imports_the_toy_world():
    files = {**_modules("mmpg"), **_modules("app", "mmpg_app")}
    graph = import_graph(files)
    real = _real_run(files)
    needed = ("mmpg.grouping", "mmpg.models", "mmpg.data", "mmpg.rl", "mmpg.rollout", "mmpg.train", "mmpg.sft",
              "mmpg.eval", "mmpg.runs", "mmpg.serve", "mmpg.config", "mmpg.rewards", "mmpg.dist", "mmpg.errors",
              "mmpg_app")
    assert all(any(_inside(m, (p,)) for m in real) for p in needed)  # the walk saw what a real run needs
    assert any(_inside(t, (TOY,)) for m in files if _inside(m, TOOLS) for t in graph.get(m, {}))  # and the tools' use
    bad = _chains(graph, real, (TOY,))
    assert not bad, "what a real run needs imports the toy world (mmpg/toy; move what it needs out of it):\n" + \
        "\n".join(bad)


def test_the_tools_import_the_toy_world_only_inside_functions():
    # `mmpg --help` and a real run's `mmpg train` load mmpg.cli: the toy world (and the torch it imports) is loaded by
    # the commands that use it, not by importing a tool
    files = _modules("mmpg")
    bad = [f"{files[m].relative_to(ROOT)}:{line} imports {name} at module level"
           for m in sorted(files) if _inside(m, TOOLS)
           for name, line in module_level_imports(files[m], m, files) if _inside(name, (TOY,))]
    assert not bad, "\n".join(bad)


def test_grouping_imports_nothing_of_mmpg_outside_itself():
    # mmpg/grouping is the grouped forward any trainer can use on its own: no import (module level or inside a
    # function) reaches another mmpg package, and importing `mmpg` alone is no edge (its __init__ imports nothing)
    graph = import_graph()
    grouping = [m for m in _modules() if m == "mmpg.grouping" or m.startswith("mmpg.grouping.")]
    assert "mmpg.grouping.layout" in grouping  # the walk saw the package
    bad = [f"{m} -> {target} (line {line})" for m in grouping for target, line in sorted(graph.get(m, {}).items())
           if target != "mmpg" and not (target == "mmpg.grouping" or target.startswith("mmpg.grouping."))]
    assert not bad, "mmpg/grouping imports mmpg outside itself (move the dependency into mmpg/grouping or invert " \
                    "it):\n" + "\n".join(bad)


def _test_module_names(folder: Path = ROOT / "tests") -> set[str]:
    """The names a test module or helper is imported by (pytest puts tests/ on the path): file stems, and `tests`."""
    return {p.stem for p in folder.glob("*.py")} | {"tests"}



def top_level_imports(path: Path) -> list[tuple[str, int]]:
    """(first part of the imported name, line) of every absolute import in a file, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name.split(".")[0], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append((node.module.split(".")[0], node.lineno))
    return found


def test_the_test_module_check_sees_deferred_imports(tmp_path):
    (tmp_path / "synthetic_run.py").write_text("")
    lib = tmp_path / "lib.py"
    lib.write_text("import os\n\ndef f():\n    from synthetic_run import make_small_run\n    import tests.x\n")
    found = [x for x in top_level_imports(lib) if x[0] in _test_module_names(tmp_path)]
    assert found == [("synthetic_run", 4), ("tests", 5)]


def test_no_library_code_imports_a_test_module():
    # tests/synthetic_run.py (the inspector tests' small run) and the other helpers in tests/ are fixtures: mmpg/
    # and the inspector (app/) never import them, also not inside a function; and the inspector is imported by its
    # installed name, mmpg_app, never as `app`
    forbidden = _test_module_names()
    assert {"synthetic_run", "conftest", "train_utils"} <= forbidden  # the walk saw tests/
    bad = [f"{path.relative_to(ROOT)}:{line} imports {name}"
           for folder in ("mmpg", "app") for path in sorted((ROOT / folder).rglob("*.py"))
           for name, line in top_level_imports(path) if name in forbidden or name == "app"]
    bad += [f"{path.relative_to(ROOT)}:{line} imports app (the inspector is mmpg_app)"
            for path in sorted((ROOT / "tests").glob("*.py")) for name, line in top_level_imports(path)
            if name == "app"]
    assert not bad, "\n".join(bad)
