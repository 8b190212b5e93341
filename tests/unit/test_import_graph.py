"""The import graph of every streamrl package: no circles, layers point down.

Static: each source file under ``libs/*/src`` and ``services/*/src`` is parsed (ast) and every
import in it is an edge, wherever it sits (module level, inside a function, under
``if TYPE_CHECKING``): a lazy import still ties the two modules together. The rules, from
docs/architecture.md and the style guide:

* no import circle between modules (two or more modules reaching each other through imports that
  run, module-level or lazy; a type-only import under ``if TYPE_CHECKING`` never runs and is left
  out of this rule alone);
* ``streamrl.common`` imports no torch, vLLM, DeepSpeed or transformers (every service imports it);
* no service imports another service (they meet only on the bus), ``streamrl.common`` imports no
  service, and neither imports ``streamrl.ops`` (the operator tooling sits on top of them all);
* nothing outside ``streamrl.learner.rl`` imports it but the learner's entry point
  (``__main__``): the learner's model layer (engine, forward, vision) sits below the RL layer.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVICES = ("coordinator", "rollout", "reward", "learner")
HEAVY = ("torch", "vllm", "deepspeed", "transformers")
"""What ``streamrl.common`` never imports."""
RL_LAYER = "streamrl.learner.rl"
RL_ENTRY = "streamrl.learner.__main__"
"""The learner's entry point: it wires the RL service, so it alone outside the RL layer imports it."""


@dataclass(frozen=True)
class Edge:
    """One import statement's target, as written (absolute, dotted)."""

    source: str
    target: str
    line: int
    typing_only: bool = False
    """Under ``if TYPE_CHECKING:``: read by type checkers, never run."""


def source_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of every package under libs/ and services/."""
    found: dict[str, Path] = {}
    for src in sorted([*REPO.glob("libs/*/src"), *REPO.glob("services/*/src")]):
        for path in sorted((src / "streamrl").rglob("*.py")):
            parts = path.relative_to(src).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _absolute(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of a relative ``from`` import (``level`` dots, then ``name``)."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def imports_of(module: str, path: Path) -> Iterator[Edge]:
    """Every import in ``path``, module-level or not; ``from a import b`` gives ``a.b`` (which
    :func:`resolve` shortens to ``a`` when ``b`` is a name, not a module)."""
    is_package = path.name == "__init__.py"

    def visit(node: ast.AST, typing_only: bool) -> Iterator[Edge]:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Edge(module, alias.name, node.lineno, typing_only)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, is_package, node.level, node.module) if node.level else (node.module or "")
            for alias in node.names:
                yield Edge(module, f"{base}.{alias.name}" if alias.name != "*" else base, node.lineno, typing_only)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                yield from visit(child, True)
            for child in node.orelse:
                yield from visit(child, typing_only)
            return
        for child in ast.iter_child_nodes(node):
            yield from visit(child, typing_only)

    yield from visit(ast.parse(path.read_text(), str(path)), False)


def resolve(target: str, modules: set[str]) -> str | None:
    """The streamrl module ``target`` names: itself or its longest prefix that is a module; None
    for a target outside the streamrl sources."""
    parts = target.split(".")
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        if name in modules:
            return name
    return None


def import_graph(*, runtime_only: bool = False) -> tuple[dict[str, set[str]], list[Edge]]:
    """(module -> the streamrl modules it imports, every import edge of every module); ``runtime_only``
    leaves out the imports under ``if TYPE_CHECKING:`` (from the graph and the edges)."""
    files = source_files()
    modules = set(files)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    edges: list[Edge] = []
    for module, path in files.items():
        for edge in imports_of(module, path):
            if runtime_only and edge.typing_only:
                continue
            edges.append(edge)
            target = resolve(edge.target, modules)
            if target is not None and target != module:
                graph[module].add(target)
    return graph, edges


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _where(edge: Edge) -> str:
    return f"{edge.source}:{edge.line} imports {edge.target}"


def test_the_graph_sees_relative_function_level_and_type_checking_imports(tmp_path: Path) -> None:
    """The walker the rules below rely on: every kind of import statement is an edge."""
    path = tmp_path / "mod.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import sibling\n"
        "from ..up import thing\n"
        "if TYPE_CHECKING:\n"
        "    import streamrl.common.bus\n"
        "def f():\n"
        "    from streamrl.common.codec import encode\n"
    )
    edges = list(imports_of("streamrl.pkg.sub.mod", path))
    targets = {e.target for e in edges}
    assert [e.target for e in edges if e.typing_only] == ["streamrl.common.bus"]
    assert targets >= {
        "streamrl.pkg.sub.sibling",
        "streamrl.pkg.up.thing",
        "streamrl.common.bus",
        "streamrl.common.codec.encode",
    }
    assert resolve("streamrl.common.codec.encode", {"streamrl.common.codec"}) == "streamrl.common.codec"
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_package_is_walked() -> None:
    modules = set(source_files())
    for package in ("common", "ops", *SERVICES):
        assert any(_inside(m, f"streamrl.{package}") for m in modules), f"no source found for streamrl.{package}"


def test_no_import_circle() -> None:
    """Imports that run (module level or in a function) never form a circle; a type-only import back
    (``if TYPE_CHECKING:``, e.g. ``tx`` naming ``Bus`` in its annotations) runs nowhere and may."""
    graph, _ = import_graph(runtime_only=True)
    found = circles(graph)
    assert not found, "import circles (each line: modules that import each other):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_common_imports_no_heavy_library() -> None:
    _, edges = import_graph()
    wrong = [
        _where(e)
        for e in edges
        if _inside(e.source, "streamrl.common") and any(_inside(e.target, heavy) for heavy in HEAVY)
    ]
    assert not wrong, "streamrl.common must not import torch / vLLM / DeepSpeed / transformers:\n" + "\n".join(wrong)


def test_no_service_imports_another_and_ops_sits_on_top() -> None:
    _, edges = import_graph()
    wrong = []
    for edge in edges:
        for service in SERVICES:
            if not _inside(edge.target, f"streamrl.{service}") or _inside(edge.source, f"streamrl.{service}"):
                continue
            if any(_inside(edge.source, f"streamrl.{other}") for other in (*SERVICES, "common")):
                wrong.append(_where(edge))
        below_ops = any(_inside(edge.source, f"streamrl.{p}") for p in (*SERVICES, "common"))
        if below_ops and _inside(edge.target, "streamrl.ops"):
            wrong.append(_where(edge))
    assert not wrong, "imports across services, or from common / a service upwards:\n" + "\n".join(wrong)


def test_only_the_rl_layer_imports_the_rl_layer() -> None:
    _, edges = import_graph()
    wrong = [
        _where(e)
        for e in edges
        if _inside(e.target, RL_LAYER) and not _inside(e.source, RL_LAYER) and e.source != RL_ENTRY
    ]
    assert not wrong, f"modules outside {RL_LAYER} import it (the model layer sits below it):\n" + "\n".join(wrong)
