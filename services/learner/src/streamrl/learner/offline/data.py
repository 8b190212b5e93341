"""Offline datasets: read records (JSONL / JSON / Parquet / ``datasets`` folders) and tokenize them.

* SFT samples come from prompt/response records or whole chats; labels are IGNORE_INDEX on
  everything but response (assistant) tokens.
* Preference pairs (RM, DPO) come from prompt + chosen/rejected records, or from two full
  conversations sharing everything but the last assistant message.

With a chat template, the prompt is rendered with ``add_generation_prompt=True`` and the
response is the text the full conversation adds after it; the two pieces are tokenized
separately, so the prompt tokens are exactly those an inference engine sees for the prompt.
Multi-turn chats are cut the same way at every assistant turn; a template whose rendering of a
conversation does not start with its rendering of the earlier turns is rejected with an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from streamrl.learner.logprobs import IGNORE_INDEX
from streamrl.learner.offline.config import DataConfig
from streamrl.learner.packing import Sample

Record = dict[str, Any]
Message = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Pair:
    """A tokenized preference pair; both samples carry the prompt, with labels only on the response."""

    chosen: Sample
    rejected: Sample
    margin: float = 0.0


def load_records(path: str | Path, split: str = "train") -> list[Record]:
    """Read every record of a JSONL / JSON / Parquet file or a ``datasets.save_to_disk`` folder."""
    path = Path(path)
    if path.is_dir():
        import datasets

        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ValueError(f"{path} has splits {sorted(loaded)}, not {split!r}")
            loaded = loaded[split]
        return list(loaded.to_list())
    if not path.is_file():
        raise ValueError(f"dataset not found: {path}")
    if path.suffix == ".jsonl":
        with path.open() as f:
            return [json.loads(line) for line in f if line.strip()]
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        if not isinstance(data, list):
            raise ValueError(f"{path}: a .json dataset must hold a list of records")
        return data
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return list(pq.read_table(path).to_pylist())
    raise ValueError(f"{path}: unsupported dataset format {path.suffix!r} (use .jsonl, .json, .parquet or a folder)")


def train_eval_records(cfg: DataConfig, seed: int) -> tuple[list[Record], list[Record]]:
    """Training and evaluation records per ``cfg`` (a seeded random hold-out when there is no eval file)."""
    train = load_records(cfg.train_path, cfg.train_split)
    if cfg.max_samples is not None:
        train = train[: cfg.max_samples]
    if cfg.eval_path is not None:
        return train, load_records(cfg.eval_path, cfg.eval_split)
    if cfg.eval_fraction == 0:
        return train, []
    order = np.random.default_rng(seed).permutation(len(train))
    n_eval = max(1, round(cfg.eval_fraction * len(train)))
    held = set(order[:n_eval].tolist())
    return [r for i, r in enumerate(train) if i not in held], [train[i] for i in sorted(held)]


def _field(record: Record, key: str, index: int) -> Any:
    if key not in record:
        raise ValueError(f"record {index} has no key {key!r} (keys: {sorted(record)})")
    return record[key]


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _render(tokenizer: Any, messages: list[Message], generation_prompt: bool) -> str:
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt))


def _check_chat_template(tokenizer: Any) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; set data.apply_chat_template=false for plain text")


class Tokenization:
    """Turns prompts, responses and chats into token ids with response-only labels."""

    def __init__(self, tokenizer: Any, chat: bool) -> None:
        if chat:
            _check_chat_template(tokenizer)
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token")
        self.tokenizer = tokenizer
        self.chat = chat

    def prompt_response(self, prompt: str | list[Message], response: str | Message) -> tuple[list[int], list[int]]:
        """Token ids of the prompt and of the response that follows it."""
        if self.chat:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            reply = {"role": "assistant", "content": response} if isinstance(response, str) else response
            prompt_text = _render(self.tokenizer, messages, generation_prompt=True)
            full_text = _render(self.tokenizer, [*messages, reply], generation_prompt=False)
            if not full_text.startswith(prompt_text):
                raise ValueError("the chat template renders the conversation without its generation prompt as prefix")
            return _encode(self.tokenizer, prompt_text), _encode(self.tokenizer, full_text[len(prompt_text) :])
        if not isinstance(prompt, str) or not isinstance(response, str):
            raise ValueError("chat messages need data.apply_chat_template=true")
        prompt_ids = list(self.tokenizer(prompt)["input_ids"])  # with the tokenizer's own special tokens (BOS)
        return prompt_ids, [*_encode(self.tokenizer, response), self.tokenizer.eos_token_id]

    def chat_sample(self, messages: list[Message]) -> Sample:
        """A whole chat with labels on assistant turns only."""
        _check_chat_template(self.tokenizer)
        ids: list[int] = []
        labels: list[int] = []
        done = ""
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before = _render(self.tokenizer, messages[:i], generation_prompt=True)
            through = _render(self.tokenizer, messages[: i + 1], generation_prompt=False)
            if not (before.startswith(done) and through.startswith(before)):
                raise ValueError(
                    f"the chat template is not prefix-stable at message {i}: rendering the earlier turns does not "
                    "give a prefix of the rendering with this turn (per-turn loss masking needs that)"
                )
            context = _encode(self.tokenizer, before[len(done) :])
            answer = _encode(self.tokenizer, through[len(before) :])
            ids += context + answer
            labels += [IGNORE_INDEX] * len(context) + answer
            done = through
        rest = _render(self.tokenizer, messages, generation_prompt=False)[len(done) :]
        tail = _encode(self.tokenizer, rest)
        return Sample(ids + tail, labels + [IGNORE_INDEX] * len(tail))


def _join(prompt: list[int], response: list[int], max_len: int) -> Sample | None:
    """prompt + response with labels on the response, cut at ``max_len``; None if no response token is left."""
    ids = (prompt + response)[:max_len]
    labels = ([IGNORE_INDEX] * len(prompt) + response)[:max_len]
    return Sample(ids, labels) if any(t != IGNORE_INDEX for t in labels) else None


def _truncate(sample: Sample, max_len: int) -> Sample | None:
    labels = sample.labels[:max_len]
    return Sample(sample.input_ids[:max_len], labels) if any(t != IGNORE_INDEX for t in labels) else None


def build_sft_samples(records: list[Record], tokenizer: Any, cfg: DataConfig) -> list[Sample]:
    """SFT samples in record order; records with no response token left after truncation are dropped."""
    tok = Tokenization(tokenizer, cfg.apply_chat_template or cfg.messages_key is not None)
    samples = []
    for i, record in enumerate(records):
        if cfg.messages_key is not None:
            sample = _truncate(tok.chat_sample(_field(record, cfg.messages_key, i)), cfg.max_len)
        else:
            prompt_ids, response_ids = tok.prompt_response(
                _field(record, cfg.prompt_key, i), _field(record, cfg.response_key, i)
            )
            sample = _join(prompt_ids, response_ids, cfg.max_len)
        if sample is not None:
            samples.append(sample)
    if not samples:
        raise ValueError("no SFT sample has a response token within data.max_len")
    return samples


def _split_conversation(messages: list[Message], index: int) -> tuple[list[Message], Message]:
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError(f"record {index}: a conversation must end with an assistant message")
    return list(messages[:-1]), messages[-1]


def build_pairs(records: list[Record], tokenizer: Any, cfg: DataConfig) -> list[Pair]:
    """Preference pairs in record order; identical pairs and pairs truncated to nothing are dropped."""
    tok = Tokenization(tokenizer, cfg.apply_chat_template)
    pairs = []
    for i, record in enumerate(records):
        chosen = _field(record, cfg.chosen_key, i)
        rejected = _field(record, cfg.rejected_key, i)
        if cfg.prompt_key in record:
            prompt_c = prompt_r = record[cfg.prompt_key]
        elif isinstance(chosen, list) and isinstance(rejected, list):
            prompt_c, chosen = _split_conversation(chosen, i)
            prompt_r, rejected = _split_conversation(rejected, i)
            if prompt_c != prompt_r:
                raise ValueError(f"record {i}: chosen and rejected conversations differ before the last message")
        else:
            raise ValueError(f"record {i} has no key {cfg.prompt_key!r} and its responses are not conversations")
        p_ids, c_ids = tok.prompt_response(prompt_c, chosen)
        _, r_ids = tok.prompt_response(prompt_r, rejected)
        if c_ids == r_ids:
            continue
        c = _join(p_ids, c_ids, cfg.max_len)
        r = _join(p_ids, r_ids, cfg.max_len)
        if c is None or r is None or c.input_ids == r.input_ids:
            continue
        margin = float(_field(record, cfg.margin_key, i)) if cfg.margin_key else 0.0
        pairs.append(Pair(c, r, margin))
    if not pairs:
        raise ValueError("no usable preference pair (all identical or truncated away)")
    return pairs
