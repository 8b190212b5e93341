"""What a dead letter lost: a training group, an evaluation prompt of a round, or a batch (pure)."""

from __future__ import annotations

from coordinator_fakes import Prompts, sample, trajectory
from msgspec.structs import replace

from streamrl.common.batch_payloads import manifest_of
from streamrl.common.codec import encode
from streamrl.common.messages import (
    BATCH_SKIPPED,
    DeadLetter,
    Message,
    PromptWorkItem,
    ScoredTrajectory,
    Tensor,
    TrainingBatch,
    WeightsPublished,
)
from streamrl.common.weights.auth import sign
from streamrl.coordinator.dead_letters import (
    ForgedLetter,
    LostBatch,
    LostEvalPrompt,
    LostGroup,
    RefusedBatch,
    what_was_lost,
)

BATCHES = "streamrl:r:batches"


def letter(payload: Message | bytes, stream: str = "streamrl:r:trajectories", error: str = "E: x") -> DeadLetter:
    raw = payload if isinstance(payload, bytes) else encode(payload)
    return DeadLetter(
        stream=stream, entry_id="5-0", group="g", consumer="c", error=error, deliveries=3, payload=raw, ts=0.0
    )


def prompt(id: str, **fields: object) -> PromptWorkItem:
    p = Prompts().get(0)
    return PromptWorkItem(id=id, prompt_ids=Tensor.from_list(p.ids, "int32"), **fields)  # type: ignore[arg-type]


def whole(group: str, index: int) -> ScoredTrajectory:
    """A whole scored trajectory (the first form of the scored contract, still in old batches' letters)."""
    return ScoredTrajectory(trajectory=trajectory(group, index), reward=1.0, score=1.0)


def test_training_groups_evaluation_prompts_and_batches() -> None:
    record = sample("p7", 1)
    payload = (record.trajectory.payload_key,)
    assert what_was_lost(letter(prompt("p7")), batches_stream=BATCHES, key=None, run_id="r") == LostGroup("p7")
    assert what_was_lost(letter(record.trajectory), batches_stream=BATCHES, key=None, run_id="r") == LostGroup(
        "p7", payload
    )
    assert what_was_lost(letter(record), batches_stream=BATCHES, key=None, run_id="r") == LostGroup("p7", payload)
    assert what_was_lost(letter(whole("p7", 1).trajectory), batches_stream=BATCHES, key=None, run_id="r") == LostGroup(
        "p7"
    )
    evaluation = prompt("eval-v4-1", is_eval=True, metadata={"eval_version": 4})
    assert what_was_lost(letter(evaluation), batches_stream=BATCHES, key=None, run_id="r") == LostEvalPrompt(
        4, "eval-v4-1"
    )
    answer = sample("eval-v4-1", 0, is_eval=True, eval_version=4)
    lost = LostEvalPrompt(4, "eval-v4-1", (answer.trajectory.payload_key,))
    assert what_was_lost(letter(answer), batches_stream=BATCHES, key=None, run_id="r") == lost
    scored = whole("p7", 1)
    batch = TrainingBatch(id="batch-3", index=3, samples=[scored, scored], policy_version=3, staleness=[0, 0])
    skipped = f"batch-3 (2 samples) {BATCH_SKIPPED}: its step failed 3 times, last: FloatingPointError: nan"
    assert what_was_lost(letter(batch, BATCHES, skipped), batches_stream=BATCHES, key=None, run_id="r") == LostBatch(
        "batch-3", 2, 1
    )
    header = TrainingBatch(id="batch-3", index=3, samples=[], policy_version=3, staleness=[])  # a large batch's letter
    assert what_was_lost(letter(header, BATCHES, skipped), batches_stream=BATCHES, key=None, run_id="r") == LostBatch(
        "batch-3", 2, None
    )


def test_a_batch_the_learner_refused_unconsumed_is_to_be_sent_again() -> None:
    """A batch from the future (or conflicting with what the learner consumed at its index) is
    dead-lettered without a version published for it: its samples were not trained, and the run waits
    for that index - the coordinator gets the whole entry back to send it again."""
    batch = TrainingBatch(
        id="batch-3", index=3, samples=[whole("p7", 1), whole("p8", 0)], policy_version=3, staleness=[0, 0]
    )
    for error in (
        "PoisonMessageError: batch-3 is ahead of the learner, whose next batch is 1: ...",
        "PoisonMessageError: batch-3 has index 3, which the learner already consumed as ...",
    ):
        refused = what_was_lost(letter(batch, BATCHES, error), batches_stream=BATCHES, key=None, run_id="r")
        assert refused == RefusedBatch("batch-3", 2, 2, encode(batch))


def test_unreadable_payloads_and_other_messages() -> None:
    cut = encode(sample("p1", 0))[:20]  # an oversized entry's payload, cut
    assert (
        what_was_lost(letter(cut, BATCHES), batches_stream=BATCHES, key=None, run_id="r") is None
    )  # bytes that are no batch of the run
    named = "MessageTooLargeError: batch-9 (4096 samples) of 40.0 MiB is over the 32.0 MiB limit"
    assert what_was_lost(letter(cut, BATCHES, named), batches_stream=BATCHES, key=None, run_id="r") == LostBatch(
        "batch-9", 4096, None
    )
    assert what_was_lost(letter(cut), batches_stream=BATCHES, key=None, run_id="r") is None
    weights = WeightsPublished(version=1, step=1, batch_id="", checksum="0", num_bytes=0, num_buckets=0, endpoint="")
    assert what_was_lost(letter(weights, "streamrl:r:weights"), batches_stream=BATCHES, key=None, run_id="r") is None


def test_a_manifests_letter_names_its_batch_and_the_hashes_of_its_samples() -> None:
    """A batch travels as a manifest: its letter counts the same, and names the hashes to delete."""
    batch = TrainingBatch(
        id="batch-3",
        index=3,
        samples=[whole("p7", 0), whole("p7", 1), whole("p8", 0)],
        policy_version=3,
        staleness=[0] * 3,
    )
    keys = ["streamrl:{r}:batched:batch-3:p7"] * 2 + ["streamrl:{r}:batched:batch-3:p8"]
    manifest = manifest_of(batch, keys, [100, 100, 100])
    skipped = f"batch-3 (3 samples) {BATCH_SKIPPED}: batch-3: payloads missing in Redis (1 of the 3 ...)"
    lost = what_was_lost(letter(manifest, BATCHES, skipped), batches_stream=BATCHES, key=None, run_id="r")
    assert lost == LostBatch("batch-3", 3, 2, ("streamrl:{r}:batched:batch-3:p7", "streamrl:{r}:batched:batch-3:p8"))
    refused = what_was_lost(
        letter(manifest, BATCHES, "PoisonMessageError: batch-3 is ahead"), batches_stream=BATCHES, key=None, run_id="r"
    )
    assert refused == RefusedBatch("batch-3", 3, 2, encode(manifest), lost.buffers)  # type: ignore[union-attr]
    assert (
        what_was_lost(letter(manifest, "streamrl:r:scored", skipped), batches_stream=BATCHES, key=None, run_id="r")
        is None
    )


def test_with_the_runs_key_a_batch_letter_is_believed_only_when_the_learner_signed_it() -> None:
    """Finding 5 of issue 38: any credential can write to ``dead``. With the run's key, a letter about a batch that
    is not signed with it (none, another key, another run's, or altered after signing) is forged: nothing is lost by
    it. Letters about other streams (any consumer's) need no signature."""
    key = b"the-run-key-0123456789"
    batch = TrainingBatch(id="batch-3", index=3, samples=[whole("p7", 0)], policy_version=3, staleness=[0])
    manifest = manifest_of(batch, ["streamrl:{r}:batched:batch-3:p7"], [100])
    skipped = letter(manifest, BATCHES, f"batch-3 (1 samples) {BATCH_SKIPPED}: nan")

    def lost(dead: DeadLetter) -> object:
        return what_was_lost(dead, batches_stream=BATCHES, key=key, run_id="r")

    assert lost(sign(skipped, key, run_id="r")) == LostBatch("batch-3", 1, 1, ("streamrl:{r}:batched:batch-3:p7",))
    for forged in (
        skipped,
        sign(skipped, b"someone-else-0123456789", run_id="r"),
        sign(skipped, key, run_id="another-run"),
        replace(sign(letter(manifest, BATCHES, "E: refused"), key, run_id="r"), error=skipped.error),
    ):
        verdict = lost(forged)
        assert isinstance(verdict, ForgedLetter) and "forged, refused" in verdict.reason, verdict
    assert "is not signed (STREAMRL_WEIGHTS_KEY, run 'r')" in lost(skipped).reason  # type: ignore[attr-defined]
    assert lost(letter(prompt("p7"))) == LostGroup("p7")  # unsigned, from another stream: believed
    assert what_was_lost(skipped, batches_stream=BATCHES, key=None, run_id="r") == lost(sign(skipped, key, run_id="r"))
