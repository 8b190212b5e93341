"""scripts/setup.sh's cuda path on an image whose Python is itself a virtual environment.

The CUDA images users meet (and the GPU machine here: /opt/torch/.venv/bin/python3) keep torch in a
venv. A venv made from that Python with --system-site-packages sees the *base* interpreter's
packages, not the venv's, so .venv could not find torch (``PackageNotFoundError: torch``). Here an
"image" venv holding a stand-in CUDA torch plays that Python; setup stops once .venv exists
(``STREAMRL_SETUP_STOP=venv``), so nothing is downloaded. Those setup.sh runs (bash, venvs) are in
tests/integration/gpu/test_gpu_setup_script.py; here, without a process: find_redis_server looks beside the python.
"""

from __future__ import annotations

from pathlib import Path

import pytest


def test_find_redis_server_looks_beside_the_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from streamrl.ops import redis_server

    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "redis-server").write_text("#!/bin/sh\n")
    (bin_dir / "redis-server").chmod(0o755)
    monkeypatch.setattr(redis_server.sys, "executable", str(bin_dir / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv(redis_server.REDIS_SERVER_ENV, raising=False)
    assert redis_server.find_redis_server() == str(bin_dir / "redis-server")
