"""The vLLM kit's device-side installer (scripts/gpu_vllm_install.sh, run with bash) stashes parts across calls
and refuses a damaged set."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _install(repo: Path, stash: Path, mode: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VLLMKIT_STASH": str(stash), "VLLMKIT_SITE": str(stash / "site")}
    script = repo / "scripts" / "gpu_vllm_install.sh"
    return subprocess.run(["bash", str(script), mode], cwd=repo, env=env, capture_output=True, text=True)


def test_parts_are_stashed_across_calls_and_a_damaged_set_is_refused(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "scripts" / "gpu_vllm_install.sh").write_bytes((ROOT / "scripts" / "gpu_vllm_install.sh").read_bytes())
    parts = repo / ".vllmkit" / "parts"
    parts.mkdir(parents=True)
    blobs = {"part0": b"first half", "part1": b"second half"}
    (parts / "SHA256SUMS").write_text("".join(f"{hashlib.sha256(b).hexdigest()}  {n}\n" for n, b in blobs.items()))
    stash = tmp_path / "stash"
    (parts / "part0").write_bytes(blobs["part0"])  # the first call carries part0
    assert _install(repo, stash, "stash").returncode == 0
    (parts / "part0").unlink()
    (parts / "part1").write_bytes(b"second half, damaged")  # the second call carries part1
    done = _install(repo, stash, "install")
    assert (stash / "part0").read_bytes() == blobs["part0"]
    assert done.returncode == 1 and "a part is missing or damaged" in done.stderr
