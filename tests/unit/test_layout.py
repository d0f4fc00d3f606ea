"""The package's folders are its architecture: every module sits in a layer, and imports run one
way, top to bottom (docs/architecture.md):

    frontends/, integrations/  ->  model/  ->  engine/  ->  execution/  ->  cache/  ->  requests/

config.py (EngineConfig) is read by every layer and imports nothing of paged_hf. A module may
import its own folder and any layer below; layers of one rank (front ends and integrations; the
model side and patches/) may import each other.
Function-level and type-checking imports count too: a later change cannot add an upward arrow
quietly.
"""

from __future__ import annotations

import ast
import collections
import re
from pathlib import Path

import pytest

import paged_hf

REPO = Path(__file__).resolve().parents[2]

# rank of each layer: a module may import modules of its own rank or lower
LAYERS = {
    "paged_hf.config": 0,
    "paged_hf.requests": 1,
    "paged_hf.cache": 2,
    "paged_hf.execution": 3,
    "paged_hf.engine": 4,
    "paged_hf.model": 5,
    "paged_hf.patches": 5,
    "paged_hf.frontends": 6,
    "paged_hf.integrations": 6,
    "paged_hf.__main__": 7,
    "paged_hf": 7,
}
TOP_LEVEL_MODULES = {"__init__.py", "__main__.py", "config.py"}


def import_graph() -> dict[str, set[str]]:
    """paged_hf's modules and what each imports, function-level imports included."""
    files = {}
    for path in sorted((REPO / "paged_hf").rglob("*.py")) + sorted((REPO / "patches").glob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        parts = ("paged_hf",) + parts if parts[0] == "patches" else parts
        is_pkg = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_pkg else parts)
        files[name] = (path, name if is_pkg else ".".join(parts[:-1]))
    graph = collections.defaultdict(set)
    for name, (path, package) in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = (
                    package.split(".")[: len(package.split(".")) - node.level + 1]
                    if node.level
                    else []
                )
                target = (
                    ".".join(base + ([node.module] if node.module else []))
                    if node.level
                    else node.module
                )
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    graph[name].add(sub if sub in files else target)
            elif isinstance(node, ast.Import):
                graph[name].update(alias.name for alias in node.names)
        graph[name] = {t for t in graph[name] if t in files and t != name}
    return graph


def layer_of(module: str) -> str:
    """The layer a module belongs to: the longest key of LAYERS that is it or contains it."""
    candidates = [
        layer
        for layer in LAYERS
        if module == layer or (layer != "paged_hf" and module.startswith(layer + "."))
    ]
    if not candidates:
        raise AssertionError(
            f"{module} is in no layer: place it in a folder of docs/architecture.md's layout"
        )
    return max(candidates, key=len)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, targets in sorted(graph.items()):
        mine = layer_of(module)
        for target in sorted(targets):
            theirs = layer_of(target)
            if theirs != mine and LAYERS[theirs] > LAYERS[mine]:
                wrong.append(f"{module} ({mine}) imports {target} ({theirs}), a layer above it")
    return wrong


def test_every_module_sits_in_a_layer():
    graph = import_graph()
    for module in graph:
        layer_of(module)
    loose = sorted(p.name for p in (REPO / "paged_hf").glob("*.py"))
    assert set(loose) <= TOP_LEVEL_MODULES, (
        f"modules outside the role folders: {set(loose) - TOP_LEVEL_MODULES}"
    )


def test_imports_run_one_way_top_to_bottom():
    assert upward_imports(import_graph()) == []


def test_the_direction_check_sees_an_upward_import():
    graph = {
        "paged_hf.cache.block_pool": {"paged_hf.engine.scheduler"},
        "paged_hf.engine.step": {"paged_hf.model.patching"},
        "paged_hf.requests.request": {"paged_hf.config"},
        "paged_hf.frontends.cli": {"paged_hf.integrations.lm_eval"},
        "paged_hf.model.capability": {"paged_hf.patches"},
    }
    wrong = upward_imports(graph)
    assert len(wrong) == 2 and "block_pool" in wrong[0] and "step" in wrong[1], wrong
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("paged_hf.somewhere_new")


def test_paged_hf_has_no_import_cycles():
    graph = import_graph()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            assert state.get(nxt) != 1, f"import cycle: {' -> '.join(path + [nxt])}"
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_the_public_api_is_where_it_was():
    expected = {
        "Completion",
        "Engine",
        "EngineConfig",
        "QueueFull",
        "RequestOutput",
        "SamplingParams",
        "ScoreOutput",
        "UnsupportedModelError",
        "engine_for",
        "generate_dataset",
        "is_patched",
        "patch",
        "serve",
        "unpatch",
    }
    assert set(paged_hf.__all__) == expected
    for name in expected:
        assert getattr(paged_hf, name) is not None
    assert callable(paged_hf.serve)  # the function, not the module of the same name


def test_only_the_cpu_room_loads_the_cpu_library():
    """paged_hf's C++ library is built and loaded by execution/cpu/ops.py; everything else reaches
    the CPU's ops through the execution/cpu/ modules that use them."""
    reaching = sorted(
        module
        for module, targets in import_graph().items()
        if "paged_hf.execution.cpu.ops" in targets
        and not module.startswith("paged_hf.execution.cpu")
    )
    assert reaching == []
    sources = {p.name for p in (REPO / "paged_hf").rglob("*.cpp")}
    assert sources and all(
        p.parent == REPO / "paged_hf" / "execution" / "cpu" / "csrc"
        for p in (REPO / "paged_hf").rglob("*.cpp")
    ), sources


def test_every_module_is_on_the_map():
    """docs/architecture.md's map names every module (a package's __init__ by its folder's row),
    and every path it names exists."""
    text = (REPO / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"^\| `([^`]+)` \|", text, re.M))
    folders = set(re.findall(r"^\| \*\*([^*]+)\*\* \|", text, re.M))
    missing = []
    for path in sorted((REPO / "paged_hf").rglob("*.py")):
        rel = path.relative_to(REPO / "paged_hf").as_posix()
        if rel in named or (path.name == "__init__.py" and (rel[: -len("__init__.py")] in folders)):
            continue
        missing.append(rel)
    assert missing == [], f"modules missing from docs/architecture.md's map: {missing}"
    for rel in sorted(named | folders):
        where = REPO / rel if rel.startswith("patches") else REPO / "paged_hf" / rel
        assert where.exists(), f"docs/architecture.md names {rel}, which does not exist"


def test_integrations_never_import_front_ends():
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        if module.startswith("paged_hf.integrations")
        for target in targets
        if target.startswith("paged_hf.frontends")
    )
    assert wrong == []


def _sources() -> list[Path]:
    return sorted((REPO / "paged_hf").rglob("*.py")) + sorted((REPO / "patches").glob("*.py"))


def test_files_and_functions_stay_small():
    """No module over 450 lines and no function over 70 (docs/architecture.md): past that a
    reader loses the thread, and a split is cheaper now than later."""
    too_long = []
    for path in _sources():
        text = path.read_text()
        rel = path.relative_to(REPO).as_posix()
        if len(text.splitlines()) > 450:
            too_long.append(f"{rel}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 70:
                    too_long.append(f"{rel}:{node.lineno} {node.name}: {lines} lines")
    assert too_long == []


def test_the_engine_imports_nothing_from_transformers():
    """transformers' objects (criteria, processors, generation configs) stay on the model side:
    the engine runs requests, whatever built them."""
    wrong = []
    for path in sorted((REPO / "paged_hf" / "engine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            wrong += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "transformers"]
    assert wrong == []


def test_each_class_name_is_defined_once():
    """One class per name across the package (two classes named ``Engine`` sent readers to the
    wrong one)."""
    where = collections.defaultdict(list)
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(path.relative_to(REPO).as_posix())
    assert {name: files for name, files in where.items() if len(files) > 1} == {}
