"""A remote reward service that fails whole batches, at the demo's in-flight settings.

The reward tier scores through the HTTP scorer against tests/faults/scorer_server.py, with the
demo's consumer and batcher settings (256 entries per read, 512 in flight, micro-batches of 256,
5 ms wait) and demo-sized steps (32 groups of 8 = 256 samples, one step of staleness), so every
fault hits hundreds of entries at once. Faults, each in its own run, from policy version 2:

* HTTP 500 on every request for 10 s, then answers again;
* every connection dropped without an answer for 10 s;
* the server's token rotated: HTTP 401 (never retried: the reward tier pauses, dead-letters nothing and the run
  issues nothing) until the reward service is restarted with the new token 10 s later; no entry may be
  dead-lettered for the 401 (tests/faults/test_permanent_errors.py: the token rotated back instead);
* the server down (killed) for 30 s, then back on the same port;
* every answer slow (1.5 s) for the whole run: nothing may be dropped for it.

Entries whose retries run out are dead-lettered with the reason and their groups replaced; the run
must reach its last step with every issued group trained or accounted for.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import FaultRun, MakeRun
from scenario import conclude
from scorer_server import ScorerServer

from streamrl.common.codec import decode
from streamrl.common.errors import PoisonMessageError
from streamrl.common.messages import DeadLetter
from streamrl.ops.redis_server import free_port

pytestmark = pytest.mark.slow
TOTAL_STEPS = 6
FAULT_AT_VERSION = 2
FAULT_S = 10.0
DOWN_S = 30.0
GROUP_SIZE = 8
TOKEN_ENV = "FAULTS_SCORER_TOKEN"
DEMO_IN_FLIGHT = [
    "--consumer.count=256",
    "--consumer.max_in_flight=512",
    "--reward.max_batch_size=256",
    "--reward.max_wait_ms=5",
    f"--coordinator.group_size={GROUP_SIZE}",
    "--coordinator.prompts_per_step=32",
    "--coordinator.max_staleness=1",
    "--coordinator.eval.num_prompts=64",
    "--learner.ds.micro_batch_size=256",
    "--learner.ds.grad_accum=1",
]
"""recipes/demo.toml's consumer, reward batcher and step shape (its eval set here has 64 prompts)."""
RECOVERY_BOUND_S = 45.0
"""From the server answering again (or the reward service restarted) to the next trained batch (s)."""


def _remote_run(fault_run: MakeRun, name: str, scorer: ScorerServer, timeout_s: float = 30.0) -> FaultRun:
    scorer_cfg = {
        "name": "remote",
        "type": "http",
        "urls": [scorer.url],
        "token_env": TOKEN_ENV,
        "timeout_s": timeout_s,
    }
    overrides = [f"--total_steps={TOTAL_STEPS}", *DEMO_IN_FLIGHT, f"--reward.scorers={json.dumps([scorer_cfg])}"]
    return fault_run(name, overrides, env={TOKEN_ENV: scorer.token})


@pytest.fixture
def scorer(tmp_path: Path) -> Iterator[ScorerServer]:
    server = ScorerServer(free_port(), tmp_path / "scorer.log", token=secrets.token_hex(16)).start()
    yield server
    server.kill()


def _dead_reasons(run: FaultRun) -> list[str]:
    reasons = []
    for _, fields in run.written(run.names.dead):
        try:
            reasons.append(decode(fields.get(b"d", b""), DeadLetter).error)
        except PoisonMessageError:
            continue
    return reasons


@pytest.mark.parametrize("mode", ["500", "drop"])
def test_reward_fails_whole_batches_for_a_while(mode: str, scorer: ScorerServer, fault_run: MakeRun) -> None:
    run: FaultRun = _remote_run(fault_run, f"reward-{mode}", scorer).start()
    run.wait_version(FAULT_AT_VERSION)
    scorer.set_mode(mode)
    time.sleep(FAULT_S)
    faulted = scorer.stats().get(mode, 0)
    scorer.set_mode("ok")
    healed = time.time()
    label = {"500": "HTTP 500", "drop": "connections dropped"}[mode]
    conclude(
        run,
        f"reward {label} {FAULT_S:g} s (demo in-flight)",
        total_steps=TOTAL_STEPS,
        group_size=GROUP_SIZE,
        fault_end=healed,
        recovery_bound_s=RECOVERY_BOUND_S,
        checks=lambda: [] if faulted else [f"no request met the {mode} fault"],
    )


def test_reward_token_rotated(scorer: ScorerServer, fault_run: MakeRun) -> None:
    run: FaultRun = _remote_run(fault_run, "reward-token", scorer).start()
    old = scorer.token
    run.wait_version(FAULT_AT_VERSION)
    scorer.kill()
    scorer.token = secrets.token_hex(16)
    scorer.start()
    time.sleep(FAULT_S)
    refused = scorer.stats().get("unauthorized", 0)
    run.env[TOKEN_ENV] = scorer.token  # the operator gives the reward tier the new token
    for instance in run.instances("reward"):
        run.kill(instance)
    run.start_service("reward", "reward-0")
    fixed = time.time()

    def checks() -> list[str]:
        reasons = _dead_reasons(run)
        failures = [] if refused else ["no request was refused for its token"]
        refused_letters = [r for r in reasons if "401" in r]
        if refused_letters:
            failures.append(f"{len(refused_letters)} entries dead-lettered for the 401 (the run should pause)")
        if any(old in r or scorer.token in r for r in reasons):
            failures.append("a dead letter shows the token")
        return failures

    conclude(
        run,
        f"reward wrong token {FAULT_S:g} s (demo in-flight)",
        total_steps=TOTAL_STEPS,
        group_size=GROUP_SIZE,
        fault_end=fixed,
        recovery_bound_s=RECOVERY_BOUND_S,
        allowed_exits=("reward",),
        checks=checks,
    )


def test_reward_down_and_back(scorer: ScorerServer, fault_run: MakeRun) -> None:
    run: FaultRun = _remote_run(fault_run, "reward-down", scorer).start()
    run.wait_version(FAULT_AT_VERSION)
    scorer.kill()
    time.sleep(DOWN_S)
    scorer.start()
    back = time.time()
    conclude(
        run,
        f"reward down {DOWN_S:g} s (demo in-flight)",
        total_steps=TOTAL_STEPS,
        group_size=GROUP_SIZE,
        fault_end=back,
        recovery_bound_s=RECOVERY_BOUND_S,
    )


def test_reward_slow(scorer: ScorerServer, fault_run: MakeRun) -> None:
    scorer.set_mode("slow", slow_s=1.5)
    run: FaultRun = _remote_run(fault_run, "reward-slow", scorer, timeout_s=5.0).start()

    def checks() -> list[str]:
        reasons = _dead_reasons(run)
        failures = [] if scorer.stats().get("slow") else ["no request was slow"]
        if reasons:
            failures.append(f"{len(reasons)} entries dead-lettered though the server only was slow: {reasons[:2]}")
        return failures

    conclude(
        run,
        "reward slow 1.5 s/request (demo in-flight)",
        total_steps=TOTAL_STEPS,
        group_size=GROUP_SIZE,
        fault_end=None,
        recovery_bound_s=None,
        checks=checks,
    )
