"""vLLM worker extension that receives new weights (through the event's weight receiver) and loads them.

vLLM mixes this class into every worker (``worker_extension_cls``). The rollout engine calls its
methods by name through ``collective_rpc``, so no Python function is shipped to the workers: each
worker receives and verifies the version itself, through the
:class:`~streamrl.torchkit.weights.protocol.WeightReceiver` the event's ``transport`` tag picks
(:func:`streamrl.torchkit.weights.factory.receiver_for`; built at the first update, kept while the
transport stays: IPC handles opened once, a broadcast member receiving in the background), and once
every worker holds the whole version the engine asks them to feed it to the model runner's
``reload_weights``. That entry point is what works on the CPU backend, which repacks linear weights
(calling the model's ``load_weights`` directly changes nothing there) - unless the engine was built
with ``cpu_weight_packing`` off: then the kernels read the live parameters and ``load_weights`` copies
the new values into them in place. Over a broadcast group vLLM's loader takes from the full tensors
the shard its rank needs.

Imported by vLLM inside the worker by qualified name; it imports torch, never vLLM.
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from typing import Any

import torch

from streamrl.common.codec import decode
from streamrl.common.errors import PoisonMessageError, WeightSyncError
from streamrl.common.messages import WeightsPublished
from streamrl.torchkit.weights.factory import receiver_for
from streamrl.torchkit.weights.protocol import WeightReceiver

logger = logging.getLogger(__name__)


def _reads_weight(cpu_linear: Any) -> bool:
    """Whether a layer's CPU matmul (vLLM's ``cpu_linear``; None off CPU) is torch's F.linear on the
    weight it is handed, rather than a kernel on a repacked copy (oneDNN, SGL, zentorch)."""
    if cpu_linear is None or cpu_linear is torch.nn.functional.linear:
        return True
    code = getattr(cpu_linear, "__code__", None)
    return code is not None and code.co_names[-2:] == ("functional", "linear")


class WorkerWeights:
    """Mixed into the vLLM worker: ``self`` is the worker, ``self.model_runner`` its runner.

    Two phases, so that every worker (tensor-parallel ranks) holds the complete verified version
    before any of them touches its model: ``reload_weights`` empties the layers before it consumes
    the iterator, so an error while receiving inside it would leave a broken model.
    """

    model_runner: Any
    device: torch.device
    rank: int
    _streamrl_receiver: WeightReceiver | None = None
    _streamrl_staged: tuple[int, list[tuple[str, torch.Tensor]], ExitStack] | None = None
    """The verified version held open (its tensors are the receiver's until the stack closes)."""

    def streamrl_stage_weights(
        self, event: bytes, timeout_s: float, tensor_parallel_size: int
    ) -> tuple[int, str | None]:
        """Receive and verify the version of ``event`` (an encoded WeightsPublished) and keep it staged.
        Return (its version, None), or (-1, why it failed: nothing staged)."""
        self.streamrl_discard_weights()
        stack = ExitStack()
        try:
            message = decode(event, WeightsPublished)
            self._streamrl_receiver = receiver_for(
                message,
                self._streamrl_receiver,
                device=self.device,
                label=f"tp{self.rank}",
                tensor_parallel_size=tensor_parallel_size,
            )
            received = stack.enter_context(self._streamrl_receiver.receive(message, timeout_s))
        except (WeightSyncError, PoisonMessageError, ValueError) as e:
            stack.close()
            return -1, f"{type(e).__name__}: {e}"
        self._streamrl_staged = (received.version, received.tensors, stack)
        return received.version, None

    def streamrl_release_staging(self) -> None:
        """Free the receiver's staging memory (the engine is going to sleep: the memory is the learner's meanwhile)."""
        self.streamrl_discard_weights()
        if self._streamrl_receiver is not None:
            self._streamrl_receiver.release_memory()

    def streamrl_close_receiver(self) -> None:
        """Release the receiver (the engine is closing: e.g. leave the learner's weight group)."""
        self.streamrl_discard_weights()
        if self._streamrl_receiver is not None:
            self._streamrl_receiver.close()
            self._streamrl_receiver = None

    def streamrl_apply_weights(self, version: int, in_place: bool = False) -> int:
        """Load the staged ``version`` into the model; return the number of tensors loaded.

        ``in_place``: the kernels read the model's parameters directly (no repacked copies), so the
        model's own ``load_weights`` copies the new values into them; every parameter must be
        written. Otherwise vLLM's ``reload_weights`` reloads and reprocesses layer by layer.
        """
        staged = self._streamrl_staged
        assert staged is not None and staged[0] == version, f"version {version} is not staged"
        start = time.perf_counter()
        try:
            if in_place:
                model = self.model_runner.get_model()  # (under a CUDA graph wrapper on a GPU)
                loaded = model.load_weights(iter(staged[1]))
                missing = {name for name, _ in model.named_parameters()} - set(loaded or ())
                if missing:
                    raise RuntimeError(f"version {version} left parameters unwritten: {sorted(missing)[:5]}")
            else:
                self.model_runner.reload_weights(weights_iterator=iter(staged[1]), is_checkpoint_format=True)
        finally:
            self.streamrl_discard_weights()
        logger.info(
            "loaded weights version %d (%d tensors) in %.3f s", version, len(staged[1]), time.perf_counter() - start
        )
        return len(staged[1])

    def streamrl_has_live_weights(self) -> bool:
        """Whether every linear and embedding layer still holds its full weight (no repacked copy
        replaced it, no quantized layer), so that an in-place update reaches the kernels."""
        for module in self.model_runner.get_model().modules():
            method = type(getattr(module, "quant_method", None)).__name__
            if method != "NoneType" and not method.startswith("Unquantized"):
                return False  # a quantized layer: its loaded tensors are processed into others
            if method in ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"):
                weight = getattr(module, "weight", None)
                if weight is None or weight.numel() == 0 or not _reads_weight(getattr(module, "cpu_linear", None)):
                    return False
        return True

    def streamrl_discard_weights(self) -> None:
        """Drop a staged version (loaded, or another worker failed to receive it); the receiver gets its buffers back."""
        staged, self._streamrl_staged = self._streamrl_staged, None
        if staged is not None:
            staged[2].close()
