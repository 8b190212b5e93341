"""Files that are on disk before they count: fsync of a checkpoint's files and folders, and an atomic marker.

A checkpoint counts as saved (and the batches it covers are acknowledged, so they are gone from the
stream) only once the power going out could not take it back: every file of it and every folder on
the way are fsync'ed, then the ``latest`` marker is written to a temporary file, fsync'ed, renamed
over the old one, and its folder fsync'ed (a rename is durable only once its directory is).

:func:`fsync` is the one place that calls ``os.fsync``: tests swap it to see what was synced, in order.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync(path: Path) -> None:
    """Flush ``path`` (a file or a folder) to disk."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every folder bottom-up, ``root`` itself and its parent."""
    root = Path(root)
    folders = []
    for here, _, files in os.walk(root):
        folders.append(Path(here))
        for name in sorted(files):
            fsync(Path(here) / name)
    for folder in reversed(folders):
        fsync(folder)
    fsync(root.parent)


def write_marker(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically and durably (tmp file, fsync, rename, fsync of its folder)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    fsync(tmp)
    os.replace(tmp, path)
    fsync(path.parent)
