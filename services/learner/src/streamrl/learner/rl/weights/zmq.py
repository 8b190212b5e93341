"""Serve the learner's weights to rollout engines over ZMQ (the portable path of docs/design.md section 5).

:class:`WeightServer` turns named torch tensors into the buckets of
:mod:`streamrl.common.weights.wire` and serves the latest published version from a background
thread; rollout workers pull them (``fetch_buckets``), late joiners included. The caller (the
learner's rank 0, after gathering ZeRO-3 shards) publishes a ``WeightsPublished`` message with the
returned checksum, sizes and :attr:`WeightServer.endpoint`.

Tensors are copied to host memory once per version (:func:`streamrl.torchkit.wire.to_wire`: bf16
stays bf16 on the wire, half the bytes of fp32). With tied embeddings ``lm_head.weight`` is sent
explicitly (:mod:`streamrl.learner.rl.weights.tied`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping

import torch

from streamrl.common.weights.wire import DEFAULT_BUCKET_BYTES, BucketServer, WireTensor, encode_version
from streamrl.learner.rl.weights.tied import TIED_ALIASES, tied_copies
from streamrl.torchkit.wire import to_wire

logger = logging.getLogger(__name__)


class WeightServer:
    """Buckets and serves the latest weights version; bind ``port=0`` for a free port.

    Example:
        server = WeightServer(host="0.0.0.0", port=0, advertise_host="learner-0")
        checksum, num_bytes, num_buckets = server.publish(model.state_dict().items(), version=3)
        # -> WeightsPublished(version=3, checksum=checksum, endpoint=server.endpoint, ...)
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        self._server = BucketServer(host, port, advertise_host)
        self._bucket_bytes = bucket_bytes

    @property
    def endpoint(self) -> str:
        """``tcp://host:port`` receivers connect to."""
        return self._server.endpoint

    @property
    def version(self) -> int:
        """Version served now (-1 = none yet)."""
        return self._server.current_version

    def publish(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        tied_aliases: Mapping[str, tuple[str, ...]] = TIED_ALIASES,
    ) -> tuple[str, int, int]:
        """Serve ``named_tensors`` as ``version`` (replacing the previous one).

        Returns (checksum, num_bytes, num_buckets) for the ``WeightsPublished`` message.
        """
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        if version <= self._server.current_version:
            raise ValueError(f"version must increase: {version} after {self._server.current_version}")
        start = time.perf_counter()
        wire = [to_wire(name, t) for name, t in named_tensors]
        names = {t.name: t for t in wire}
        for alias, source in tied_copies(names, tied_aliases):
            wire.append(WireTensor(alias, names[source].dtype, names[source].array))
        encoded = encode_version(wire, version, self._bucket_bytes)
        self._server.set_current(encoded)
        logger.info(
            "serving weights version %d: %d tensors, %d bytes in %d buckets (%.3f s) at %s",
            version,
            len(wire),
            encoded.num_bytes,
            len(encoded.buckets),
            time.perf_counter() - start,
            self.endpoint,
        )
        return encoded.checksum, encoded.num_bytes, len(encoded.buckets)

    def close(self) -> None:
        """Stop serving and release the port."""
        self._server.close()
