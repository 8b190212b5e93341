"""Every import in a package's source is the standard library, streamrl, or declared by that package.

Static (AST) companion of test_fresh_venv.py: it sees imports inside functions too (the lazy ones
a fresh venv never runs), and it wants each distribution declared by the package that imports it,
not reached through another package's dependencies. A distribution may be declared in an extra;
test_fresh_venv.py checks that the modules an entry point loads need none.
"""

from __future__ import annotations

import pytest
from streamrl_packages import PACKAGES, dists_of, imports, stdlib


@pytest.mark.parametrize("name", list(PACKAGES))
def test_every_import_is_declared(name: str) -> None:
    package = PACKAGES[name]
    hard, extra_only = package.declared()
    undeclared = []
    for _, path in package.sources():
        for imp in imports(path):
            if stdlib(imp.module) or imp.module.startswith("streamrl."):
                continue
            if not dists_of(imp.module) & (hard | extra_only):
                where = f"{path.relative_to(package.root)}:{imp.line}"
                undeclared.append(
                    f"{where} imports {imp.module} (distribution {' or '.join(sorted(dists_of(imp.module)))})"
                )
    assert not undeclared, f"{package.dist} does not declare:\n" + "\n".join(undeclared)


@pytest.mark.parametrize("name", list(PACKAGES))
def test_streamrl_imports_stay_inside_common_and_the_package(name: str) -> None:
    """Services import only streamrl.common and themselves - the rollout and the learner also
    streamrl.torchkit, which imports only streamrl.common; streamrl.ops (the operator tooling) imports
    only streamrl.common, and starts services as processes; streamrl.common imports no other package."""
    package = PACKAGES[name]
    allowed = ("streamrl.common", package.module)
    if name in ("rollout", "learner"):
        allowed += ("streamrl.torchkit",)
    wrong = [
        f"{path.relative_to(package.root)}:{imp.line} imports {imp.module}"
        for _, path in package.sources()
        for imp in imports(path)
        if imp.module.startswith("streamrl.")
        and not any(imp.module == a or imp.module.startswith(a + ".") for a in allowed)
    ]
    assert not wrong, "\n".join(wrong)


def test_every_package_supports_python_3_10_to_3_12() -> None:
    assert {p.project["requires-python"] for p in PACKAGES.values()} == {">=3.10,<3.13"}


def test_module_names_map_to_distributions() -> None:
    """The mapping the first test relies on: import names differ from distribution names."""
    assert dists_of("yaml") == {"pyyaml"}
    assert dists_of("zmq.asyncio") == {"pyzmq"}
    assert dists_of("torch.utils.tensorboard") == {"tensorboard"}
    assert dists_of("not_installed_here") == {"not-installed-here"}
