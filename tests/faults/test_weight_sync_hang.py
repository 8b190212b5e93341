"""A weight transfer that hangs past its deadline, then the network heals.

The rollout worker fetches each new version from the learner's weight server through
tests/faults/weights_proxy.py. From policy version 3 the proxy accepts the worker's connections and
holds them without a byte forwarded, for several deadlines (``rollout.weight_sync_timeout_s`` = 3 s):
each fetch must fail loudly at its deadline and be retried, and once the proxy forwards again the
worker takes the version and the run finishes with nothing lost.
"""

from __future__ import annotations

import contextlib
import socket
import time

import pytest
from harness import FaultRun, MakeRun
from scenario import conclude
from weights_proxy import LISTEN_HOST, WeightsProxy

from streamrl.ops.redis_server import free_port

pytestmark = pytest.mark.slow
TOTAL_STEPS = 12
HANG_AT_VERSION = 3
HANG_S = 10.0
SYNC_DEADLINE_S = 3.0
RECOVERY_BOUND_S = 20.0
"""From the network healing to the next trained batch (s): one retry pause plus a fetch."""


def free_port_pair() -> int:
    """A port P with P + 1 free too (the weight server's chunk stream listens on the next port)."""
    for _ in range(100):
        port = free_port()
        with contextlib.suppress(OSError), socket.create_server(("127.0.0.1", port + 1)):
            return port
    raise RuntimeError("no two free ports in a row")


def test_weight_transfer_hangs_past_its_deadline(fault_run: MakeRun) -> None:
    port = free_port_pair()
    proxy = WeightsProxy(port).start()
    overrides = [
        f"--total_steps={TOTAL_STEPS}",
        f"--learner.weights_port={port}",
        f"--learner.weights_advertise_host={LISTEN_HOST}",
        f"--rollout.weight_sync_timeout_s={SYNC_DEADLINE_S}",
    ]
    try:
        run: FaultRun = fault_run("weights-hang", overrides).start()
        run.wait_version(HANG_AT_VERSION)
        proxy.hang()
        time.sleep(HANG_S)
        proxy.heal()
        healed = time.time()

        def checks() -> list[str]:
            # a fetch that hit its deadline is retried on a new connection: at least two held
            return [] if proxy.held >= 2 else [f"the hang held {proxy.held} fetches: no deadline was exercised"]

        conclude(
            run,
            f"weight transfer hung {HANG_S:g} s (deadline {SYNC_DEADLINE_S:g} s)",
            total_steps=TOTAL_STEPS,
            fault_end=healed,
            recovery_bound_s=RECOVERY_BOUND_S,
            checks=checks,
        )
    finally:
        proxy.close()
