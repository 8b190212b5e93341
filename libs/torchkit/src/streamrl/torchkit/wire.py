"""Torch tensors to and from the ZMQ weight path's buckets (:mod:`streamrl.common.weights.wire`).

The wire carries numpy arrays; numpy has no bfloat16, so a bf16 tensor travels as its raw 16-bit
words (``uint16``) with the dtype name ``bfloat16``. :func:`to_wire` is the learner's side (a host
copy of each tensor), :func:`to_torch` the receiver's (a view of the received bytes, no copy).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from streamrl.common.weights.wire import BF16, ReceivedTensor, WireTensor


def to_wire(name: str, tensor: torch.Tensor) -> WireTensor:
    """A host, C-contiguous numpy view of ``tensor`` (bf16 as raw uint16 words)."""
    host = tensor.detach().to("cpu").contiguous()
    if host.dtype == torch.bfloat16:
        return WireTensor(name, BF16, host.view(torch.int16).numpy().view(np.uint16))
    array = host.numpy()
    return WireTensor(name, array.dtype.name, array)


def to_torch(tensor: ReceivedTensor) -> torch.Tensor:
    """A torch view of a received (read-only) tensor, bf16 words reinterpreted; no copy.

    The view must only be read (a loader copies from it into the parameters).
    """
    array = tensor.array.view(np.int16) if tensor.dtype == BF16 else tensor.array
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        out = torch.from_numpy(array)
    return out.view(torch.bfloat16) if tensor.dtype == BF16 else out
