"""Checkpoint retention: keep the newest ``keep_last`` resumable checkpoints, delete the older ones.

:meth:`ModelEngine.save_checkpoint` writes one ``step_<n>`` folder per save and points ``latest``
at it; nothing else removes them, so a long run fills the disk. The offline jobs and the RL learner
call :func:`prune_checkpoints` after each save (on rank 0 only, once the new checkpoint and
``latest`` are written). Torch-free, so it is tested on plain folders.
"""

from __future__ import annotations

import shutil
from pathlib import Path

_PREFIX = "step_"


def _step(path: Path) -> int | None:
    """The step number of a ``step_<n>`` checkpoint folder, or None for anything else."""
    suffix = path.name.removeprefix(_PREFIX)
    return int(suffix) if path.name.startswith(_PREFIX) and suffix.isdigit() and path.is_dir() else None


def prune_checkpoints(directory: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` ``step_<n>`` folders under ``directory``; return those deleted.

    Newest means the highest step number (``step_100`` is newer than ``step_20``). The checkpoint that
    ``latest`` names is never deleted, so a resume always finds it.
    """
    assert keep_last >= 1, keep_last
    directory = Path(directory)
    latest = directory / "latest"
    current = latest.read_text().strip() if latest.is_file() else None
    steps = sorted((step, path) for path in directory.glob(f"{_PREFIX}*") if (step := _step(path)) is not None)
    removed = [path for _, path in steps[:-keep_last] if path.name != current]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
