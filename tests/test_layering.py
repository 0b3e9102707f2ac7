"""Layers import downward only; checked by parsing every module's imports.

The order of the layers is written here once (``SERVER_LAYERS``, ``CACHE_LAYERS``) and
printed the same in docs/architecture.md, which a test compares."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from doc_pages import DOCS, section

REPO = Path(__file__).resolve().parents[1]

# The cache domain knows nothing of transport, metrics, config files or the layers above it.
CACHE_FORBIDDEN = (
    "grpc",
    "grpc_health",
    "grpc_reflection",
    "grpc_status",
    "prometheus_client",
    "yaml",
    "zmq",
    "msgpack",
    "google.protobuf",
    "prefixcache.server",
    "prefixcache.client",
    "prefixcache.v1",
)
# What a worker imports must load fast and without torch; it may reach the
# cache's plain types only lazily, inside functions.
CLIENT_FORBIDDEN_AT_IMPORT = ("torch", "prefixcache.server", "prefixcache.cache")
SERVER_FORBIDDEN = ("prefixcache.client",)
# Engine integrations sit on top of the client. Their cores are engine-free: only the
# adapter modules named here import their engine, and nothing else under
# prefixcache.integrations imports any engine, even lazily.
ENGINES = ("vllm", "sglang")
ENGINE_ADAPTERS = {
    "prefixcache/integrations/vllm/connector.py": ("vllm",),
    "prefixcache/integrations/sglang/backend.py": ("sglang",),
}
INTEGRATIONS_FORBIDDEN_AT_IMPORT = ("torch", "prefixcache.server", "prefixcache.cache")
CLIENT_FORBIDDEN = ("prefixcache.integrations",)
# Wire formats both sides speak (prefixcache.wire): the client and the server import
# them, so they hold neither's specifics and load with the standard library alone.
WIRE_FORBIDDEN = (
    "prefixcache.client",
    "prefixcache.server",
    "prefixcache.cache",
    "prefixcache.integrations",
    "prefixcache.v1",
    "torch",
    "grpc",
    "google.protobuf",
)


def imported_modules(source: str, package: str, *, import_time_only: bool = False) -> set[str]:
    """Every module that `source`, a module of `package`, may import.

    `from a import b` yields both `a` and `a.b`, since `b` may be a submodule.
    Relative imports are resolved against `package`. With `import_time_only`,
    imports inside function bodies and `if TYPE_CHECKING:` blocks are ignored.
    """
    found: set[str] = set()
    for node in _walk(ast.parse(source), import_time_only):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # one dot is `package` itself; each further dot goes up a level
                parent = package.rsplit(".", node.level - 1)[0]
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
    return found


def violations(modules: set[str], forbidden: tuple[str, ...]) -> list[str]:
    """The modules in `modules` that are, or live under, one of `forbidden`."""
    return sorted(m for m in modules if any(m == f or m.startswith(f"{f}.") for f in forbidden))


def _walk(tree: ast.AST, import_time_only: bool) -> Iterator[ast.AST]:
    for child in ast.iter_child_nodes(tree):
        if import_time_only:
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                continue
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                # Only the `else:` branch runs at import time.
                yield from _walk(ast.Module(body=child.orelse, type_ignores=[]), import_time_only)
                continue
        yield child
        yield from _walk(child, import_time_only)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _modules_under(root: Path, package_dir: str) -> list[tuple[Path, str]]:
    """(path, package the module lives in) for every .py file under root/package_dir."""
    return [
        (path, ".".join(path.relative_to(root).parts[:-1]))
        for path in sorted((root / package_dir).rglob("*.py"))
    ]


def _check(
    root: Path, package_dir: str, forbidden: tuple[str, ...], *, import_time_only: bool = False
) -> list[str]:
    modules = _modules_under(root, package_dir)
    assert modules, f"no modules under {root / package_dir}: the check would pass vacuously"
    problems = []
    for path, package in modules:
        imported = imported_modules(path.read_text(), package, import_time_only=import_time_only)
        bad = violations(imported, forbidden)
        problems += [f"{path.relative_to(REPO)} imports {module}" for module in bad]
    return problems


def import_graph(roots: list[Path]) -> dict[str, set[str]]:
    """Module name -> the product modules it imports, for every module under ``roots``.

    Every import statement is an edge, wherever it stands: at module level, inside a
    function, or under ``if TYPE_CHECKING:`` (a cycle hidden in one is still a cycle).
    Generated protobuf code (``v1``) is left out. A package's ``__init__`` is never a
    target: ``from . import x`` names the package, and every package's ``__init__``
    imports its own modules, so counting those edges would make each package one cycle.
    """
    files: dict[str, tuple[Path, str]] = {}
    for root in roots:
        for path in sorted((root / "prefixcache").rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if "v1" in parts or "__pycache__" in parts or "_pb2" in path.name:
                continue
            package = ".".join(parts[:-1])
            name = package if parts[-1] == "__init__" else ".".join(parts)
            files[name] = (path, package)
    targets = {n for n, (path, _) in files.items() if path.name != "__init__.py"}
    return {
        name: (imported_modules(path.read_text(), package) & targets) - {name}
        for name, (path, package) in files.items()
    }


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def test_cache_imports_nothing_above_it() -> None:
    """prefixcache.cache imports the standard library and torch, never the service stack."""
    assert _check(REPO / "server", "prefixcache/cache", CACHE_FORBIDDEN) == []


def test_client_imports_no_torch_or_server_at_import_time() -> None:
    """prefixcache.client loads without torch, the cache or the server."""
    problems = _check(
        REPO / "client", "prefixcache/client", CLIENT_FORBIDDEN_AT_IMPORT, import_time_only=True
    )
    assert problems == []


def test_server_does_not_import_client() -> None:
    """The service sits beside the client, not on top of it."""
    assert _check(REPO / "server", "prefixcache/server", SERVER_FORBIDDEN) == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import grpc.aio", ["grpc.aio"]),
        ("from google import protobuf", ["google.protobuf"]),
        ("from ..server import app", ["prefixcache.server", "prefixcache.server.app"]),
        ("from .. import v1", ["prefixcache.v1"]),
        ("def f():\n    import yaml", ["yaml"]),
        ("import grpc_tools", []),
        ("from . import key\nimport torch", []),
    ],
)
def test_checker_flags_bad_cache_sources(source: str, expected: list[str]) -> None:
    """The checker itself can fail: synthetic bad sources are caught, good ones pass."""
    imported = imported_modules(source, "prefixcache.cache")
    assert violations(imported, CACHE_FORBIDDEN) == expected


def test_checker_import_time_rules() -> None:
    """Lazy and TYPE_CHECKING imports are allowed in the client; module-level ones are not."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "import torch\n"
        "if TYPE_CHECKING:\n    from prefixcache.cache import RadixKey\n"
        "else:\n    from prefixcache.server import cli\n"
        "def lazy():\n    from prefixcache.cache import RadixKey\n"
    )
    imported = imported_modules(source, "prefixcache.client", import_time_only=True)
    assert violations(imported, CLIENT_FORBIDDEN_AT_IMPORT) == [
        "prefixcache.server",
        "prefixcache.server.cli",
        "torch",
    ]


def test_importing_client_does_not_load_torch(tmp_path: Path) -> None:
    """The real import, not just the parsed one: torch stays out of sys.modules."""
    code = "import prefixcache.client, sys; assert 'torch' not in sys.modules, 'torch loaded'"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_client_does_not_import_integrations() -> None:
    """The integrations use the client, never the other way round."""
    assert _check(REPO / "client", "prefixcache/client", CLIENT_FORBIDDEN) == []


def test_wire_formats_are_neutral_ground() -> None:
    """prefixcache.wire imports nothing of the client, the server or the cache (not
    even lazily), nor torch, gRPC or protobuf: both sides may import it."""
    assert _check(REPO / "client", "prefixcache/wire", WIRE_FORBIDDEN) == []


def test_only_engine_adapters_import_engines() -> None:
    """An integration's core runs and is tested without its engine: only its adapter
    module imports the engine, and the cores load without torch, server or cache."""
    root = REPO / "client"
    problems = []
    for path, package in _modules_under(root, "prefixcache/integrations"):
        rel = path.relative_to(root).as_posix()
        allowed = ENGINE_ADAPTERS.get(rel, ())
        engines = tuple(e for e in ENGINES if e not in allowed)
        source = path.read_text()
        bad = violations(imported_modules(source, package), engines)
        if not allowed:
            bad += violations(
                imported_modules(source, package, import_time_only=True),
                INTEGRATIONS_FORBIDDEN_AT_IMPORT,
            )
        problems += [f"{rel} imports {module}" for module in bad]
    assert problems == []
    for rel in ENGINE_ADAPTERS:
        assert (root / rel).is_file(), f"{rel} is listed as an adapter but does not exist"


def test_importing_an_integration_loads_no_engine(tmp_path: Path) -> None:
    """The real import: the package (and its cores) without vLLM or torch."""
    code = (
        "import sys, prefixcache.integrations.vllm, prefixcache.integrations.vllm.scheduler,"
        " prefixcache.integrations.vllm.worker; "
        "assert not {'vllm', 'torch'} & set(sys.modules), 'engine or torch loaded'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_no_import_cycles() -> None:
    """No import cycle anywhere in server/ or client/, counting every import statement
    (module level, in a function or under TYPE_CHECKING): a layer's modules import
    downward, and shared names live below both users."""
    graph = import_graph([REPO / "server", REPO / "client"])
    # Not vacuous: the walk found the packages and their imports.
    assert {
        "prefixcache.cache.radix.radix_cache",
        "prefixcache.server.engine.model_engine",
        "prefixcache.client.sync",
    } <= set(graph)
    assert "prefixcache.cache.inspection" in graph["prefixcache.cache.radix.radix_cache"]
    assert import_cycles(graph) == []


def test_cycle_finder_sees_hidden_cycles(tmp_path: Path) -> None:
    """The cycle check itself can fail: cycles through a function-level import and a
    TYPE_CHECKING import are found; importing a package's __init__ is not a cycle."""
    pkg = tmp_path / "prefixcache" / "demo"
    pkg.mkdir(parents=True)
    (tmp_path / "prefixcache" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from .a import A\nfrom .c import C\n")
    (pkg / "a.py").write_text("from .b import B\nA = 1\n")
    (pkg / "b.py").write_text("def f():\n    from .a import A\n    return A\nB = 2\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nfrom . import d\n"
        "if TYPE_CHECKING:\n    from prefixcache.demo.e import E\nC = 3\n"
    )
    (pkg / "d.py").write_text("from prefixcache.demo import A\n")
    (pkg / "e.py").write_text("import prefixcache.demo.c\nE = 4\n")
    graph = import_graph([tmp_path])
    assert graph["prefixcache.demo.d"] == set()  # the package's __init__ is no target
    assert import_cycles(graph) == [
        ["prefixcache.demo.a", "prefixcache.demo.b"],
        ["prefixcache.demo.c", "prefixcache.demo.e"],
    ]


# ------------------------------------------------------------------ package rules

MAX_MODULES_PER_FOLDER = 15


def unit_of(module: str, packages: set[str]) -> str:
    """The unit a module belongs to in the package graph: its subpackage one level below
    a top package (``prefixcache.server.rpc``), or, for a module directly in a top
    package (``prefixcache.server.app``), the module itself."""
    parts = module.split(".")
    if len(parts) >= 4 and ".".join(parts[:3]) in packages:
        return ".".join(parts[:3])
    return module


def package_graph(roots: list[Path]) -> dict[str, set[str]]:
    """``import_graph`` with each subpackage folded into one node (package __init__
    files left out: a facade re-exports downward by design)."""
    packages = {
        ".".join(init.parent.relative_to(root).parts)
        for root in roots
        for init in (root / "prefixcache").rglob("__init__.py")
    }
    folded: dict[str, set[str]] = {}
    for name, targets in import_graph(roots).items():
        if name in packages:
            continue
        unit = unit_of(name, packages)
        folded.setdefault(unit, set()).update(
            u for u in (unit_of(t, packages) for t in targets) if u != unit
        )
    return folded


def test_packages_import_one_way() -> None:
    """Subpackages are layers: no two of them (or a package and a module beside it)
    import each other, even through others."""
    graph = package_graph([REPO / "server", REPO / "client"])
    assert {
        "prefixcache.server.rpc",
        "prefixcache.server.engine",
        "prefixcache.cache.pools",
        "prefixcache.client.worker",
    } <= set(graph)
    assert "prefixcache.server.sessions" in graph["prefixcache.server.engine"]
    assert import_cycles(graph) == []


# The layers of the service and of the cache library, bottom first. A unit (a subpackage,
# or a module that sits directly in the package) imports only units of lower layers;
# units of one layer do not import each other. Every unit is listed, so a new one needs
# a place here (and in docs/architecture.md, which prints this list).
SERVER_LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "logs", "listen", "signals", "metrics_http"),
    ("config",),
    ("access",),
    ("codec", "sessions"),
    ("engine",),
    ("memory",),
    ("service",),
    ("events", "metrics", "reaper"),
    ("rpc",),
    ("tier",),
    ("app",),
    ("run", "cli_explain"),
    ("cli_remote",),
    ("cli",),
)
CACHE_LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "slot_values", "distinct"),
    ("key", "pages", "pools"),
    ("node", "hashing", "base"),
    ("eviction", "index", "chunk_cache", "retention"),
    ("inspection",),
    ("radix",),
    ("mamba", "slot", "trie"),
)
LAYERED = {"prefixcache.server": SERVER_LAYERS, "prefixcache.cache": CACHE_LAYERS}


def layer_violations(
    graph: dict[str, set[str]], package: str, layers: tuple[tuple[str, ...], ...]
) -> list[str]:
    """Every import in ``graph`` (module -> modules) between units of ``package`` that
    does not go to a strictly lower layer, as "importer imports imported (why)"; and
    every unit of ``package`` that ``layers`` does not place."""
    rank = {unit: i for i, group in enumerate(layers) for unit in group}
    prefix = package + "."

    def unit(module: str) -> str | None:
        return module[len(prefix) :].split(".")[0] if module.startswith(prefix) else None

    problems = []
    for module, targets in sorted(graph.items()):
        here = unit(module)
        if here is None:
            continue
        if here not in rank:
            problems.append(f"{module} is in no layer of {package}")
            continue
        for target in sorted(targets):
            there = unit(target)
            if there is None or there == here or there not in rank:
                continue
            if rank[there] >= rank[here]:
                where = "the same layer as" if rank[there] == rank[here] else "a layer above"
                problems.append(f"{module} imports {target} ({there} is in {where} {here})")
    return problems


@pytest.mark.parametrize("package", sorted(LAYERED))
def test_layers_import_downward_only(package: str) -> None:
    """Import by import (module level, in a function or under TYPE_CHECKING), each unit
    of the service and of the cache library imports only units of lower layers."""
    graph = import_graph([REPO / "server", REPO / "client"])
    layers = LAYERED[package]
    units = {
        name[len(package) + 1 :].split(".")[0] for name in graph if name.startswith(package + ".")
    }
    listed = {unit for group in layers for unit in group}
    assert sorted(listed - units) == [], "layers name units that do not exist"
    assert layer_violations(graph, package, layers) == []


def test_the_layer_check_can_fail() -> None:
    """Upward imports, imports within one layer and unplaced units are all reported;
    imports inside one unit and out of the package are not."""
    graph = {
        "p.low.a": {"p.high", "p.low.b", "q.x"},
        "p.mid": {"p.side"},
        "p.high": {"p.low.a"},
        "p.stray": set(),
    }
    layers = (("low",), ("mid", "side"), ("high",))
    assert layer_violations(graph, "p", layers) == [
        "p.low.a imports p.high (high is in a layer above low)",
        "p.mid imports p.side (side is in the same layer as mid)",
        "p.stray is in no layer of p",
    ]


def layer_diagram(layers: tuple[tuple[str, ...], ...]) -> str:
    """The layers as docs/architecture.md prints them: top first, one layer a line."""
    return "\n".join(", ".join(group) for group in reversed(layers))


def test_the_architecture_page_prints_the_checked_order() -> None:
    """docs/architecture.md shows the same layers, in the same order, as this file."""
    blocks = re.findall(
        r"^```text\n(.*?)^```",
        section(DOCS / "architecture.md", "Layers"),
        re.DOTALL | re.MULTILINE,
    )
    assert [b.rstrip("\n") for b in blocks] == [
        layer_diagram(SERVER_LAYERS),
        layer_diagram(CACHE_LAYERS),
    ]


def test_package_folding_finds_cycles(tmp_path: Path) -> None:
    """The package check itself can fail: two subpackages importing each other through
    different modules form a cycle, though no module cycle exists."""
    top = tmp_path / "prefixcache" / "top"
    for sub in ("low", "high"):
        (top / sub).mkdir(parents=True)
        (top / sub / "__init__.py").write_text("")
    (top / "__init__.py").write_text("")
    (top / "low" / "a.py").write_text("from ..high.c import C\n")
    (top / "high" / "c.py").write_text("C = 1\n")
    (top / "high" / "d.py").write_text("from ..low.b import B\n")
    (top / "low" / "b.py").write_text("B = 2\n")
    assert import_cycles(import_graph([tmp_path])) == []
    assert import_cycles(package_graph([tmp_path])) == [
        ["prefixcache.top.high", "prefixcache.top.low"]
    ]


def test_no_product_folder_holds_more_than_15_modules() -> None:
    """Folders whose names are the architecture: none grows into a flat heap."""
    big = {}
    for root in (REPO / "server", REPO / "client"):
        for folder in {p.parent for p in (root / "prefixcache").rglob("*.py")}:
            if folder.name in ("v1", "__pycache__"):
                continue
            modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
            if len(modules) > MAX_MODULES_PER_FOLDER:
                big[str(folder.relative_to(REPO))] = len(modules)
    assert big == {}


def test_every_package_says_what_it_is() -> None:
    """Each package's __init__ has a docstring (what it is and what it may import)."""
    bare = [
        str(init.relative_to(REPO))
        for root in (REPO / "server", REPO / "client")
        for init in (root / "prefixcache").rglob("__init__.py")
        if "v1" not in init.parts and ast.get_docstring(ast.parse(init.read_text())) is None
    ]
    assert bare == []
