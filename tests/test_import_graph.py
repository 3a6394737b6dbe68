"""The project's modules import each other without a circle, and the layers point one way: the data layer
does not import the run's config, the algorithm registry does not import the data layer, and neither the
product nor its tests and deployment scripts import the measurement scripts (benchmarks/). Every import
counts, at module level or inside a function (a lazy import is still a dependency). Reads source only."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fedrec_flwr", "clients", "strategies")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The project module an import of `name` loads (the longest known prefix), or None if it is not ours."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def _imported_names(path: Path, package: str) -> list[str]:
    """Every name an import in the file at `path` loads (anywhere in its body), relative ones made absolute
    from `package`; `from a import b` gives both `a.b` and `a`."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names += [f"{base}.{a.name}" for a in node.names] + [base]
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (anywhere in its body)."""
    known = _modules()
    graph: dict[str, set[str]] = {m: set() for m in known}
    for module, path in known.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for name in _imported_names(path, package):
            target = _resolve(name, known)
            if target is not None and target != module:
                graph[module].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _reaches(graph: dict[str, set[str]], start: str, prefix: str) -> list[str]:
    """Modules starting with `prefix` that `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for w in graph[todo.pop()]:
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return sorted(m for m in seen if m == prefix or m.startswith(prefix + "."))


def test_no_module_imports_itself_through_others():
    assert _cycles(import_graph()) == []


def test_the_data_layer_does_not_import_the_run_config():
    graph = import_graph()
    data_layer = [m for m in graph if m == "fedrec_flwr.data" or m.startswith("fedrec_flwr.data.")]
    assert "fedrec_flwr.data" in data_layer and len(data_layer) > 1  # the graph holds the layer being checked
    for module in data_layer:
        assert _reaches(graph, module, "fedrec_flwr.config") == [], module


def test_the_algorithm_registry_does_not_import_the_data_layer():
    assert _reaches(import_graph(), "fedrec_flwr.algorithms", "fedrec_flwr.data") == []


def test_neither_the_product_nor_its_tests_and_deployment_import_the_benchmarks():
    """benchmarks/ holds measurement scripts only: a check users rely on lives in tests/ and imports the product
    (a benchmark is run as a subprocess, which is not an import)."""
    files = [p for folder in (*PACKAGES, "tests", "deploy") for p in sorted((ROOT / folder).rglob("*.py"))]
    assert any(p.parent.name == "tests" for p in files) and any(p.parent.name == "deploy" for p in files)
    found = []
    for path in files:
        rel = path.relative_to(ROOT)
        package = ".".join(rel.parent.parts)  # a relative import inside tests/ or deploy/ stays there
        found += [(str(rel), n) for n in _imported_names(path, package) if n == "benchmarks"
                  or n.startswith("benchmarks.")]
    assert found == []


def test_the_graph_sees_lazy_and_relative_imports():
    """The check reads what it claims to: a function-level import and a relative one are edges."""
    graph = import_graph()
    # imported inside run_centralized_reference
    assert "fedrec_flwr.reference.centralized" in graph["fedrec_flwr.cli.runner"]
    assert "fedrec_flwr.data.types" in graph["fedrec_flwr.data.loaders"]  # `from .types import ...`


REGISTRIES = {"fedrec_flwr.privacy_modes", "fedrec_flwr.algorithms"}


def _name_branches(path: Path, names: set[str]) -> list[str]:
    """The comparisons in a file that test `*.privacy.mode` or `*.algorithm` (a run config's), or compare anything
    with a privacy mode's name in `names` (`x == "user_dp"`, `x in ("ldp", ...)`): a branch on a mode's or an
    algorithm's name. (A data file's own format tag, such as a node catalogue's "algorithm" key, is not a run's.)"""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Compare):
            continue
        for side in [node.left, *node.comparators]:
            text = ast.unparse(side)
            constants = [c.value for c in ast.walk(side) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
            if text.endswith("privacy.mode") or text.endswith(".algorithm") or set(constants) & names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
                break
    return found


def test_only_the_registries_branch_on_a_privacy_mode_or_an_algorithm_name():
    """A privacy mode is a plug-in (fedrec_flwr/privacy_modes.py names its module; fedrec_flwr/fedgnn/modes/ holds its
    device and server mechanisms) and an algorithm an entry of fedrec_flwr/algorithms.py: nothing else compares
    `privacy.mode` or `cfg.algorithm` with a name, so a new mode or algorithm needs no edit elsewhere."""
    from fedrec_flwr.algorithms import ALGORITHMS
    from fedrec_flwr.privacy_modes import PRIVACY_MODES

    names = set(PRIVACY_MODES)
    assert not names & set(ALGORITHMS)
    modules = _modules()
    found = [hit for module, path in sorted(modules.items())
             if module not in REGISTRIES and not module.startswith("fedrec_flwr.fedgnn.modes")
             for hit in _name_branches(path, names)]
    assert found == [], "\n".join(found)
    planted = ROOT / "tests" / "_planted_branch.py"  # the check sees such a branch
    try:
        planted.write_text('def f(cfg):\n    return cfg.privacy.mode == "user_dp" or cfg.algorithm != "fppdm"\n')
        assert len(_name_branches(planted, names)) == 2
    finally:
        planted.unlink()


# the layers, from the bottom; a module may import its own layer and the ones below, never one above
LAYERS = [
    ("base", ["fedrec_flwr.config", "fedrec_flwr.algorithms", "fedrec_flwr.privacy_modes", "fedrec_flwr.messages",
              "fedrec_flwr.metrics", "fedrec_flwr.fsutil", "fedrec_flwr.progress", "fedrec_flwr.node_list",
              "fedrec_flwr.data", "fedrec_flwr.models", "fedrec_flwr.privacy", "fedrec_flwr.neighbours"]),
    ("reference and reporting", ["fedrec_flwr.reporting", "fedrec_flwr.reference"]),
    ("cores", ["fedrec_flwr.fedgnn", "fedrec_flwr.fppdm"]),
    ("Flower", ["fedrec_flwr.flower", "clients", "strategies"]),
    ("front end", ["fedrec_flwr.cli", "fedrec_flwr.deployment", "fedrec_flwr.audit"]),
]
FLOWER = ("fedrec_flwr.flower", "clients", "strategies")


def _layer(module: str) -> int | None:
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    return len(LAYERS) if module == "fedrec_flwr" else None


def _within(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_every_module_has_a_layer_and_no_arrow_runs_back_up():
    """docs/architecture.md's layers: base, reference and reporting, the Flower-free cores, Flower, the front end."""
    graph = import_graph()
    assert [m for m in graph if _layer(m) is None] == []
    up = [f"{m} ({LAYERS[_layer(m)][0]}) -> {d} ({LAYERS[_layer(d)][0]})"
          for m, deps in sorted(graph.items()) if m != "fedrec_flwr" for d in sorted(deps) if _layer(d) > _layer(m)]
    assert up == [], "\n".join(up)


def test_only_the_flower_layer_imports_flwr():
    """The cores, the reporting and the front end are Flower-free; only fedrec_flwr.flower, strategies/ and clients/
    import flwr (the front end runs `flwr` as a command, not as a library)."""
    found = []
    for module, path in sorted(_modules().items()):
        if _within(module, FLOWER):
            continue
        found += [f"{module}: {n}" for n in _imported_names(path, module.rpartition(".")[0])
                  if n == "flwr" or n.startswith("flwr.")]
    assert found == [], "\n".join(found)
    assert any(n.startswith("flwr") for n in _imported_names(ROOT / "strategies" / "fedgnn.py", "strategies"))
