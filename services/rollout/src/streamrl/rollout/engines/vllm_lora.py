"""The LoRA adapter a vLLM engine serves (``rollout.engine.max_lora_rank`` set; :mod:`streamrl.rollout.weights.lora`).

vLLM 0.32 loads an adapter from a folder (``LoRARequest.lora_path``), not from tensors in memory, so
each version is written as a peft folder under a folder this engine owns in ``/dev/shm`` (memory-backed;
the system's temporary folder where there is none), loaded with ``add_lora`` under a new adapter id,
and the previous version's adapter is removed from vLLM and its folder deleted. Every request added
after that carries :attr:`VLLMAdapters.current`. The engine's driver thread is the only caller.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from vllm.lora.request import LoRARequest

from streamrl.common.errors import WeightSyncError
from streamrl.common.messages import LoraAdapter
from streamrl.rollout.weights.lora import write_peft_folder

logger = logging.getLogger(__name__)
SHM = Path("/dev/shm")


class VLLMAdapters:
    """The adapter versions of one vLLM engine, one peft folder each (only the current one kept)."""

    def __init__(self, base_model: str) -> None:
        self._base_model = base_model
        self.root = Path(tempfile.mkdtemp(prefix="streamrl-lora-", dir=SHM if SHM.is_dir() else None))
        self.current: LoRARequest | None = None
        """The adapter every new request is generated with (None: the base model, before the first version)."""
        self._next_id = 1

    def load(self, llm: Any, adapter: LoraAdapter, tensors: Sequence[tuple[str, torch.Tensor]], version: int) -> None:
        """Write and load ``version``'s adapter, then drop the previous one; WeightSyncError when vLLM refuses
        it (the previous one is then still served)."""
        lora_id, self._next_id = self._next_id, self._next_id + 1
        folder = write_peft_folder(
            self.root / f"{lora_id}-v{version}", adapter, [(n, t.cpu()) for n, t in tensors], self._base_model, version
        )
        request = LoRARequest(lora_name=f"policy-v{version}", lora_int_id=lora_id, lora_path=str(folder))
        try:
            llm.llm_engine.add_lora(request)
        except Exception as e:
            shutil.rmtree(folder, ignore_errors=True)
            raise WeightSyncError(f"vLLM refused the LoRA adapter of version {version}: {e}") from e
        previous, self.current = self.current, request
        if previous is not None:
            llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        logger.info("LoRA adapter of version %d loaded (rank %d, id %d)", version, adapter.rank, lora_id)

    def drop(self, llm: Any) -> None:
        """Serve no adapter any more (a full-weights version was loaded): new requests use the base weights."""
        if self.current is not None:
            llm.llm_engine.remove_lora(self.current.lora_int_id)
            shutil.rmtree(self.current.lora_path, ignore_errors=True)
            self.current = None

    def close(self) -> None:
        """Delete every adapter folder."""
        shutil.rmtree(self.root, ignore_errors=True)
