"""Vision-language policies in the learner: which checkpoints are one, a trajectory's images as model
inputs, and the forward that feeds them.

A checkpoint is vision-language when its config has a ``vision_config`` (:mod:`streamrl.torchkit.vision`,
which the rollout engines use too); the engine then loads it with
``AutoModelForImageTextToText`` and its ``AutoProcessor`` (:mod:`streamrl.learner.engine`). A
trajectory's ``prompt_ids`` / ``response_ids`` are the *expanded* form (every image already replaced
by its tokens, exactly what the model saw) and ``images`` holds every image in order of appearance
(the prompt's, then those of environment steps). :class:`ImageInputs` turns them into model inputs,
once per training step, for each trajectory:

1. decode every image with PIL, converted to RGB (what the rollout engines feed their processors);
2. run the model's processor on the images alone, ``processor(text=[image_token * n], images=[images])``:
   its ``input_ids`` are the images' expansions one after another, so the number of image tokens
   there is the number the trajectory must hold (a ValueError naming the trajectory otherwise), and
   its other outputs (``pixel_values``, ``pixel_attention_mask``, ``image_grid_thw``, ...) are the
   row's pixel inputs, a batch of one. A per-token output (``mm_token_type_ids`` of Qwen2-VL,
   ``token_type_ids`` of Gemma 3) is rebuilt for the trajectory's own ids: each token id keeps the
   value the processor gave it in the expansions, other ids get 0;
3. image tokens in the response (environment feedback) must have loss mask 0.

Group members share their prompt's images: a step processes each distinct image list once.

The forward (:func:`response_logprobs`): a micro-batch that holds an image row runs row by row through
the model's body (``model.model``) with each row's pixel inputs, unpadded; the model puts the image
features at its image tokens and computes its own positions (multimodal RoPE included), so a row's
hidden states are those of a plain ``model(input_ids, **pixel_inputs)``. The positions that predict
response tokens then go through the same log-prob head as text (:func:`lm_forward.head_logprobs`:
fused, per-token temperature, entropies); under ZeRO-3 the whole model is called through the engine
and its logits used, as on the text path. A micro-batch without images keeps the flat varlen path of
:mod:`streamrl.learner.lm_forward`: text-only training runs exactly as before.

Simplifications, and why:

* One forward per row: the batched layout of pixel inputs differs between models (Idefics3 pads every
  row to the same number of images, Qwen2-VL concatenates all patches); one row at a time is the layout
  every model takes, with no padding and no packing to get wrong. It costs GPU utilisation on many
  short image rows; text rows that share a micro-batch with an image row take the same per-row path.
* On more than one rank a vision-language policy needs ZeRO stage 0 (:func:`check_learner`). A rank
  whose micro-batch has no image gives the vision tower and connector no gradient, and its rows make
  a different number of forwards than another rank's: DeepSpeed's stage 0 reduces every gradient at
  the step, zeros where a rank has none, but ZeRO-1/2 reduce only the gradients a rank has (its
  buckets would pair up different tensors across ranks) and ZeRO-3 gathers parameters inside every
  forward (the ranks' gathers must match call for call). On one rank every stage works.
* No critic: a vision-language checkpoint does not load as a token-classification value model, so
  the ``gae`` estimator is refused; the critic-free estimators all work.
* ``ds.compile`` works, but the warm-up is text-only: the first step with images compiles the image
  path (the tiny Idefics3 on this 2-core CPU: 187 s, then 0.06 s per step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from streamrl.common.images import decode_image
from streamrl.common.messages import Trajectory
from streamrl.learner.ds_config import DeepSpeedConfig
from streamrl.learner.lm_forward import head_logprobs, lm_parts, to_device, zero3
from streamrl.learner.model_batch import PixelInputs, RLBatch

_TEXT_KEYS = ("input_ids", "attention_mask")


def image_token_id(config: Any) -> int:
    """The id of the token the model's image features replace (``config.image_token_id``, or the older
    ``image_token_index``)."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    raise ValueError(f"{type(config).__name__} has no image_token_id: the learner cannot place image features")


def vision_tower(model: Any) -> torch.nn.Module:
    """The vision encoder of a vision-language model (``vision_model`` of Idefics3, ``visual`` of
    Qwen2-VL, ``vision_tower`` of LLaVA); the connector / projector that follows it is not part of it,
    except where the model nests it inside (Qwen2-VL's merger)."""
    tower = model.get_encoder(modality="image")
    if tower is model:
        raise ValueError(f"{type(model).__name__} has no vision tower that transformers can find")
    return tower


def check_learner(*, uses_critic: bool, zero_stage: int, world_size: int) -> None:
    """ValueError for the learner settings a vision-language policy does not support (module docstring):
    a critic (``algo.uses_critic``), or ZeRO stage ``ds.zero_stage`` > 0 on ``world_size`` > 1 ranks."""
    if uses_critic:
        raise ValueError(
            "algo.advantage.estimator = 'gae' needs a critic, and a vision-language checkpoint does not load as a "
            "value model: use a critic-free estimator (grpo, rloo, reinforce, ...) with a vision-language policy"
        )
    if world_size > 1 and zero_stage != 0:
        raise ValueError(
            f"a vision-language policy on {world_size} ranks needs ds.zero_stage = 0 (got {zero_stage}): "
            "with ZeRO 1-3 the ranks' gradient reductions or parameter gathers would not match when only some "
            "ranks' micro-batches hold images; on one rank every stage works"
        )


def token_types(ids: np.ndarray, expansion_ids: np.ndarray, expansion_values: np.ndarray) -> np.ndarray:
    """A per-token processor output for ``ids``: the value each token id has in the images' expansions
    (``expansion_ids`` / ``expansion_values``, the processor's output on the images alone), 0 for ids
    that do not occur there. ValueError when one id has two values there (the rule would not hold)."""
    table: dict[int, int] = {}
    for token, value in zip(expansion_ids.ravel().tolist(), expansion_values.ravel().tolist(), strict=True):
        if table.setdefault(token, value) != value:
            raise ValueError(f"token {token} has values {table[token]} and {value} in one image expansion")
    out = np.zeros(ids.shape, dtype=expansion_values.dtype)
    for token, value in table.items():
        out[ids == token] = value
    return out


class ImageInputs:
    """Per-row pixel inputs of trajectories, checked against their image tokens (module docstring)."""

    def __init__(self, processor: Any, token_id: int) -> None:
        self.processor = processor
        """The model's ``AutoProcessor``."""
        self.token_id = token_id
        """Id of the image token (the positions the image features replace)."""

    def __call__(self, trajectories: Sequence[Trajectory]) -> list[PixelInputs | None]:
        """The pixel inputs of each trajectory (None for one without images), in order."""
        expansions: dict[tuple[tuple[str, bytes | None, str | None], ...], tuple[int, dict[str, Any]]] = {}
        out: list[PixelInputs | None] = []
        for t in trajectories:
            if not t.images:
                self._check_tokens(t, 0, 0)
                out.append(None)
                continue
            key = tuple((image.media_type, image.data, image.uri) for image in t.images)
            if key not in expansions:
                expansions[key] = self._expand(t)
            num_tokens, outputs = expansions[key]
            self._check_tokens(t, len(t.images), num_tokens)
            out.append(self._row_inputs(t, outputs))
        return out

    def _expand(self, t: Trajectory) -> tuple[int, dict[str, Any]]:
        """(image tokens of the images' expansions, the processor's outputs) for the images of ``t``."""
        images = [decode_image(image, f"trajectory {t.id}: image {k}") for k, image in enumerate(t.images)]
        text = self.processor.image_token * len(images)
        outputs = dict(self.processor(text=[text], images=[images], return_tensors="pt"))
        return int((outputs["input_ids"] == self.token_id).sum()), outputs

    def _check_tokens(self, t: Trajectory, num_images: int, expected: int) -> None:
        prompt, response = t.prompt_ids.to_numpy(), t.response_ids.to_numpy()
        found = int((prompt == self.token_id).sum() + (response == self.token_id).sum())
        if found != expected:
            raise ValueError(
                f"trajectory {t.id}: prompt and response hold {found} image tokens (id {self.token_id}) for "
                f"{num_images} image(s), which the processor expands into {expected}: ids must be the expanded "
                "form, with every image of the trajectory in Trajectory.images"
            )
        unmasked = np.flatnonzero((response == self.token_id) & (t.loss_mask.to_numpy() != 0))
        if unmasked.size:
            raise ValueError(
                f"trajectory {t.id}: response token {int(unmasked[0])} is an image token with loss mask 1; "
                "image tokens are environment tokens (loss mask 0)"
            )

    @staticmethod
    def _row_inputs(t: Trajectory, outputs: dict[str, Any]) -> PixelInputs:
        """The processor's outputs for ``t``'s row: image tensors as they are, per-token ones rebuilt."""
        expansion = outputs["input_ids"]
        ids = np.concatenate([t.prompt_ids.to_numpy(), t.response_ids.to_numpy()]).astype(np.int64)[None, :]
        row: PixelInputs = {}
        for key, value in outputs.items():
            if key in _TEXT_KEYS:
                continue
            if value.shape == expansion.shape:  # one value per token of the expansions
                row[key] = torch.from_numpy(token_types(ids, expansion.numpy(), value.numpy()))
            else:
                row[key] = value
        return row


def image_inputs(engine: Any) -> ImageInputs | None:
    """The :class:`ImageInputs` of a :class:`~streamrl.learner.engine.ModelEngine`'s model; None for a text-only one."""
    if engine.processor is None:
        return None
    return ImageInputs(engine.processor, image_token_id(engine.module.config))


def row_features(engine: Any, input_ids: torch.Tensor, pixels: PixelInputs | None) -> torch.Tensor:
    """``[n, H]`` final hidden states of one row ``[1, n]`` with its pixel inputs (None: text only);
    under ZeRO-3 ``[n, V]`` logits of the whole model called through the engine."""
    model = getattr(engine, "module", engine)
    param = next(model.parameters())
    inputs = {
        k: to_device(v, param.device).to(param.dtype) if v.is_floating_point() else to_device(v, param.device)
        for k, v in (pixels or {}).items()
    }
    ids = to_device(input_ids, param.device)
    if zero3(engine):
        return engine(input_ids=ids, **inputs).logits[0]
    body, _ = lm_parts(engine)
    return body(input_ids=ids, **inputs).last_hidden_state[0]


def response_logprobs(
    engine: Any, mb: RLBatch, cfg: DeepSpeedConfig, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[b, T]`` log-probs of each response token at its sample's temperature (0 after the response), and
    the entropies when asked, of a micro-batch holding image rows: each row forwarded on its own with its
    pixel inputs (module docstring). Same contract as :func:`lm_forward.rl_response_logprobs`."""
    lengths = mb.attention_mask.sum(dim=1)
    response_lens = lengths - mb.prompt_lens
    if bool(((mb.prompt_lens < 1) & (response_lens > 0)).any()):
        raise ValueError("every sample with a response needs a prompt of at least one token")
    width = mb.response_ids.shape[1]
    picked = []
    for i in range(mb.size):
        n, p = int(lengths[i]), int(mb.prompt_lens[i])
        hidden = row_features(engine, mb.input_ids[i : i + 1, :n], mb.pixels[i])
        picked.append(hidden[max(p - 1, 0) : n - 1])  # the outputs that predict response tokens 0..n-p-1
    hidden = torch.cat(picked)
    inside = torch.arange(width)[None, :] < response_lens[:, None]
    temperature = mb.temperatures[:, None].expand(-1, width)[inside]
    logp, ent = head_logprobs(engine, hidden, mb.response_ids[inside], cfg, temperature, with_entropy)
    inside = to_device(inside, hidden.device)
    out = torch.zeros(inside.shape, dtype=torch.float32, device=hidden.device).index_put((inside,), logp)
    ent_out = None if ent is None else torch.zeros_like(out).index_put((inside,), ent)
    return out, ent_out
