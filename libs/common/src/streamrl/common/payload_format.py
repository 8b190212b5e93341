"""The bytes of a trajectory's payload (:mod:`streamrl.common.payloads`): what the rollout worker SETs once, what the
reward tier and the learner read.

Payload format 2 (:func:`pack_payload`) is one msgpack array ``[2, head, tensors]``, readable by any msgpack
library:

* ``head``: the :class:`~streamrl.common.messages.Trajectory` (type tag and version included) without its tensors
  and images - each tensor empty (``int32``, shape ``[0]``), ``images`` ``[]`` - so text, label, metadata, turns,
  versions, sampling, timings and trace context: everything a reward function, a remote reward service or a
  reward model on text is given;
* ``tensors``: a :class:`PayloadTensors` (prompt and response ids, behaviour log-probs, loss mask, images).

The :class:`~streamrl.common.messages.TrajectoryRecord` carries the length of the prefix up to the end of the
head (``payload_head_bytes``), so a reader of the head alone asks for that prefix (``GETRANGE key 0 n-1``,
:func:`unpack_head`) and a reader of the trajectory reads the whole string (:func:`unpack_payload`).

Format 1, the encoded Trajectory alone (a msgpack map; its record's ``payload_head_bytes`` is 0), is still read
whole by :func:`unpack_payload`. Another format is refused naming it (:class:`PoisonMessageError`). A reader
older than format 2 refuses a format-2 payload as undecodable: upgrade the reward and learner tiers first.
"""

from __future__ import annotations

import msgspec

from streamrl.common.codec import decode
from streamrl.common.errors import PoisonMessageError
from streamrl.common.messages import SUPPORTED_VERSIONS, Image, Tensor, Trajectory

PAYLOAD_FORMAT = 2
"""The payload format :func:`pack_payload` writes: ``[2, head, tensors]``. Format 1, the encoded Trajectory
alone, is still read."""
_FORMAT_2 = b"\x93\x02"
"""How a format-2 payload starts: a msgpack array of 3, then the integer 2."""
_NO_TENSOR = Tensor(dtype="int32", shape=[0], data=b"")


class PayloadTensors(msgspec.Struct, frozen=True):
    """The second part of a format-2 payload: the Trajectory's fields only the learner (and a scorer on token ids)
    reads."""

    prompt_ids: Tensor
    response_ids: Tensor
    logprobs: Tensor
    loss_mask: Tensor
    images: list[Image] = []


_encoder = msgspec.msgpack.Encoder()
_payload_decoder = msgspec.msgpack.Decoder(tuple[int, Trajectory, PayloadTensors])


def pack_payload(trajectory: Trajectory) -> tuple[bytes, int]:
    """``trajectory`` as a format-2 payload, and the length of its prefix up to the end of the head (pure)."""
    t = trajectory
    head = _FORMAT_2 + _encoder.encode(
        msgspec.structs.replace(
            t, prompt_ids=_NO_TENSOR, response_ids=_NO_TENSOR, logprobs=_NO_TENSOR, loss_mask=_NO_TENSOR, images=[]
        )
    )
    tensors = PayloadTensors(
        prompt_ids=t.prompt_ids,
        response_ids=t.response_ids,
        logprobs=t.logprobs,
        loss_mask=t.loss_mask,
        images=t.images,
    )
    return head + _encoder.encode(tensors), len(head)


def _check_format(data: bytes) -> bool:
    """True for a format-2 payload (or its head), False for format 1 (a map); PoisonMessageError for another."""
    if data[:1] == b"\x93":
        if data[:2] != _FORMAT_2:
            raise PoisonMessageError(f"payload format {data[1:2].hex() or '?'} (hex) is not supported (1, 2)")
        return True
    return False


def _check_version(head: Trajectory) -> Trajectory:
    if head.v not in SUPPORTED_VERSIONS["trajectory"]:
        raise PoisonMessageError(f"payload of {head.id}: unsupported trajectory version v={head.v}")
    return head


def unpack_payload(data: bytes) -> Trajectory:
    """The Trajectory a whole payload (format 2 or 1) holds; PoisonMessageError when it is not one (pure)."""
    if not _check_format(data):
        return decode(data, Trajectory)
    try:
        _, head, t = _payload_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise PoisonMessageError(f"invalid payload (format 2): {e}") from e
    return msgspec.structs.replace(
        _check_version(head),
        prompt_ids=t.prompt_ids,
        response_ids=t.response_ids,
        logprobs=t.logprobs,
        loss_mask=t.loss_mask,
        images=t.images,
    )


def unpack_head(prefix: bytes) -> Trajectory:
    """The Trajectory without its tensors (each empty) and images that the first
    :attr:`TrajectoryRecord.payload_head_bytes` of a format-2 payload hold: what text scorers read (pure)."""
    if not _check_format(prefix):
        raise PoisonMessageError(f"a payload head must start with {_FORMAT_2.hex()} (format 2), got {prefix[:2].hex()}")
    return _check_version(decode(prefix[len(_FORMAT_2) :], Trajectory))
