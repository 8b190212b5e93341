"""scripts/gpu_kit_deps.py: the offline kit's package lists are derived from the pyprojects, so a
dependency someone declares tomorrow is carried (or found on the image) without editing a list."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_kit_deps", ROOT / "scripts" / "gpu_kit_deps.py")
assert _spec is not None and _spec.loader is not None
deps = importlib.util.module_from_spec(_spec)
sys.modules["gpu_kit_deps"] = deps
_spec.loader.exec_module(deps)

IMAGE = deps.read_image(ROOT / "scripts" / "gpu_image_packages.txt")


def _project(where: Path, dependencies: list[str], extras: dict[str, list[str]] | None = None) -> Path:
    lines = ["[project]", 'name = "streamrl-x"', f"dependencies = {dependencies!r}", "[project.optional-dependencies]"]
    lines += [f"{name} = {value!r}" for name, value in (extras or {}).items()]
    where.mkdir(parents=True)
    (where / "pyproject.toml").write_text("\n".join(lines) + "\n")
    return where


def test_a_new_declared_dependency_is_carried_unless_the_image_has_it(tmp_path: Path) -> None:
    _project(
        tmp_path / "pkg",
        ["torch", "pillow", "brand-new-lib>=1", "streamrl-common", "tomli; python_version < '3.11'"],
        {"fast": ["liger_kernel==0.8.5"], "other": ["never-installed"]},
    )
    requirements = deps.parse_root("pkg[fast]", tmp_path)
    assert set(deps.to_carry(requirements, {"torch", "pillow"})) == {"brand-new-lib", "liger-kernel"}
    assert set(deps.to_carry(requirements, {"torch"})) == {"brand-new-lib", "liger-kernel", "pillow"}
    with pytest.raises(ValueError, match="no extra \\['gpu'\\]"):
        deps.parse_root("pkg[gpu]", tmp_path)
    assert [str(r) for r in deps.parse_root("trl==1.16.0", tmp_path)] == ["trl==1.16.0"]


def test_closure_follows_requires_dist_with_markers_and_extras() -> None:
    metadata = {
        "pydantic": [
            "pydantic-core==2.50.5",
            "annotated-types>=0.6",
            "typing-extensions>=4",
            "email-validator; extra == 'email'",
        ],
        "pydantic-core": ["typing-extensions>=4"],
        "annotated-types": ["typing-extensions; python_version < '3.9'"],
        "datasets": ["dill", "fsspec[http]", "multiprocess"],
        "dill": [],
        "multiprocess": ["dill>=0.3"],
        "email-validator": ["dnspython"],
        "dnspython": [],
    }
    asked: list[str] = []

    def requires_of(name: str) -> list[str]:
        asked.append(name)
        return metadata[name]

    image = {"typing-extensions", "fsspec"}
    carried = deps.closure({"pydantic": set(), "datasets": set()}, image, requires_of)
    assert set(carried) == {"pydantic", "pydantic-core", "annotated-types", "datasets", "dill", "multiprocess"}
    assert "fsspec" not in asked  # on the image: its metadata is never needed
    with_email = deps.closure({"pydantic": {"email"}}, image, requires_of)
    assert {"email-validator", "dnspython"} <= set(with_email)


def test_wheel_metadata_is_read(tmp_path: Path) -> None:
    import zipfile

    wheel = tmp_path / "demo_pkg-1.2.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(
            "demo_pkg-1.2.0.dist-info/METADATA",
            "Metadata-Version: 2.1\nName: demo-pkg\nVersion: 1.2.0\nRequires-Dist: a>=1\n"
            "Requires-Dist: b; extra == 'x'\n\nlong description\nRequires-Dist: not-a-header\n",
        )
    assert deps.wheel_requires(wheel) == ["a>=1", "b; extra == 'x'"]
    assert deps.wheel_name(wheel) == ("demo-pkg", "1.2.0")
