"""Tied weights: names every weight path sends as a copy of another tensor.

With tied embeddings a model has no ``lm_head.weight`` of its own, but the engines want one: vLLM's
CPU backend keeps a separately packed copy of the head, which must be refreshed too. So every
path (ZMQ, CUDA IPC, broadcast) sends it explicitly, as a copy of the embedding.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

TIED_ALIASES: Mapping[str, tuple[str, ...]] = {
    "lm_head.weight": (
        "model.embed_tokens.weight",  # causal LMs
        "model.text_model.embed_tokens.weight",  # vision-language models: Idefics3, SmolVLM
        "model.language_model.embed_tokens.weight",  # LLaVA, Qwen2-VL
    ),
}
"""Names sent as a copy of another tensor when the caller's tensors lack them (tied weights): the
first of the candidate sources that is present."""


def tied_copies(names: Collection[str], aliases: Mapping[str, tuple[str, ...]] = TIED_ALIASES) -> list[tuple[str, str]]:
    """(alias, source) for each alias missing from ``names`` whose source is there."""
    copies = []
    for alias, sources in aliases.items():
        source = next((s for s in sources if s in names), None)
        if alias not in names and source is not None:
            copies.append((alias, source))
    return copies
