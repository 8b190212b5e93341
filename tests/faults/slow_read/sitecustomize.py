"""Loaded at start-up by a process whose PYTHONPATH holds this folder (the slow-start scenario's
coordinators): reading the file ``$FAULTS_SLOW_FILE`` with ``Path.read_text`` (how the coordinator
reads a .jsonl dataset) takes ``$FAULTS_SLOW_READ_S`` seconds longer, as a dataset on a slow volume
would. The sleep blocks the calling thread: the event loop, if the read runs on it."""

from __future__ import annotations

import os
import pathlib
import time

_SLOW_FILE = os.environ.get("FAULTS_SLOW_FILE", "")
_DELAY_S = float(os.environ.get("FAULTS_SLOW_READ_S", "0") or 0)
_read_text = pathlib.Path.read_text


def _slow_read_text(self: pathlib.Path, *args: object, **kwargs: object) -> str:
    if _SLOW_FILE and os.path.abspath(self) == os.path.abspath(_SLOW_FILE):
        time.sleep(_DELAY_S)
    return _read_text(self, *args, **kwargs)  # type: ignore[arg-type]


if _SLOW_FILE and _DELAY_S > 0:
    pathlib.Path.read_text = _slow_read_text  # type: ignore[method-assign]
