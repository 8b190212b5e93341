"""A reward function answering NaN for about 5% of samples costs only those samples.

tests/faults/nan_reward.py answers NaN for every sample whose query hashes to 0 modulo 20 (the same
answer on every delivery), with the demo's reward batcher settings (256 entries per read, 512 in
flight, micro-batches of up to 256, 5 ms wait), so each NaN sits in a micro-batch with many good
samples. With ``reward.on_invalid = "dead_letter"`` (the default) only the bad samples may fail: the
dead letters are the bad samples (one each, none of their neighbours), the groups dropped at most
the groups holding one, and the run reaches its last step with nothing lost or trained twice. With
``"score"`` and ``reward.invalid_value = 0.0`` nothing is dead-lettered and nothing dropped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import FaultRun, MakeRun
from nan_reward import FILE_ENV
from scenario import conclude

from streamrl.common.codec import decode
from streamrl.common.errors import PoisonMessageError
from streamrl.common.messages import DeadLetter, Trajectory, TrajectoryRecord

pytestmark = pytest.mark.slow
TOTAL_STEPS = 8
REWARD_FILE = Path(__file__).with_name("nan_reward.py")
DEMO_BATCHER = [
    "--consumer.count=256",
    "--consumer.max_in_flight=512",
    "--reward.max_batch_size=256",
    "--reward.max_wait_ms=5",
    "--coordinator.prompts_per_step=16",
]
"""recipes/demo.toml's consumer and reward batcher settings; 16 prompts (64 samples) a step."""


def _trajectory_letters(run: FaultRun) -> list[DeadLetter]:
    out = []
    for _, fields in run.written(run.names.dead):
        try:
            letter = decode(fields.get(b"d", b""), DeadLetter)
        except PoisonMessageError:
            continue
        if letter.stream == run.names.trajectories:
            out.append(letter)
    return out


def _trajectory_id(letter: DeadLetter) -> str:
    try:
        inner = decode(letter.payload)
    except PoisonMessageError:
        return "?"
    return inner.id if isinstance(inner, Trajectory | TrajectoryRecord) else "?"


def _training_group(letter: DeadLetter) -> set[str]:
    try:
        inner = decode(letter.payload)
    except PoisonMessageError:
        return set()
    return {inner.group_id} if isinstance(inner, Trajectory | TrajectoryRecord) and not inner.is_eval else set()


@pytest.mark.parametrize("on_invalid", ["dead_letter", "score"])
def test_nan_on_5_percent_of_samples_costs_only_those(fault_run: MakeRun, tmp_path: Path, on_invalid: str) -> None:
    nan_file = tmp_path / "nan_queries.jsonl"
    scorer = {"name": "arithmetic", "type": "function", "path": str(REWARD_FILE)}
    overrides = [
        f"--total_steps={TOTAL_STEPS}",
        *DEMO_BATCHER,
        f"--reward.scorers={json.dumps([scorer])}",
        f"--reward.on_invalid={on_invalid}",
        *(["--reward.invalid_value=0.0"] if on_invalid == "score" else []),
    ]
    run: FaultRun = fault_run(f"nan-{on_invalid}", overrides, env={FILE_ENV: str(nan_file)}).start()

    def checks() -> list[str]:
        bad = {json.loads(line) for line in nan_file.read_text().splitlines()} if nan_file.exists() else set()
        letters = _trajectory_letters(run)
        dropped = len({g for letter in letters for g in _training_group(letter)})
        run.details.update(bad_samples=len(bad), trajectory_dead_letters=len(letters), groups_dropped=dropped)
        failures = [] if bad else ["no sample was answered NaN"]
        if on_invalid == "score":
            return failures + ([f"{len(letters)} dead letters though NaN is scored 0.0"] if letters else [])
        not_nan = [letter.error[:160] for letter in letters if "reward is nan" not in letter.error]
        if not_nan:
            failures.append(f"{len(not_nan)} dead letters for another reason than a NaN: {not_nan[:2]}")
        # each letter must be its own sample's: the reason names the trajectory the letter carries (a count against
        # the distinct NaN'd texts is no bound: two samples of one prompt can give the same text)
        burnt = [
            letter.error[:160] for letter in letters if f"trajectory {_trajectory_id(letter)}:" not in letter.error
        ]
        if burnt:
            failures.append(f"{len(burnt)} dead letters for a neighbour's NaN (innocent samples burnt): {burnt[:2]}")
        if dropped > len(letters):
            failures.append(f"{dropped} groups dropped for {len(letters)} bad samples")
        return failures

    conclude(
        run,
        f"NaN reward on ~5% of samples, on_invalid={on_invalid}",
        total_steps=TOTAL_STEPS,
        fault_end=None,
        recovery_bound_s=None,
        checks=checks,
        run_timeout_s=300,
    )
