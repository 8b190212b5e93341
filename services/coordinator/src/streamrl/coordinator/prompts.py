"""Prompt datasets: JSONL / Parquet / Hugging Face dataset folders -> tokenized prompts.

A row's images (``dataset.images_key``) are read as encoded bytes and travel with the prompt; its
token ids hold one image placeholder per image, as the chat template writes it (the rollout engine
expands each into the image's tokens).

The source is addressed by a cursor (an integer that only grows): prompt ``i`` is row
``order[i % N]`` of epoch ``i // N``, with a fresh seeded shuffle per epoch. The cursor lives in
Redis, so a restarted coordinator continues with the same next prompt.

A row that cannot become a prompt (its prompt key missing, an image missing or unreadable, a chat
template that fails on it) raises :class:`BadRowError` naming the dataset, the row and the reason;
the issuer skips it (``issuing.py``). Loading checks what would make every row bad: a prompt (or
label) key no row has, and the first :data:`CHECKED_ROWS` rows all bad - a wrong key, template or
tokenizer fails at start with one line instead of skipping its way through the whole dataset.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamrl.common.errors import ConfigError
from streamrl.common.images import sniff_media_type
from streamrl.common.messages import Image
from streamrl.coordinator.config import DatasetConfig

CHECKED_ROWS = 32
"""Rows encoded at load: when all of them are bad the dataset is refused (see the module docstring)."""
ENCODED_CACHE_SIZE = 65_536
"""Tokenized prompts kept per source: an evaluation set is issued every few steps and a small training
set every epoch; tokenizing them again was ~10% of the coordinator's CPU."""


class BadRowError(ConfigError):
    """A dataset row that cannot become a prompt; the message names the dataset, the row and why."""


@dataclass(frozen=True)
class Prompt:
    """One tokenized prompt with its label and the rest of its row."""

    index: int
    """Row index in the dataset."""
    text: str
    ids: list[int]
    label: str | None
    metadata: dict[str, Any]
    images: tuple[Image, ...] = ()
    """The row's images, in the order of their placeholders in ``ids``."""


def read_images(value: Any, folder: Path, where: str) -> tuple[Image, ...]:
    """A row's image field as images: a path, a list of paths (relative to ``folder``), or dicts with
    ``bytes`` (a Hugging Face ``Image`` column). ``where`` names the row in errors."""
    if value is None:
        return ()
    images = []
    for item in value if isinstance(value, list) else [value]:
        if isinstance(item, dict) and isinstance(item.get("bytes"), bytes):
            data, name = item["bytes"], item.get("path") or "inline bytes"
        elif isinstance(item, str):
            path = folder / item
            if not path.is_file():
                raise BadRowError(f"{where}: image {item!r} not found (looked for {path})")
            data, name = path.read_bytes(), item
        else:
            raise BadRowError(f"{where}: an image must be a path or {{'bytes': ...}}, got {type(item).__name__}")
        kind = sniff_media_type(data)
        if kind is None:
            raise BadRowError(f"{where}: image {name!r} is not PNG, JPEG, GIF, WebP or BMP")
        images.append(Image(media_type=kind, data=data))
    return tuple(images)


def with_image_parts(messages: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """``messages`` with ``count`` image parts before the first user message's text, unless the
    messages already hold image parts (the row placed them)."""
    placed = sum(
        1
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if part.get("type") == "image"
    )
    if placed:
        if placed != count:
            raise ValueError(f"the messages hold {placed} image parts but the row has {count} images")
        return messages
    out = [dict(m) for m in messages]
    first = next((m for m in out if m.get("role") == "user"), None)
    if first is None:
        raise ValueError("a row with images needs a user message to put them in")
    text = first["content"]
    first["content"] = [{"type": "image"}] * count + [{"type": "text", "text": str(text)}]
    return out


def read_rows(path: str, split: str = "train") -> list[dict[str, Any]]:
    """Rows of a .jsonl/.json file, a .parquet file, or a Hugging Face dataset folder."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"dataset not found: {path}")
    if p.is_dir():
        import datasets

        loaded = datasets.load_from_disk(str(p))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ConfigError(f"dataset {path}: no split {split!r} (has {list(loaded)})")
            loaded = loaded[split]
        return [dict(row) for row in loaded]
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()  # type: ignore[no-any-return]
    if p.suffix in (".jsonl", ".json"):
        text = p.read_text()
        if p.suffix == ".json":
            data = json.loads(text)
            if not isinstance(data, list):
                raise ConfigError(f"{path}: a .json dataset must be a list of rows")
            return data
        rows = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{path}:{lineno}: invalid JSON: {e}") from e
        return rows
    raise ConfigError(f"dataset {path}: unsupported format (use .jsonl, .json, .parquet or a dataset folder)")


class PromptSource:
    """A tokenized, shuffled, endlessly repeating prompt dataset addressed by cursor."""

    def __init__(self, cfg: DatasetConfig) -> None:
        from transformers import AutoTokenizer

        self.cfg = cfg
        rows = read_rows(cfg.path, cfg.split)
        if not rows:
            raise ConfigError(f"dataset {cfg.path} is empty")
        for key in (cfg.prompt_key, cfg.label_key):
            if key is not None and not any(isinstance(row, dict) and key in row for row in rows):
                keys = sorted(rows[0]) if isinstance(rows[0], dict) else type(rows[0]).__name__
                raise ConfigError(f"dataset {cfg.path}: rows have no key {key!r} (keys: {keys})")
        if cfg.max_prompts is not None:
            rng = random.Random(cfg.seed)
            order = list(range(len(rows)))
            if cfg.shuffle:
                rng.shuffle(order)
            rows = [rows[i] for i in order[: cfg.max_prompts]]
        self.rows = rows
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
        self._epoch_order: tuple[int, list[int]] = (-1, [])
        self._tokenized = functools.lru_cache(maxsize=ENCODED_CACHE_SIZE)(self._tokenize)
        self._check_first_rows()

    def __len__(self) -> int:
        return len(self.rows)

    def _order(self, epoch: int) -> list[int]:
        """Row order of ``epoch`` (shuffled once per epoch, then kept)."""
        if self._epoch_order[0] != epoch:
            order = list(range(len(self.rows)))
            if self.cfg.shuffle:
                random.Random(self.cfg.seed * 1_000_003 + epoch).shuffle(order)
            self._epoch_order = (epoch, order)
        return self._epoch_order[1]

    def get(self, cursor: int) -> Prompt:
        epoch, offset = divmod(cursor, len(self.rows))
        index = self._order(epoch)[offset]
        return self.encode(index)

    def warm(self, indices: range) -> None:
        """Tokenize these rows into the cache now (start-up, off the event loop); bad rows are left to
        whoever asks for them."""
        for index in indices:
            try:
                self._tokenized(index)
            except BadRowError:
                pass

    def _check_first_rows(self) -> None:
        """Refuse a dataset whose first :data:`CHECKED_ROWS` rows are all bad (ConfigError, one line)."""
        checked = min(CHECKED_ROWS, len(self.rows))
        first: BadRowError | None = None
        for index in range(checked):
            try:
                self.encode(index)
                return
            except BadRowError as e:
                first = first or e
        example = str(first).removeprefix(f"dataset {self.cfg.path} ")
        raise ConfigError(f"dataset {self.cfg.path}: the first {checked} rows are all bad ({example})")

    def encode(self, index: int) -> Prompt:
        """Row ``index`` tokenized (cached) with its images (read each time: a cache of tokenized
        prompts holding their images would hold an image dataset in memory); :class:`BadRowError`
        when the row cannot become a prompt."""
        prompt = self._tokenized(index)
        value = self.rows[index].get(self.cfg.images_key) if self.cfg.images_key else None
        if value is None:
            return prompt
        where = self._where(index)
        try:
            images = read_images(value, Path(self.cfg.path).parent, where)
        except BadRowError:
            raise
        except (OSError, ValueError) as e:  # an unreadable file
            raise BadRowError(f"{where}: {describe(e)}") from e
        return dataclasses.replace(prompt, images=images)

    def _where(self, index: int) -> str:
        return f"dataset {self.cfg.path} row {index}"

    def _tokenize(self, index: int) -> Prompt:
        """Row ``index`` tokenized, without its images (use :meth:`encode`)."""
        where = self._where(index)
        try:
            return self._tokenize_row(index, where)
        except BadRowError:
            raise
        except Exception as e:
            raise BadRowError(f"{where}: {describe(e)}") from e

    def _tokenize_row(self, index: int, where: str) -> Prompt:
        row = self.rows[index]
        if not isinstance(row, dict):
            raise BadRowError(f"{where}: a row must be a mapping, got {type(row).__name__}")
        if self.cfg.prompt_key not in row:
            raise BadRowError(f"{where}: no key {self.cfg.prompt_key!r} (keys: {sorted(row)})")
        raw = row[self.cfg.prompt_key]
        value = row.get(self.cfg.images_key) if self.cfg.images_key else None
        num_images = 0 if value is None else len(value) if isinstance(value, list) else 1
        templated = isinstance(raw, list) or self.cfg.apply_chat_template or num_images > 0
        if templated:
            messages = raw if isinstance(raw, list) else [{"role": "user", "content": str(raw)}]
            if num_images:
                try:
                    messages = with_image_parts(messages, num_images)
                except ValueError as e:
                    raise BadRowError(f"{where}: {e}") from e
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            assert isinstance(text, str), "tokenize=False renders the conversation as text"
        else:
            text = str(raw)
        ids = self.tokenizer(text, add_special_tokens=not templated)["input_ids"]
        label = row.get(self.cfg.label_key) if self.cfg.label_key else None
        meta = {k: v for k, v in row.items() if k not in (self.cfg.prompt_key, self.cfg.label_key, self.cfg.images_key)}
        return Prompt(index=index, text=text, ids=list(ids), label=None if label is None else str(label), metadata=meta)


def describe(error: BaseException) -> str:
    """``Type: first line of the message`` (a chat template's error can run over many lines)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:400]
