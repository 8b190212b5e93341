"""What both torch services need is written once, in streamrl.torchkit, and test code stays out of them.

Static (AST) checks over the services' sources: no rollout or learner module defines its own
device checksum, tensor views, weight process group or image-token helper (they import
:mod:`streamrl.torchkit`'s), and no service module imports the tiny test checkpoints.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
SERVICES = [REPO / "services" / name / "src" for name in ("rollout", "learner", "coordinator", "reward")]
SHARED = {
    "weights_checksum": "streamrl.torchkit.flat",
    "tensor_views": "streamrl.torchkit.flat",
    "plan_layout": "streamrl.torchkit.flat",
    "new_group": "streamrl.torchkit.process_group",
    "wait_work": "streamrl.torchkit.process_group",
    "to_wire": "streamrl.torchkit.wire",
    "to_torch": "streamrl.torchkit.wire",
    "has_vision_tower": "streamrl.torchkit.vision",
    "is_vision_language": "streamrl.torchkit.vision",
    "load_processor": "streamrl.torchkit.vision",
    "build_tokenizer": "streamrl.torchkit.testing",
    "build_tiny_qwen2": "streamrl.torchkit.testing",
    "build_tiny_idefics3": "streamrl.torchkit.testing",
}
"""Function -> the one module that defines it."""


def _service_modules() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text(), str(path))) for src in SERVICES for path in sorted(src.rglob("*.py"))]


def test_no_service_defines_what_torchkit_holds() -> None:
    again = [
        f"{path.relative_to(REPO)}:{node.lineno} defines {node.name} (use {SHARED[node.name]})"
        for path, tree in _service_modules()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in SHARED
    ]
    assert not again, "\n".join(again)


def test_no_service_module_is_or_imports_test_code() -> None:
    found = []
    for path, tree in _service_modules():
        if path.stem in ("tiny_model", "testing"):
            found.append(f"{path.relative_to(REPO)} is test code in a service")
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found += [
                f"{path.relative_to(REPO)}:{node.lineno} imports {n}" for n in names if n == "streamrl.torchkit.testing"
            ]
    assert not found, "\n".join(found)
