"""The layer order of `src/codeplane`, checked on its import graph: no package imports one above
it or beside it, and no two packages import each other through any chain (no cycles).

A unit is a package (`codeplane/agent/`) or a top-level module (`codeplane/cli.py`); the
package root `codeplane/__init__.py` (its version) is the unit `codeplane`. Every `import`
statement in a module counts, wherever it stands: at module level, inside a function, or under
`if TYPE_CHECKING:`. A lazy import is a dependency that is only paid later, and a type-only
one still ties the two packages' designs together; counting only module-level imports would
let an upward dependency hide in a function body (the way `sandbox/workspace.py` once reached
`sandbox/fleet.py`). Names loaded by string (`importlib.import_module`) are not seen; the one
use, in `storage/__init__.py`, stays inside its package.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

import codeplane

SRC = Path(codeplane.__file__).parent

# Bottom to top. A unit may import the units of the layers below its own, never one of its
# own layer (peers are independent: the client-side indexer and the server's search never see
# each other, the sandbox reads no index) nor one above. Derived from the import graph: each
# layer holds what needs only the layers under it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("codeplane", "core", "config", "net"),  # version, error envelope, wire schemas, file
    # access, languages, settings: the primitives every compartment shares
    ("clikit",),  # --json, --server, --config, fail(): every compartment's CLI
    ("models", "storage"),  # local engine and registry; database and object store
    ("events", "indexing", "sandbox", "search"),  # event lake; client-side index; sandboxes
    # and workspaces; server-side search
    ("gateway",),  # routing, keys, limits, providers; in-process model clients
    ("apply", "tab"),
    ("agent",),  # the agent loop and its tools, over a workspace and the gateway
    ("background", "rl", "quickstart", "doctor"),  # what drives agents; first-run checks
    ("server",),  # the composition root: builds every service, mounts every router
    ("cli",),  # the `codeplane` command
    ("__main__",),
)


def unit_of(module: str) -> str:
    """`codeplane.agent.tools` -> `agent`; `codeplane.cli` -> `cli`; `codeplane` -> itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The modules an import statement loads (absolute names; `from pkg import mod` is mod)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: resolved against the importing module's package
        package = module.split(".")[: None if is_package else -1]
        package = package[: len(package) - node.level + 1]
        base = ".".join(package + ([node.module] if node.module else []))
    out = []
    for alias in node.names:
        where = SRC.parent / f"{base}.{alias.name}".replace(".", "/")
        out.append(f"{base}.{alias.name}" if where.with_suffix(".py").exists()
                   or where.is_dir() else base)
    return out


Edge = tuple[str, str, str, int]  # importing unit, imported unit, module, line


def file_edges(path: Path, module: str) -> set[Edge]:
    """The imports between two units that the module `module` (the file `path`) makes."""
    edges = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import | ast.ImportFrom):
            for target in imported(node, module, path.name == "__init__.py"):
                a, b = unit_of(module), unit_of(target)
                if target.split(".")[0] == "codeplane" and a != b:
                    edges.add((a, b, module, node.lineno))
    return edges


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    """Every import between two units of src/codeplane."""
    return sorted(set().union(*(file_edges(p, module_name(p)) for p in SRC.rglob("*.py"))))


def units() -> set[str]:
    found = {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    found |= {p.stem for p in SRC.glob("*.py") if p.name != "__init__.py"}
    return found | {"codeplane"}


def layer_index() -> dict[str, int]:
    return {unit: n for n, layer in enumerate(LAYERS, start=1) for unit in layer}


def against_the_order(edges: list[Edge]) -> list[str]:
    """Every import of a unit in the importer's own layer or above, as `module:line ...`
    (a unit in no layer is `test_every_package_has_one_layer`'s to report)."""
    level = layer_index()
    return [f"{where}:{line} {a} (layer {level[a]}) imports {b} (layer {level[b]})"
            for a, b, where, line in edges
            if a in level and b in level and level[b] >= level[a]]


def cycles(edges: list[Edge]) -> list[str]:
    """A cycle of units, if the graph has one (graphlib names one of them)."""
    graph: dict[str, set[str]] = {}
    for a, b, _, _ in edges:
        graph.setdefault(a, set()).add(b)
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        return [" -> ".join(exc.args[1])]
    return []


def test_every_package_has_one_layer() -> None:
    placed = [unit for layer in LAYERS for unit in layer]
    assert len(placed) == len(set(placed)), "a unit is in two layers"
    missing = units() - set(placed)
    assert not missing, f"not in any layer of LAYERS (tests/test_layers.py): {sorted(missing)}"


def test_contributing_shows_this_order() -> None:
    """CONTRIBUTING.md lists the layers for readers; this keeps its list the same as LAYERS."""
    text = (SRC.parents[1] / "CONTRIBUTING.md").read_text()
    for n, layer in enumerate(LAYERS, start=1):
        line = f"{n}. " + ", ".join(f"`{unit}`" for unit in layer)
        assert f"\n{line}\n" in text, f"CONTRIBUTING.md should list layer {n} as: {line}"


def test_no_import_against_the_layer_order(edges: list[Edge]) -> None:
    bad = against_the_order(edges)
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_no_package_cycle(edges: list[Edge]) -> None:
    found = cycles(edges)
    assert not found, f"package import cycle: {found}"


@pytest.mark.parametrize("line, kind", [
    ("from codeplane.agent.env import Environment", "upward"),
    ("    from codeplane.server import services", "upward, in a function"),
    ("from codeplane.search.service import SearchService", "beside"),
])
def test_the_checks_see_a_bad_import(edges: list[Edge], tmp_path: Path, line: str,
                                     kind: str) -> None:
    """One bad import added to `indexing/` fails the order check, and the cycle check too
    where it closes a loop (agent and server import indexing)."""
    probe = tmp_path / "probe.py"
    probe.write_text(f"def _probe() -> None:\n{line}\n" if line.startswith(" ") else line)
    added = file_edges(probe, "codeplane.indexing.probe")
    assert against_the_order(sorted(added)) and added, kind
    assert bool(cycles(edges + sorted(added))) == kind.startswith("upward"), kind
