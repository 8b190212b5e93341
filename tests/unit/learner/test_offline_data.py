"""Dataset reading and tokenization: formats, chat templates, prompt / non-assistant masking, pairs."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from transformers import AutoTokenizer

from streamrl.learner.logprobs import IGNORE_INDEX
from streamrl.learner.offline.config import DataConfig
from streamrl.learner.offline.data import build_pairs, build_sft_samples, load_records, train_eval_records


@pytest.fixture(scope="module")
def tok(tiny_qwen_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_qwen_dir)


def _trained_text(tok: Any, ids: list[int], labels: list[int]) -> str:
    return tok.decode([t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE_INDEX])


def test_formats_give_the_same_records(kit: SimpleNamespace, tmp_path: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{"prompt": "p1", "response": "r1"}, {"prompt": "p2", "response": "r2"}]
    kit.write_jsonl(tmp_path / "d.jsonl", records)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "d.parquet")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records)}).save_to_disk(str(tmp_path / "folder"))
    assert load_records(tmp_path / "d.jsonl") == records
    assert load_records(tmp_path / "d.parquet") == records
    assert load_records(tmp_path / "folder", "train") == records
    with pytest.raises(ValueError, match="splits"):
        load_records(tmp_path / "folder", "validation")
    with pytest.raises(ValueError, match="unsupported"):
        load_records(kit.write_jsonl(tmp_path / "d.csv", records))


def test_eval_fraction_holds_out_disjoint_records(kit: SimpleNamespace, tmp_path: Path) -> None:
    records = [{"prompt": str(i), "response": "x"} for i in range(20)]
    cfg = DataConfig(train_path=str(kit.write_jsonl(tmp_path / "d.jsonl", records)), eval_fraction=0.25)
    train, held = train_eval_records(cfg, seed=1)
    assert len(held) == 5 and len(train) == 15
    assert {r["prompt"] for r in train}.isdisjoint(r["prompt"] for r in held)
    assert train_eval_records(cfg, seed=1) == (train, held)


def test_chat_prompt_is_masked_and_response_trained(tok: Any, tmp_path: Path) -> None:
    cfg = DataConfig(train_path="unused")
    [sample] = build_sft_samples([{"prompt": "hi", "response": "yo"}], tok, cfg)
    assert tok.decode(sample.input_ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    assert _trained_text(tok, sample.input_ids, sample.labels) == "yo<|im_end|>\n"


def test_plain_text_appends_eos(tok: Any) -> None:
    cfg = DataConfig(train_path="unused", apply_chat_template=False)
    [sample] = build_sft_samples([{"prompt": "Q:", "response": "A"}], tok, cfg)
    assert tok.decode(sample.input_ids) == "Q:A<|im_end|>"
    assert _trained_text(tok, sample.input_ids, sample.labels) == "A<|im_end|>"


def test_multi_turn_trains_assistant_turns_only(tok: Any) -> None:
    chat = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "a2"},
    ]
    cfg = DataConfig(train_path="unused", messages_key="messages")
    [sample] = build_sft_samples([{"messages": chat}], tok, cfg)
    assert tok.decode(sample.input_ids) == tok.apply_chat_template(chat, tokenize=False)
    assert _trained_text(tok, sample.input_ids, sample.labels) == "a1<|im_end|>\na2<|im_end|>\n"


def test_truncation_drops_samples_without_response(tok: Any) -> None:
    cfg = DataConfig(train_path="unused", max_len=12, apply_chat_template=False)
    records = [{"prompt": "a very long prompt", "response": "r"}, {"prompt": "", "response": "r"}]
    samples = build_sft_samples(records, tok, cfg)
    assert len(samples) == 1 and len(samples[0].input_ids) <= 12


def test_pairs_from_prompt_keys_and_from_conversations(tok: Any) -> None:
    cfg = DataConfig(train_path="unused", margin_key="m")
    a = {"prompt": "q", "chosen": "good", "rejected": "bad", "m": 2}
    conv = {
        "chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "good"}],
        "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "bad"}],
        "m": 2,
    }
    same = {"prompt": "q", "chosen": "same", "rejected": "same", "m": 0}
    pairs = build_pairs([a, conv, same], tok, cfg)
    assert len(pairs) == 2  # the identical pair is dropped
    assert pairs[0] == pairs[1]
    assert pairs[0].margin == 2.0
    assert _trained_text(tok, pairs[0].chosen.input_ids, pairs[0].chosen.labels) == "good<|im_end|>\n"
    assert _trained_text(tok, pairs[0].rejected.input_ids, pairs[0].rejected.labels) == "bad<|im_end|>\n"
    with pytest.raises(ValueError, match="no key 'chosen'"):
        build_pairs([{"prompt": "q", "rejected": "x"}], tok, cfg)
