"""A permanent reward error - the scorer's token refused - pauses the run instead of burning the dataset.

Before (issue 38, finding 3): a wrong token (401/403) or a backend down past the retries was retried as a
transient error: in 240 s, 60,620 trajectories dead-lettered, 7,454 groups replaced, 76% of the dataset
consumed, the policy version never moved and nothing stopped. Now the reward tier pauses its intake on the
first refusal (its heartbeat says ``paused`` with the reason), the coordinator issues nothing while every reward
worker is paused and shows the cause on the progress line (what ``streamrl up`` prints), and a probe resumes
scoring by itself once the token is accepted again.

The reward tier scores through the HTTP scorer against tests/faults/scorer_server.py at the demo's in-flight
settings (tests/faults/test_remote_reward.py). From policy version 2 the server's token is rotated, so every
request gets HTTP 401, for ``FAULT_S``; then it is rotated back, and the run must reach its last step with lost 0
and trained twice 0. The row's details: seconds to the pause on screen (bound 30 s), dataset rows consumed while
paused (bound 1% of the dataset), dead letters naming the 401 (0).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import MakeRun
from scenario import conclude
from scorer_server import ScorerServer
from test_remote_reward import FAULT_AT_VERSION, GROUP_SIZE, RECOVERY_BOUND_S, TOTAL_STEPS, _dead_reasons, _remote_run

from streamrl.ops.redis_server import free_port

pytestmark = pytest.mark.slow
FAULT_S = 20.0
PAUSE_BOUND_S = 30.0
"""From the first refused request to the cause on the progress line (s)."""
MAX_CONSUMED_WHILE_PAUSED = 0.01
"""Fraction of the dataset's rows issued while the run is paused, at most."""


@pytest.fixture
def scorer(tmp_path: Path) -> Iterator[ScorerServer]:
    server = ScorerServer(free_port(), tmp_path / "scorer.log", token=secrets.token_hex(16)).start()
    yield server
    server.kill()


def _rotate(scorer: ScorerServer, token: str) -> None:
    scorer.kill()
    scorer.token = token
    scorer.start()


def test_a_refused_token_pauses_the_run_until_it_is_accepted_again(scorer: ScorerServer, fault_run: MakeRun) -> None:
    run = _remote_run(fault_run, "reward-token-pause", scorer).start()
    rows = sum(1 for line in (run.task / "train.jsonl").read_text().splitlines() if line.strip())
    right = scorer.token
    run.wait_version(FAULT_AT_VERSION)

    def progress() -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in run.client.hgetall(run.names.state("progress")).items()}

    def cursor() -> int:
        return int(run.client.get(run.names.state("cursor")) or 0)

    _rotate(scorer, secrets.token_hex(16))  # every request refused from now on
    refused_at = time.monotonic()
    run.wait_until("the pause on the progress line", lambda: "paused" in progress(), PAUSE_BOUND_S)
    to_pause_s = time.monotonic() - refused_at
    shown = progress()["paused"]
    cursor_paused = cursor()
    time.sleep(max(0.0, FAULT_S - to_pause_s))
    consumed = cursor() - cursor_paused
    version_paused = run.version()
    refused = scorer.stats().get("unauthorized", 0)
    _rotate(scorer, right)  # the token rotated back: a probe is accepted, scoring resumes by itself
    fixed = time.time()
    run.details.update(
        {
            "to_pause_s": round(to_pause_s, 1),
            "paused_s": round(time.monotonic() - refused_at - to_pause_s, 1),
            "rows_consumed_while_paused": consumed,
            "dataset_rows": rows,
            "requests_refused": refused,
            "shown": shown,
        }
    )

    def checks() -> list[str]:
        failures = [] if refused else ["no request was refused for its token"]
        if "401" not in shown or "FAULTS_SCORER_TOKEN" not in shown:
            failures.append(f"the cause on screen names neither the 401 nor the token's variable: {shown!r}")
        if right in shown or scorer.token in shown:
            failures.append("the progress line shows the token")
        if consumed > MAX_CONSUMED_WHILE_PAUSED * rows:
            failures.append(f"{consumed} of {rows} dataset rows consumed while paused (bound 1%)")
        if run.version() <= version_paused:
            failures.append("the run did not go on once the token was accepted")
        letters = [r for r in _dead_reasons(run) if "401" in r]
        if letters:
            failures.append(f"{len(letters)} entries dead-lettered for the refused token: {letters[0]}")
        return failures

    conclude(
        run,
        f"reward token refused {FAULT_S:g} s, then accepted (demo in-flight)",
        total_steps=TOTAL_STEPS,
        group_size=GROUP_SIZE,
        fault_end=fixed,
        recovery_bound_s=RECOVERY_BOUND_S,
        checks=checks,
    )
