"""The layout's rules (docs/layout.md), read from the code's own syntax trees: imports between the project's
modules run one way (no cycle, with imports inside functions counted); an internal import inside a function says
why in a ``lazy:`` comment; no function in harness/, evals/ or retrieval/ runs past 80 lines; the engine and the
report name no task."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("harness", "evals", "retrieval")

# The layers, lowest first: a module imports modules of its own layer or below, never above (docs/layout.md).
# Groups are module-name prefixes; the longest matching prefix decides.
LAYERS = [
    ("leaves", ("harness", "harness.files", "harness.hashing", "harness.registry", "harness.hub", "harness.procs",
                "harness.cache", "harness.cuda_graphs", "harness.compiled_steps")),
    ("ops", ("harness.ops",)),
    ("models and the tool", ("harness.models", "retrieval")),
    ("tasks and backends", ("evals", "harness.backends")),
    ("engine", ("harness.engine",)),
    ("reports", ("harness.reports",)),
    ("training", ("harness.training",)),
    ("CLIs and tools", ("harness.eval", "harness.train", "harness.report", "harness.doctor", "harness.demo",
                        "harness.lm_eval", "harness.icr_lm", "harness.tiny", "harness.tools")),
]


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = f
    return out


MODULES = modules()


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The project modules an import statement loads (``from pkg import mod`` loads pkg.mod)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the module's package, up level - 1
            pkg = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join([*pkg, base] if base else pkg)
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    out = []
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != module:
            out.append(name)
    return out


def _runtime_imports(tree: ast.Module, annotations: bool = False):
    """Every import statement that runs (``if TYPE_CHECKING:`` blocks never do; ``annotations``: count them too),
    with whether it is inside a function."""
    skip = set() if annotations else {id(n) for top in tree.body if isinstance(top, ast.If)
                                      and "TYPE_CHECKING" in ast.unparse(top.test) for n in ast.walk(top)}
    inside = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skip:
            yield node, id(node) in inside


def import_graph(annotations: bool = False) -> tuple[dict[str, set[str]], list[str]]:
    """Module -> the project modules it imports (at the top or inside functions; ``annotations``: and under
    ``if TYPE_CHECKING:``), and the inside-function imports of project modules that do not say why."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    unexplained = []
    for module, path in MODULES.items():
        source = path.read_text()
        lines = source.split("\n")
        for node, in_function in _runtime_imports(ast.parse(source), annotations):
            targets = _targets(module, node)
            graph[module].update(targets)
            near = " ".join(lines[max(0, node.lineno - 2): node.end_lineno])
            if in_function and targets and "lazy:" not in near:
                unexplained.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return graph, unexplained


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    tree = ast.parse("def f():\n    from harness.engine import run\n")
    ((node, in_function),) = list(_runtime_imports(tree))
    assert in_function and _targets("harness.engine.audit", node) == ["harness.engine.run"]


def test_imports_between_modules_run_one_way():
    graph, unexplained = import_graph()
    assert sum(len(v) for v in graph.values()) > 150  # the scan sees the project's imports
    assert cycles(graph) == []
    assert unexplained == [], "imports inside functions without a 'lazy:' reason:\n" + "\n".join(unexplained)


def test_no_cycle_hides_behind_annotation_only_imports():
    """An import under ``if TYPE_CHECKING:`` never runs, but a circle through one is still two modules that each
    need the other to be read: none is allowed (the check sees one where there is one)."""
    graph, _ = import_graph(annotations=True)
    assert cycles(graph) == []
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from harness.backends import step\n")
    found = {flag: [t for n, _ in _runtime_imports(tree, flag) for t in _targets("harness.backends.planner", n)]
             for flag in (False, True)}
    assert found == {False: [], True: ["harness.backends.step"]}


def test_the_backend_contract_is_the_ground_floor():
    """``harness.backends.base`` (requests, results, ``Backend``, ``StepModel`` and its abilities) imports no other
    backend module; the decode loop, the planner, the scorer and the memory probes read the contract, never the
    class that wires them (``step``); the engine and the report name no backend module (each backend class
    parses its own engine arguments)."""
    from harness.backends import BACKENDS, backend_class

    graph, _ = import_graph(annotations=True)
    assert not {m for m in graph["harness.backends.base"] if m.startswith("harness.backends")}
    for m in ("generation", "planner", "scoring", "memory", "prefix_tree"):
        assert "harness.backends.step" not in graph[f"harness.backends.{m}"], m
    backends = {backend_class(n).__module__ for n in BACKENDS.names()}
    assert "harness.backends.vllm_backend" in backends
    callers = [m for m in graph if m.startswith(("harness.engine", "harness.reports")) or m == "harness.report"]
    assert {m: sorted(graph[m] & backends) for m in callers if graph[m] & backends} == {}


def test_no_function_runs_past_80_lines():
    long = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})")
    assert not long, "\n".join(long)


def layer_of(module: str) -> int:
    """The rank of the layer whose longest prefix matches ``module``."""
    best = max(((len(p), rank) for rank, (_, prefixes) in enumerate(LAYERS) for p in prefixes
                if module == p or module.startswith(p + ".")), default=None)
    assert best is not None, f"{module} is in no layer of LAYERS: add it"
    return best[1]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
                  for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a))


def test_imports_run_down_the_layers():
    graph, _ = import_graph()
    assert upward_imports(graph) == []
    # and the check catches one: a backend importing the engine, a task importing a backend
    made_up = {**graph, "harness.backends.hf": graph["harness.backends.hf"] | {"harness.engine.run"},
               "evals.mqar": {"harness.training.trainer"}}
    assert len(upward_imports(made_up)) == 2


def task_modules() -> set[str]:
    """The registered tasks' modules and the evals modules only they import (not the task contract's)."""
    from evals import task_class, task_names

    graph, _ = import_graph()

    def closure(start):
        seen, todo = set(), list(start)
        while todo:
            m = todo.pop()
            if m not in seen and m.startswith("evals"):
                seen.add(m)
                todo.extend(graph[m])
        return seen

    registered = {task_class(n).__module__ for n in task_names()}
    return closure(registered) - closure({"evals", "evals.base", "evals.registry", "evals.sweep"})


def test_the_engine_and_the_report_name_no_task():
    TASK_MODULES = task_modules()
    assert {"evals.hotpotqa", "evals.mqar", "evals.istree", "evals.needle"} <= TASK_MODULES
    graph, _ = import_graph()
    generic = [m for m in graph if m.startswith("harness.engine") or m in ("harness.report", "harness.reports")
               or m.startswith("harness.reports.")]
    named = {m: sorted(graph[m] & TASK_MODULES) for m in generic if graph[m] & TASK_MODULES}
    assert named == {}
    for m in generic:
        source = MODULES[m].read_text()
        assert '== "hotpotqa"' not in source and '!= "hotpotqa"' not in source, m


def test_the_layout_page_names_every_module():
    """docs/layout.md names each module by its file name, under its folder's line (package ``__init__`` files
    aside)."""
    page = (ROOT / "docs" / "layout.md").read_text()
    missing = [str(p.relative_to(ROOT)) for p in MODULES.values() if p.name != "__init__.py" and p.name not in page]
    assert missing == [], f"docs/layout.md does not name: {', '.join(missing)}"


def test_test_files_share_code_only_through_helpers():
    """A test file imports another's code only from ``tests/helpers.py`` (a test module is not a library; its
    private helpers move with its tests)."""
    crossing = []
    for f in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests.test_") \
                    and node.module != f"tests.{f.stem}":
                crossing.append(f"{f.name}:{node.lineno} {ast.unparse(node)}")
    assert crossing == []


HELP_LOADS = """
import contextlib, io, json, runpy, sys

def model_code():
    return sorted(m for m in sys.modules if ".modeling_" in m or m == "harness.models.istree")

loaded = {}
for prog in sys.argv[1:]:
    sys.argv = [prog, "--help"]
    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
        runpy.run_module(prog, run_name="__main__", alter_sys=True)
    loaded[prog] = model_code()
import harness.models.istree  # what the check sees once model code is loaded: it can fail
loaded["control"] = model_code()
print("LOADED " + json.dumps(loaded))
"""


def test_the_first_commands_help_loads_no_model_code():
    """The lazy imports' reason (docs/layout.md): ``--help`` of the commands a user starts with answers without
    torch's and transformers' model modules (``python -m harness.train --help`` took 7-8 s, importing the IsTree
    models for one constant). The diagnostics (``harness.doctor``) load theirs."""
    import json
    import subprocess
    import sys

    progs = ["harness.eval", "harness.train", "harness.demo", "harness.report", "harness.tiny"]
    res = subprocess.run([sys.executable, "-c", HELP_LOADS, *progs], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("LOADED ")), None)
    assert line, res.stderr[-3000:]
    loaded = json.loads(line.removeprefix("LOADED "))
    assert "harness.models.istree" in loaded.pop("control")
    assert loaded == {p: [] for p in progs}
