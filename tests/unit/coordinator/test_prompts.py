"""Prompt datasets: JSONL, Parquet and Hugging Face folders, configurable keys, chat templates, cursor."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from streamrl.common.errors import ConfigError
from streamrl.coordinator.config import DatasetConfig
from streamrl.coordinator.prompts import PromptSource

sys.path.insert(0, str(Path(__file__).parents[3] / "examples" / "arithmetic"))
import model as model_lib

ROWS = [{"question": f"{i}+1=", "answer": str(i + 1), "source": "synthetic"} for i in range(10)]
TEMPLATE = "{% for m in messages %}<s>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}#{% endif %}"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tok")
    tok = model_lib.build_tokenizer()
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return str(path)


def write_dataset(tmp_path: Path, kind: str) -> str:
    if kind == "jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in ROWS))
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "d.parquet"
        pq.write_table(pa.Table.from_pylist(ROWS), path)
    else:
        import datasets

        path = tmp_path / "hf"
        datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(path))
    return str(path)


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "hf"])
def test_formats_keys_and_tokenization(tmp_path: Path, tokenizer_dir: str, kind: str) -> None:
    cfg = DatasetConfig(
        path=write_dataset(tmp_path, kind),
        prompt_key="question",
        label_key="answer",
        tokenizer=tokenizer_dir,
        shuffle=False,
    )
    source = PromptSource(cfg)
    p = source.get(3)
    assert (p.text, p.label, p.metadata) == ("3+1=", "4", {"source": "synthetic"})
    assert source.tokenizer.decode(p.ids) == "3+1="


def test_chat_template_and_cursor_epochs(tmp_path: Path, tokenizer_dir: str) -> None:
    cfg = DatasetConfig(
        path=write_dataset(tmp_path, "jsonl"),
        prompt_key="question",
        label_key="answer",
        tokenizer=tokenizer_dir,
        apply_chat_template=True,
        seed=3,
    )
    source = PromptSource(cfg)
    first_epoch = [source.get(i).label for i in range(10)]
    assert sorted(first_epoch, key=int) == [str(i + 1) for i in range(10)]  # a permutation
    assert [source.get(10 + i).label for i in range(10)] != first_epoch  # reshuffled next epoch
    assert source.get(4).label == PromptSource(cfg).get(4).label  # a restarted coordinator agrees
    assert source.get(0).text.startswith("<s>") and source.get(0).text.endswith("=#")
    # a row is tokenized once, whichever epoch (or evaluation round) asks for it again
    assert source.encode(3) is source.get(next(i for i in range(10, 20) if source.get(i).index == 3))


def test_missing_key_names_it(tmp_path: Path, tokenizer_dir: str) -> None:
    cfg = DatasetConfig(path=write_dataset(tmp_path, "jsonl"), prompt_key="prompt", tokenizer=tokenizer_dir)
    with pytest.raises(ConfigError, match="no key 'prompt'"):
        PromptSource(cfg)
