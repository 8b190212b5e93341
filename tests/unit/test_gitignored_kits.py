"""Folders the scripts fill and call gitignored (kits of hundreds of MB) are in .gitignore: a `git add -A`
after building one must not stage it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_CLAIM = re.compile(r"\(gitignored (\.?[\w.-]+/)\)|(\.?[\w.-]+/) \(gitignored\)")


def claimed_ignored() -> list[str]:
    """Every ``X/`` a script under scripts/ says is gitignored (``(gitignored X/)`` or ``X/ (gitignored)``)."""
    found = {a or b for path in (ROOT / "scripts").glob("*.sh") for a, b in _CLAIM.findall(path.read_text())}
    return sorted(found)


def ignored_folders() -> set[str]:
    """The top-level folders .gitignore names (``X/``, ``/X/`` or ``X``), as ``X/``."""
    lines = (line.strip() for line in (ROOT / ".gitignore").read_text().splitlines())
    return {line.strip("/") + "/" for line in lines if line and not line.startswith(("#", "!"))}


def test_scripts_name_their_gitignored_kits() -> None:
    assert {".gpukit/", ".vllmkit/"} <= set(claimed_ignored())


@pytest.mark.parametrize("folder", claimed_ignored())
def test_what_a_script_calls_gitignored_is_in_gitignore(folder: str) -> None:
    assert folder in ignored_folders(), f"a script under scripts/ says {folder} is gitignored; .gitignore misses it"
