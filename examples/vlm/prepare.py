"""Prepare the VLM smoke task: coloured-square images, their prompts, and a tiny random Idefics3 policy.

    python examples/vlm/prepare.py [recipe.toml] [--prepare.field=value ...]

Settings come from the recipe's ``[prepare]`` table, then ``--prepare.field=value`` overrides. Writes
into ``out_dir``: ``images/*.png``, ``train.jsonl`` / ``eval.jsonl`` (``{"prompt", "label",
"images"}``, image paths relative to the file) and ``model/`` (a random vision-language policy:
``streamrl.torchkit.testing.build_tiny_idefics3``, warm-started for ``warm_steps`` steps of
supervised training on "a colour name, then end-of-sequence" with colours drawn at random, so that its
turns end (a random policy never samples end-of-sequence, and a turn cut at the token limit ends the
episode) but which colour is shown is left to RL. A smoke task: it shows images flowing through every
tier (prompt images, an environment's image, the learner's pixel inputs, weight sync).
"""

from __future__ import annotations

import json
import logging
import random
import sys
from pathlib import Path

from pydantic import Field

from streamrl.common.config import BaseConfig, load_config
from streamrl.torchkit.testing import build_tiny_idefics3

sys.path.insert(0, str(Path(__file__).resolve().parent))
from colours import COLOURS, draw

logger = logging.getLogger(__name__)


class PrepareConfig(BaseConfig):
    """What to prepare."""

    out_dir: str = "runs/vlm_task"
    """Output folder (images/, train.jsonl, eval.jsonl, model/)."""
    num_train: int = Field(64, ge=1)
    num_eval: int = Field(16, ge=1)
    warm_steps: int = Field(60, ge=0)
    """Supervised steps on answers that end (0 = keep the random policy)."""
    seed: int = 0


def prepare(cfg: PrepareConfig) -> dict[str, int]:
    out = Path(cfg.out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(cfg.seed)
    splits: dict[str, list[dict[str, object]]] = {"train": [], "eval": []}
    for split, count in (("train", cfg.num_train), ("eval", cfg.num_eval)):
        for i in range(count):
            colour = rng.choice(sorted(COLOURS))
            name = f"images/{split}-{i}-{colour}.png"
            (out / name).write_bytes(draw(colour, seed=rng.randrange(1000)))
            splits[split].append({"prompt": "What colour is the square?", "label": colour, "images": [name]})
        (out / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in splits[split]))
    if not (out / "model" / "config.json").exists():
        build_tiny_idefics3(out / "model", seed=cfg.seed)
        warm_start(out, splits["train"], cfg.warm_steps, cfg.seed)
    return {"train": cfg.num_train, "eval": cfg.num_eval}


def warm_start(out: Path, rows: list[dict[str, object]], steps: int, seed: int) -> None:
    """Train the policy under ``out/model`` on "<random colour><eos>" answers to ``rows`` (their images)."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    if not steps:
        return
    torch.manual_seed(seed)
    processor = AutoProcessor.from_pretrained(out / "model")
    model = AutoModelForImageTextToText.from_pretrained(out / "model", dtype=torch.float32)
    eos = processor.tokenizer.eos_token
    rng = random.Random(seed)
    texts, images, answers = [], [], []
    for row in rows:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": str(row["prompt"])}]}]
        texts.append(processor.apply_chat_template(messages, add_generation_prompt=True))
        images.append([Image.open(out / str(row["images"][0])).convert("RGB")])  # type: ignore[index]
        answers.append(f"{rng.choice(sorted(COLOURS))}{eos}")  # any colour: the format, not the answer
    batch = processor(
        text=[t + a for t, a in zip(texts, answers, strict=True)], images=images, padding=True, return_tensors="pt"
    )
    labels = batch["input_ids"].clone()
    for i, answer in enumerate(answers):
        answer_len = len(processor.tokenizer(answer, add_special_tokens=False)["input_ids"])
        length = int(batch["attention_mask"][i].sum())
        labels[i, : length - answer_len] = -100  # the loss covers the answer and its end-of-sequence
        labels[i, length:] = -100
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0 or step == steps - 1:
            logger.info("warm start step %d: loss %.3f", step, loss.item())
    model.save_pretrained(out / "model")


def main(argv: list[str]) -> None:
    """Parse ``[recipe] [--field=value ...]`` and prepare."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    recipe = argv[0] if argv and not argv[0].startswith("--") else None
    config = load_config(PrepareConfig, recipe, argv[1:] if recipe else argv, section="prepare")
    print(json.dumps({"out_dir": config.out_dir, **prepare(config)}))


if __name__ == "__main__":
    main(sys.argv[1:])
