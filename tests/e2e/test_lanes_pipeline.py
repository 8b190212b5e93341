"""The smoke recipe on two lanes through ``streamrl up`` (:mod:`streamrl.common.lanes`): lane 0 on the run's
redis-server (also the home), lane 1 on a second one; a coordinator, a vLLM rollout and a reward replica per lane,
one DeepSpeed learner training the batches the joiner assembles from both lanes.

Checks what a user of lanes relies on: each lane's coordinator issued only its shard of the prompts, every trained
batch holds both lanes' groups, each trajectory was trained once, the learner read each payload from its own lane,
the policy version rose one a step in both lanes, and nothing is left pending or dead-lettered anywhere.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import redis
from recipe_run import VLLM_ENV, entries

from streamrl.common.lanes import lane_names, lane_of_key
from streamrl.common.messages import BatchManifest, PromptWorkItem, WeightsPublished
from streamrl.common.streams import StreamNames
from streamrl.ops.redis_server import RedisServer

pytestmark = pytest.mark.slow
TOTAL_STEPS, GROUP_SIZE, PROMPTS_PER_STEP, LANES = 4, 4, 4, 2


def test_two_lanes_on_two_redis_servers(
    tiny_task: Path, tmp_path: Path, redis_url: str, run_id: str, write_recipe
) -> None:  # type: ignore[no-untyped-def]
    second = RedisServer(tmp_path / "lane1", appendonly=False).start()
    try:
        recipe = write_recipe(tiny_task, tmp_path / "run", redis_url, dense_reward=True)
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "streamrl.ops.cli",
                "up",
                str(recipe),
                f"--run_id={run_id}",
                f"--lanes.count={LANES}",
                f"--lanes.urls={json.dumps([redis_url, second.url])}",
            ],
            env={**VLLM_ENV, "STREAMRL_WEIGHTS_KEY": f"weights-key-{run_id}"},
            capture_output=True,
            text=True,
            timeout=600,
        )
        (tmp_path / "up.log").write_text(proc.stdout + proc.stderr)
        assert proc.returncode == 0, f"see {tmp_path / 'up.log'}: " + proc.stdout[-6000:] + proc.stderr[-3000:]
        home_client = redis.Redis.from_url(redis_url)
        home = StreamNames(run_id)
        lanes = [(redis.Redis.from_url(url), lane_names(run_id, k)) for k, url in enumerate([redis_url, second.url])]

        # the learner trained one joined batch a step; every lane follows the same versions
        trained = [w for w in entries(home_client, home.weights) if isinstance(w, WeightsPublished) and w.metrics]
        assert [w.version for w in trained] == list(range(1, TOTAL_STEPS + 1))
        for client, names in lanes:
            mirrored = [w.version for w in entries(client, names.weights) if isinstance(w, WeightsPublished)]
            assert mirrored[-1] == TOTAL_STEPS, f"{names.run_id} follows versions {mirrored}"

        # each lane issued its own shard: dataset positions i mod K == k, no group id in two lanes
        issued: dict[int, set[str]] = {}
        for k, (client, names) in enumerate(lanes):
            groups = {m.id for m in entries(client, names.prompts) if isinstance(m, PromptWorkItem) and not m.is_eval}
            assert groups, f"lane {k} issued nothing"
            positions = {int(g.removeprefix("p")) for g in groups}
            assert {p % LANES for p in positions} == {k}, f"lane {k} issued positions {sorted(positions)}"
            issued[k] = groups
        assert not issued[0] & issued[1]

        # every joined batch: both lanes' groups, complete, each trajectory once in the run
        batches = [m for m in entries(home_client, home.batches) if isinstance(m, BatchManifest)]
        assert [b.index for b in batches] == list(range(TOTAL_STEPS))
        ids = []
        for b in batches:
            samples = b.samples
            if not samples:  # a split manifest: its parts on the home
                pytest.fail(f"{b.id} is split; this run's batches are small")
            assert {lane_of_key(s.key) for s in samples} == {0, 1}, f"{b.id} does not hold both lanes' groups"
            sizes = Counter(s.group_id for s in samples)
            assert set(sizes.values()) == {GROUP_SIZE}
            for s in samples:
                assert s.group_id in issued[lane_of_key(s.key) or 0], f"{s.group_id} trained from the wrong lane"
            ids += [s.trajectory_id for s in samples]
        assert len(ids) == len(set(ids)) == TOTAL_STEPS * PROMPTS_PER_STEP * GROUP_SIZE

        # nothing pending, nothing dead, anywhere
        for client, names in [(home_client, home), *lanes]:
            assert client.xlen(names.dead) == 0, entries(client, names.dead)
            for stream in (names.prompts, names.trajectories, names.scored, names.batches, names.weights):
                if client.exists(stream):
                    for group in client.xinfo_groups(stream):
                        assert group["pending"] == 0, f"{stream}/{group['name']} has pending entries"
    finally:
        second.stop()
