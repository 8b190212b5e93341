"""A learner process without a launcher makes its world of one without writing it into its environment: a child
it starts later (a vLLM engine, a subprocess) sees no ``RANK``/``WORLD_SIZE``/``MASTER_*``, and a second world
made after the first was destroyed takes a new port. DeepSpeed's own ``LOCAL_RANK`` is set (it reads it all
through the process). Real torch.distributed (gloo) and DeepSpeed, in a child
process (a process group is per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = """
import json, os
import torch
from streamrl.learner.distributed import init_distributed
before = dict(os.environ)
init_distributed()
first = (torch.distributed.get_rank(), torch.distributed.get_world_size())
during = os.environ.get("LOCAL_RANK")
changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
torch.distributed.destroy_process_group()
init_distributed()  # a world destroyed by someone else (a vLLM engine's shutdown): made again
second = (torch.distributed.get_rank(), torch.distributed.get_world_size())
print(json.dumps({"first": first, "second": second, "changed": changed, "during": during}))
"""

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCH_EXTENSIONS_DIR")
WORLD = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def test_a_world_of_one_leaves_the_environment_as_it_was() -> None:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["first"] == seen["second"] == [0, 1]
    written = [k for k in seen["changed"] if k in WORLD]
    assert written == [], f"init_distributed wrote {written} into the environment"
    assert seen["during"] == "0"  # DeepSpeed finds its LOCAL_RANK
