"""The streamrl packages as their pyproject.toml files declare them, and what their code imports.

Shared by the packaging tests:

* :data:`PACKAGES`: each package's distribution name, source folder, dependencies, extras and
  ``streamrl.commands`` entry points, read from its ``pyproject.toml`` (not from the installed
  metadata, which is only as fresh as the last ``pip install``).
* :func:`imports`: every absolute import in a source file (AST), each marked module-level or not.
* :func:`optional_modules`: the package's modules that import, at module level, a distribution
  declared only in an extra (directly or through another such module); the rest must import with
  the hard dependencies alone.
* :func:`closure`: the installed distributions a package needs, following each distribution's
  ``Requires-Dist`` with its environment markers and extras.
* :func:`build_venv`: a fresh virtual environment (no system site-packages) in which exactly
  that closure is importable: links to those distributions' files (from their ``RECORD``) in its
  site-packages, and the streamrl packages through a ``.pth`` to their ``src`` folders.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import os
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[3]
IMPLIED = {"torch.utils.tensorboard": "tensorboard"}
"""Modules of one distribution that import another one the importer must declare itself."""


@dataclass(frozen=True)
class Package:
    """One streamrl package as its pyproject.toml declares it."""

    name: str
    """Short name: ``common``, ``torchkit``, ``ops``, ``coordinator``, ``rollout``, ``reward``, ``learner``."""
    root: Path
    """Folder of its pyproject.toml."""
    project: dict
    """Its ``[project]`` table."""

    @property
    def dist(self) -> str:
        return canonicalize_name(self.project["name"])

    @property
    def src(self) -> Path:
        return self.root / "src"

    @property
    def module(self) -> str:
        return f"streamrl.{self.name}"

    @property
    def extras(self) -> dict[str, list[Requirement]]:
        return {
            canonicalize_name(extra): [Requirement(r) for r in reqs]
            for extra, reqs in self.project.get("optional-dependencies", {}).items()
        }

    @property
    def commands(self) -> dict[str, str]:
        """``streamrl.commands`` entry points: name -> ``module:function``."""
        return dict(self.project.get("entry-points", {}).get("streamrl.commands", {}))

    def requirements(self, extras: Iterable[str] = ()) -> list[Requirement]:
        """Its dependencies, plus those of ``extras``, whose markers hold here."""
        reqs = [Requirement(r) for r in self.project.get("dependencies", [])]
        for extra in extras:
            reqs += self.extras[canonicalize_name(extra)]
        return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]

    def declared(self) -> tuple[set[str], set[str]]:
        """(hard dependencies, distributions named only in extras), canonical names, markers ignored."""
        hard = {canonicalize_name(Requirement(r).name) for r in self.project.get("dependencies", [])}
        optional = {canonicalize_name(r.name) for reqs in self.extras.values() for r in reqs}
        return hard, optional - hard

    def sources(self) -> Iterator[tuple[str, Path]]:
        """(dotted module name, file) of every module under ``src/streamrl/<name>``."""
        for path in sorted((self.src / "streamrl" / self.name).rglob("*.py")):
            parts = path.relative_to(self.src).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join(parts), path


def _load(name: str, root: Path) -> Package:
    return Package(name, root, tomllib.loads((root / "pyproject.toml").read_text())["project"])


PACKAGES = {
    "common": _load("common", REPO / "libs" / "common"),
    "torchkit": _load("torchkit", REPO / "libs" / "torchkit"),
    "ops": _load("ops", REPO / "libs" / "ops"),
    **{name: _load(name, REPO / "services" / name) for name in ("coordinator", "rollout", "reward", "learner")},
}
BY_DIST = {p.dist: p for p in PACKAGES.values()}


@dataclass(frozen=True)
class Import:
    module: str
    """The absolute dotted name imported (``from a.b import c`` gives ``a.b``)."""
    line: int
    module_level: bool
    """Runs when the module is imported (not inside a function, ``if TYPE_CHECKING`` or a ``try``
    that handles ImportError)."""


def _handles_import_error(node: ast.Try) -> bool:
    names = {"ImportError", "ModuleNotFoundError"}
    for handler in node.handlers:
        caught = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        if any(isinstance(c, ast.Name) and c.id in names for c in caught):
            return True
    return False


def imports(path: Path) -> list[Import]:
    """Every absolute import in ``path``; relative ones stay inside the package and are left out."""
    found: list[Import] = []

    def visit(node: ast.AST, module_level: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend(Import(alias.name, node.lineno, module_level) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(Import(node.module, node.lineno, module_level))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            module_level = False
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            module_level = False
        elif isinstance(node, ast.Try) and _handles_import_error(node):
            module_level = False
        for child in ast.iter_child_nodes(node):
            visit(child, module_level)

    visit(ast.parse(path.read_text(), str(path)), True)
    return found


def stdlib(module: str) -> bool:
    return module.split(".")[0] in sys.stdlib_module_names


@cache
def _module_dists() -> dict[str, list[str]]:
    return md.packages_distributions()


def dists_of(module: str) -> set[str]:
    """Distributions (canonical names) that can provide ``module``: those installed here that ship
    its top-level name, else the top-level name itself (true of the optional ones not installed)."""
    if module in IMPLIED:
        return {IMPLIED[module]}
    top = module.split(".")[0]
    return {canonicalize_name(d) for d in _module_dists().get(top, [])} or {canonicalize_name(top)}


def optional_modules(package: Package) -> dict[str, set[str]]:
    """Modules that need an extra to import: module -> the extra-only distributions behind it."""
    _, extra_only = package.declared()
    sources = dict(package.sources())
    needs: dict[str, set[str]] = {}
    for module, path in sources.items():
        for imp in imports(path):
            if imp.module_level and not stdlib(imp.module) and not imp.module.startswith("streamrl."):
                if dists_of(imp.module) <= extra_only:
                    needs.setdefault(module, set()).update(dists_of(imp.module))
    changed = True
    while changed:  # a module importing an optional module at module level is optional too
        changed = False
        for module, path in sources.items():
            for imp in imports(path):
                target = next((m for m in needs if imp.module == m or imp.module.startswith(m + ".")), None)
                if imp.module_level and target and not needs.get(module, set()) >= needs[target]:
                    needs.setdefault(module, set()).update(needs[target])
                    changed = True
    return needs


@dataclass
class Closure:
    """What a package needs installed: the streamrl packages, and the other distributions."""

    packages: list[Package]
    dists: dict[str, md.Distribution]
    """Canonical name -> the installed distribution that imports would find."""
    missing: set[str]
    """Required distributions not installed here."""


@cache
def _installed() -> dict[str, md.Distribution]:
    """Canonical name -> the distribution that imports find first (earlier sys.path entries win)."""
    found: dict[str, md.Distribution] = {}
    for dist in md.distributions():
        found.setdefault(canonicalize_name(dist.metadata["Name"]), dist)
    return found


def closure(package: Package, extras: Iterable[str] = ()) -> Closure:
    """Everything ``package`` (with ``extras``) needs, transitively, as installed here."""
    wanted: dict[str, set[str]] = defaultdict(set)
    queue: list[tuple[str, frozenset[str]]] = [(package.dist, frozenset(canonicalize_name(e) for e in extras))]
    packages: list[Package] = []
    dists: dict[str, md.Distribution] = {}
    missing: set[str] = set()
    while queue:
        name, extras_now = queue.pop()
        seen = name in wanted
        new = set(extras_now) - wanted[name]
        if seen and not new:
            continue
        wanted[name] |= new
        if name in BY_DIST:
            pkg = BY_DIST[name]
            if not seen:
                packages.append(pkg)
            reqs = pkg.requirements(wanted[name])
        elif name in _installed():
            dist = dists.setdefault(name, _installed()[name])
            reqs = [
                r
                for r in map(Requirement, dist.requires or [])
                if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in wanted[name] | {""})
            ]
        else:
            missing.add(name)
            continue
        queue += [(canonicalize_name(r.name), frozenset(canonicalize_name(e) for e in r.extras)) for r in reqs]
    return Closure(packages, dists, missing)


def _relative_files(dist: md.Distribution) -> Iterator[tuple[tuple[str, ...], Path]]:
    """(path parts inside site-packages, real file) of every file ``dist`` installed there."""
    base = Path(dist.locate_file(""))
    for file in dist.files or []:
        parts = tuple(file.as_posix().split("/"))
        if parts[0] != "..":
            yield parts, base.joinpath(*parts)


@cache
def _owners() -> dict[tuple[str, ...], tuple[frozenset[str], int]]:
    """Every path (and folder) in the site-packages here -> (distributions with files there,
    number of different site-packages those files are in)."""
    names: dict[tuple[str, ...], set[str]] = defaultdict(set)
    bases: dict[tuple[str, ...], set[Path]] = defaultdict(set)
    for name, dist in _installed().items():
        base = Path(dist.locate_file(""))
        for parts, _ in _relative_files(dist):
            for depth in range(1, len(parts) + 1):
                names[parts[:depth]].add(name)
                bases[parts[:depth]].add(base)
    return {path: (frozenset(names[path]), len(bases[path])) for path in names}


def _link_tree(site: Path, chosen: dict[str, md.Distribution]) -> int:
    """Link the files of ``chosen`` into ``site``: a whole folder at once when every distribution
    with files under it is chosen and they share one site-packages, else folder by folder.
    Returns the number of links made."""
    owners = _owners()
    linked: set[tuple[str, ...]] = set()
    for dist in chosen.values():
        for parts, real in _relative_files(dist):
            for depth in range(1, len(parts) + 1):
                prefix = parts[:depth]
                if prefix in linked:
                    break
                names, num_bases = owners[prefix]
                if depth == len(parts) or (names <= chosen.keys() and num_bases == 1):
                    source = real.parents[len(parts) - depth - 1] if depth < len(parts) else real
                    if source.exists():  # a file in RECORD may be gone since (setup uninstalls a few packages)
                        os.symlink(source, site.joinpath(*prefix))
                    linked.add(prefix)
                    break
                site.joinpath(*prefix).mkdir(exist_ok=True)
    return len(linked)


def _write_dist_info(site: Path, package: Package) -> None:
    """Minimal metadata for a streamrl package (its ``streamrl.commands`` entry points, which ``streamrl``
    lists)."""
    info = site / f"{package.dist.replace('-', '_')}-{package.project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {package.project['name']}\nVersion: {package.project['version']}\n"
    )
    lines = ["[streamrl.commands]", *(f"{name} = {target}" for name, target in package.commands.items())]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")


def build_venv(target: Path, needs: Closure) -> Path:
    """A fresh venv at ``target`` in which exactly ``needs`` is importable; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(target)], check=True)
    python = target / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    _link_tree(site, needs.dists)
    (site / "streamrl-src.pth").write_text("".join(f"{p.src}\n" for p in needs.packages))
    for package in needs.packages:
        _write_dist_info(site, package)
    return python
