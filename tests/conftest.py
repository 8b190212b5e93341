"""Shared fixtures: a real redis-server, unique run ids, a tiny arithmetic task (random model + data) and its recipe."""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as syncredis

from streamrl.ops.redis_server import RedisServer, cluster_node_args

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "arithmetic"))

import model as model_lib  # noqa: E402
import task as task_lib  # noqa: E402


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server: the one CI started (``STREAMRL_TEST_REDIS_URL``), else one on a free port."""
    if os.environ.get("STREAMRL_TEST_REDIS_URL"):
        yield os.environ["STREAMRL_TEST_REDIS_URL"]
        return
    server = RedisServer(tmp_path_factory.mktemp("redis"), appendonly=False).start()
    yield server.url
    server.stop()


SLOW_TIERS = (ROOT / "tests" / "e2e", ROOT / "tests" / "faults")
"""Whole-pipeline runs: every test under these folders is ``slow`` (``make test-slow``; CI runs it after ``make test``)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if any(item.path.is_relative_to(tier) for tier in SLOW_TIERS):
            item.add_marker(pytest.mark.slow)


DIST_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What torch.distributed reads from the environment. A test that initialised DeepSpeed in the pytest
process left them there; a worker process inheriting them would rendezvous on that process's port."""


@pytest.fixture
def worker_env() -> dict[str, str]:
    """The environment for a worker subprocess: this one less the torch.distributed variables."""
    return {k: v for k, v in os.environ.items() if k not in DIST_VARIABLES}


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server in cluster mode: one node serving all 16384 slots. It refuses, as any
    cluster does, a script or transaction whose keys are not in one slot (CROSSSLOT)."""
    server = RedisServer(
        tmp_path_factory.mktemp("redis-cluster"),
        appendonly=False,
        extra_args=cluster_node_args(),
    ).start()
    client = syncredis.Redis(port=server.port)
    client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
    deadline = time.monotonic() + 10
    while b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
        assert time.monotonic() < deadline, "the one-node cluster did not come up"
        time.sleep(0.05)
    client.close()
    yield server.url
    server.stop()


@pytest.fixture
def run_id() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def tiny_task(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Data + a randomly initialised 0.66M-parameter policy (no warm start) under one folder."""
    root = tmp_path_factory.mktemp("tiny_task")
    train, held_out = task_lib.make_splits(task_lib.TaskSpec(operators="+", digits=2, num_eval=64, seed=0))
    task_lib.write_jsonl(root / "train.jsonl", train)
    task_lib.write_jsonl(root / "eval.jsonl", held_out)
    tokenizer = model_lib.build_tokenizer()
    model = model_lib.build_model(model_lib.PRESETS["small"], tokenizer, seed=0)
    model_lib.save(model, tokenizer, root / "model")
    return root


def _write_recipe(task_root: Path, out: Path, redis_url: str | None, dense_reward: bool = False) -> Path:
    """recipes/smoke.toml with ``{root}`` = ``task_root`` and the redis URL set.

    ``dense_reward`` swaps the arithmetic reward (always 0 for a random model) for digit_reward.py.
    """
    text = (ROOT / "recipes" / "smoke.toml").read_text().replace("{root}", str(task_root))
    if dense_reward:
        text = text.replace(
            'path = "examples/arithmetic/task.py"', f'path = "{Path(__file__).parent / "e2e" / "digit_reward.py"}"'
        )
    text = text.replace(f'run_dir = "{task_root}/run"', f'run_dir = "{out}"')
    if redis_url:
        text = text.replace("[up]", f'[redis]\nurl = "{redis_url}"\n\n[up]', 1)
    path = out.with_suffix(".toml")
    path.write_text(text)
    return path


@pytest.fixture
def write_recipe():  # type: ignore[no-untyped-def]
    """``write_recipe(task_root, run_dir, redis_url) -> recipe path`` (recipes/smoke.toml, substituted)."""
    return _write_recipe
