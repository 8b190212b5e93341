"""``streamrl up`` and Redis memory: the embedded redis-server gets ``maxmemory`` from the run's bound and
``noeviction``; an external one whose policy could evict streamrl keys, or whose ``maxmemory`` is below
the bound, gets a WARNING at start. Real redis-servers, the real launcher (no services started)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as syncredis

from streamrl.ops.embedded_auth import user_url
from streamrl.ops.launcher import Launcher
from streamrl.ops.memory_budget import MIB, maxmemory_for
from streamrl.ops.redis_server import RedisServer, memory_settings

RECIPE = """
run_id = "mem"
total_steps = 100
[up]
services = []
display = false
[coordinator]
prompts_per_step = 16
group_size = 8
max_staleness = 1
[coordinator.sampling]
max_new_tokens = 1024
[rollout.engine]
max_model_len = 2048
[learner]
checkpoint_every = 10
"""


@pytest.fixture
def recipe(tmp_path: Path) -> str:
    path = tmp_path / "recipe.toml"
    path.write_text(RECIPE)
    return str(path)


@pytest.fixture
def external(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "external", appendonly=False).start()
    yield server
    server.stop()


def run_launcher(recipe: str, overrides: list[str]) -> tuple[Launcher, dict[str, str]]:
    """Start the launcher (its Redis only: no services), read the server's memory settings, stop it."""
    launcher = Launcher(recipe, [f"--run_dir={Path(recipe).parent / 'run'}", *overrides])
    try:
        launcher.start()
        assert launcher.client is not None
        maxmemory, policy = memory_settings(launcher.client)  # INFO: the launcher's login may not CONFIG GET
    finally:
        launcher.stop()
    return launcher, {"maxmemory": str(maxmemory), "maxmemory-policy": policy}


def test_embedded_redis_gets_maxmemory_from_the_bound(recipe: str, capsys: pytest.CaptureFixture[str]) -> None:
    launcher, settings = run_launcher(recipe, [])
    expected = maxmemory_for(launcher.memory, 2.0)
    assert launcher.memory.total > 64 * MIB  # this recipe's bound is above the floor: the formula sets it
    assert int(settings["maxmemory"]) == expected
    assert settings["maxmemory-policy"] == "noeviction"
    out = capsys.readouterr().out
    assert f"redis maxmemory {expected // MIB} MiB, maxmemory-policy noeviction" in out
    assert "this run's memory bound" in out


def test_embedded_maxmemory_can_be_set_or_lifted(recipe: str, capsys: pytest.CaptureFixture[str]) -> None:
    _, settings = run_launcher(recipe, ["--up.redis_memory.maxmemory_mb=0"])
    assert (settings["maxmemory"], settings["maxmemory-policy"]) == ("0", "noeviction")
    _, settings = run_launcher(recipe, ["--up.redis_memory.maxmemory_mb=100"])
    assert int(settings["maxmemory"]) == 100 * MIB
    assert "below this run's memory bound" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("policy", "maxmemory", "warned"),
    [
        ("noeviction", "0", []),
        ("allkeys-lru", "0", ["maxmemory-policy is allkeys-lru", "evicts any key"]),
        ("volatile-lru", "0", ["maxmemory-policy is volatile-lru", "leases, heartbeats"]),
        ("noeviction", "1mb", ["maxmemory is 1 MiB, below this run's bound"]),
    ],
)
def test_external_redis_that_could_evict_or_fill_is_warned_about(
    recipe: str,
    external: RedisServer,
    capsys: pytest.CaptureFixture[str],
    policy: str,
    maxmemory: str,
    warned: list[str],
) -> None:
    admin = syncredis.Redis(port=external.port)
    admin.config_set("maxmemory-policy", policy)
    admin.config_set("maxmemory", maxmemory)
    _, settings = run_launcher(recipe, [f"--redis.url={external.url}"])
    assert settings["maxmemory-policy"] == policy  # an external server's settings are left as they are
    captured = capsys.readouterr()
    assert f"maxmemory-policy {policy}" in captured.out
    warnings = [line for line in captured.err.splitlines() if "WARNING" in line]
    assert len(warnings) == (1 if warned else 0), captured.err
    assert all(words in warnings[0] for words in warned), warnings
    admin.close()


def test_embedded_redis_over_the_bound_is_warned_about_once(recipe: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A run whose Redis holds more than its bound has something growing the bound does not count: the
    launcher says so once, shows the memory in the progress line, and prints the peak at the end."""
    small = [
        "--rollout.engine.max_model_len=64",
        "--coordinator.sampling.max_new_tokens=16",
        "--coordinator.prompts_per_step=2",
        "--learner.checkpoint_every=1",
    ]
    launcher = Launcher(recipe, [f"--run_dir={Path(recipe).parent / 'run'}", *small])
    try:
        launcher.start()
        assert launcher.client is not None
        assert launcher.check_memory() is not None
        assert "WARNING" not in capsys.readouterr().err  # an empty Redis is under the bound
        junk = bytes(MIB)
        assert launcher.redis_url is not None
        coordinator = syncredis.Redis.from_url(
            user_url(launcher.redis_url, "coordinator", launcher.passwords["coordinator"])
        )
        for i in range(launcher.memory.total // MIB + 2):
            coordinator.set(launcher.names.state(f"junk{i}"), junk)  # the run's own state keys: the coordinator's
        coordinator.close()
        used = launcher.check_memory()
        assert used is not None and used > launcher.memory.total
        launcher.check_memory()
        launcher._display()
    finally:
        launcher.stop()
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if "more than this run's memory bound" in line]
    assert len(warnings) == 1, captured.err
    assert launcher.used_memory is not None and f"| redis {launcher.used_memory / MIB:.0f} MiB" in captured.out
    assert "redis used_memory peak" in captured.out


@pytest.mark.parametrize("policy", ["everysec", "always"])
def test_embedded_redis_fsyncs_as_the_recipe_says(recipe: str, policy: str, capsys: pytest.CaptureFixture[str]) -> None:
    launcher = Launcher(recipe, [f"--run_dir={Path(recipe).parent / 'run'}", f"--up.redis_appendfsync={policy}"])
    try:
        launcher.start()
        assert launcher.redis is not None and launcher.redis.appendfsync == policy  # its --appendfsync
    finally:
        launcher.stop()
    assert f"appendfsync {policy})" in capsys.readouterr().out
