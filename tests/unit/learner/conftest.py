"""The learner unit tests' fixtures: the tiny Qwen2 folder and the data kit (defined in learner_fixtures.py), and
DeepSpeed without its native-op probe.

The first DeepSpeed engine of a process probes which native ops it could build by compiling test programs
with gcc (child processes); the unit tier starts no process (tests/unit/conftest.py), so here every native op
is reported unavailable without probing, and DeepSpeed uses torch's ops, which one CPU rank needs anyway.
The real probe runs in the integration tier (tests/integration/learner, the learner services).
"""

from __future__ import annotations

import pytest
from learner_fixtures import kit, tiny_qwen_dir

__all__ = ["kit", "no_native_op_probe", "tiny_qwen_dir"]


@pytest.fixture(scope="session", autouse=True)
def no_native_op_probe() -> None:
    import deepspeed.ops
    from deepspeed.ops.op_builder.all_ops import ALL_OPS

    deepspeed.ops.__compatible_ops__ = {**dict.fromkeys(ALL_OPS, False), "deepspeed_not_implemented": False}
