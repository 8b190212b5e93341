"""``streamrl up RECIPE --dry-run``: every service's resolved config, nothing started.

It was refused as a bad override (``--dry-run`` read as ``--section.field=value``); a user checking
a GPU recipe and its overrides before taking a GPU needs it. The runs of the command (a process each) are in
tests/integration/gpu/test_gpu_up_dry_run_cli.py; here, the argument split.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from streamrl.ops.cli import split_dry_run

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "recipes/gpu_qwen2_0.5b.toml"


def test_split_dry_run() -> None:
    assert split_dry_run(["r.toml", "--dry-run", "--a.b=1"]) == ("r.toml", ["--a.b=1"])
    with pytest.raises(ValueError, match="one recipe"):
        split_dry_run(["a.toml", "b.toml", "--dry-run"])
