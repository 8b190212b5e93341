"""The VLM smoke task: name the colour of a square, and the ``look_again`` environment.

A plain file (no streamrl import), named by ``recipes/vlm.toml`` twice: ``reward_func`` for the
reward tier, ``Environment`` for the rollout tier's multi-turn episodes.

* ``reward_func``: 1.0 when the episode's text names the row's colour (the label), else 0.0.
* ``Environment``: after the model's first turn it answers with text and a second image - the same
  colour, as a circle - and asks again; the episode ends after the second turn. So every trajectory
  holds an image that an environment step returned (loss-masked, like all environment tokens).
"""

from __future__ import annotations

import io
from typing import Any

from PIL import Image, ImageDraw

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220), "yellow": (230, 210, 40)}
SIZE = 64


def draw(colour: str, shape: str = "square", seed: int = 0) -> bytes:
    """A PNG of a ``colour`` square or circle on grey, placed by ``seed``."""
    image = Image.new("RGB", (SIZE, SIZE), (128, 128, 128))
    pen = ImageDraw.Draw(image)
    x, y = 4 + seed % 20, 4 + (seed * 7) % 20
    box = (x, y, x + 36, y + 36)
    (pen.ellipse if shape == "circle" else pen.rectangle)(box, fill=COLOURS[colour])
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def reward_func(queries: list[str], prompts: list[str], labels: list[str], **kwargs: Any) -> dict[str, Any]:
    """OpenRLHF-compatible reward: 1.0 when the response (after the prompt) names the label's colour."""
    if not len(queries) == len(prompts) == len(labels):
        raise ValueError(f"queries, prompts and labels differ in length: {len(queries)}, {len(prompts)}, {len(labels)}")
    rewards = [
        1.0 if label in query[len(prompt) :].lower() else 0.0
        for query, prompt, label in zip(queries, prompts, labels, strict=True)
    ]
    return {
        "rewards": rewards,
        "scores": list(rewards),
        "extra_logs": {"vlm/accuracy": sum(rewards) / max(len(rewards), 1)},
    }


class Environment:
    """Two turns: after the first answer, show the colour again as a circle and ask once more."""

    def __init__(self, image_token: str = "<image>") -> None:
        self.image_token = image_token
        self.colour = ""
        self.turn = 0

    def reset(self, prompt: str, label: str | None, metadata: dict[str, Any]) -> None:
        self.colour = label or "red"
        self.turn = 0

    def step(self, response: str) -> dict[str, Any]:
        self.turn += 1
        if self.turn > 1:
            return {"observation": "", "done": True}
        circle = Image.open(io.BytesIO(draw(self.colour, "circle", seed=self.turn)))
        text = f"<|im_end|>\n<|im_start|>user\n{self.image_token}Look again: what colour is the circle?<|im_end|>\n<|im_start|>assistant\n"
        return {"observation": text, "images": [circle], "done": False}
