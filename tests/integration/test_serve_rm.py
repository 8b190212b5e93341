"""Local reward models: in-process scoring equals a direct forward; ``streamrl serve-rm`` over HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from streamrl.common.messages import Tensor, Trajectory
from streamrl.reward.config import HttpScorerConfig, ModelScorerConfig
from streamrl.reward.scorers.http import HttpScorer
from streamrl.reward.scorers.model import LocalRewardModel, ModelScorer, reward_to_score

TOKEN = "rm-secret"
WORDS = [
    "the",
    "answer",
    "is",
    "yes",
    "no",
    "maybe",
    "one",
    "two",
    "three",
    "four",
    "five",
    "plus",
    "minus",
    "equals",
    "what",
    "sum",
]
TEXTS = [
    "the answer is yes",
    "one plus two equals three",
    "no",
    "what is the sum of four and five " * 3,
    "maybe",
]


def build_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer trained on a few sentences, saved with transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([" ".join(WORDS)] * 4 + TEXTS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(str(path))


def tiny_qwen2_config(**extra: object) -> object:
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        pad_token_id=0,
        **extra,
    )


@pytest.fixture(scope="module")
def seq_cls_rm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen2ForSequenceClassification (num_labels=1) with mean/std in its config."""
    from transformers import Qwen2ForSequenceClassification

    path = tmp_path_factory.mktemp("rm_seqcls")
    build_tokenizer(path)
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(tiny_qwen2_config(num_labels=1, mean=0.25, std=2.0))
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)  # rewards of order 1, not ~0
    model.save_pretrained(str(path))
    return path


def direct_rewards(path: Path, texts: list[str]) -> list[float]:
    """One unpadded forward per text with the plain transformers classes, then (r - mean) / std."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    out = []
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([tokenizer(text)["input_ids"]])
            out.append((float(model(input_ids=ids).logits[0, 0]) - 0.25) / 2.0)
    return out


def test_sequence_classifier_batched_equals_direct_forward(seq_cls_rm: Path) -> None:
    model = LocalRewardModel(str(seq_cls_rm), batch_size=3)
    assert model.score_texts(TEXTS) == pytest.approx(direct_rewards(seq_cls_rm, TEXTS), abs=1e-5)


def test_value_head_model_and_token_id_input(tmp_path: Path) -> None:
    """A causal LM checkpoint plus ``value_head.weight``: reward = head(hidden state of the last token)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModel, Qwen2ForCausalLM

    torch.manual_seed(1)
    Qwen2ForCausalLM(tiny_qwen2_config()).save_pretrained(str(tmp_path))
    weights = load_file(str(tmp_path / "model.safetensors"))
    head = torch.randn(1, 64)
    save_file(
        {**weights, "value_head.weight": head},
        str(tmp_path / "model.safetensors"),
        metadata={"format": "pt"},
    )
    sequences = [[3, 4, 5, 6], [7], [8, 9, 10, 11, 12, 13]]

    body = AutoModel.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        expected = [float(body(input_ids=torch.tensor([s])).last_hidden_state[0, -1] @ head[0]) for s in sequences]

    config = ModelScorerConfig(name="vh", path=str(tmp_path), input="token_ids", batch_size=2)
    scorer = ModelScorer(config)
    batch = [
        Trajectory(
            id=f"t{i}",
            group_id="g",
            group_index=i,
            group_size=3,
            prompt_ids=Tensor.from_list(s[:1], "int32"),
            response_ids=Tensor.from_list(s[1:], "int32"),
            logprobs=Tensor.from_list([0.0] * (len(s) - 1), "float32"),
            loss_mask=Tensor.from_list([1] * (len(s) - 1), "uint8"),
        )
        for i, s in enumerate(sequences)
    ]
    result = asyncio.run(scorer.score(batch))
    assert result.rewards == pytest.approx(expected, abs=1e-5)
    assert result.scores == pytest.approx([reward_to_score(r) for r in expected], abs=1e-6)


@pytest.fixture(scope="module")
def serve_rm_url(seq_cls_rm: Path) -> Iterator[str]:
    env = {
        **os.environ,
        "STREAMRL_RM_TOKEN": TOKEN,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "streamrl.reward.serve_rm",
        f"--model_path={seq_cls_rm}",
        "--port=0",
        "--max_wait_ms=20",
        "--batch_size=4",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    try:
        assert "listening on http://" in line, f"serve-rm did not start: {line!r}"
        yield line.strip().rsplit(" ", 1)[-1]
    finally:
        proc.terminate()  # SIGTERM: graceful shutdown
        assert proc.wait(timeout=20) == 0
        proc.stdout.close()


def post(url: str, body: object, token: str | None) -> tuple[int, dict[str, object]]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.loads(e.read())


def test_serve_rm_scores_equal_direct_forward(serve_rm_url: str, seq_cls_rm: Path) -> None:
    status, body = post(
        f"{serve_rm_url}/get_reward",
        {"query": TEXTS, "prompts": [""] * 5, "labels": [""] * 5},
        TOKEN,
    )
    assert status == 200
    expected = direct_rewards(seq_cls_rm, TEXTS)
    assert body["rewards"] == pytest.approx(expected, abs=1e-5)
    assert body["scores"] == pytest.approx([reward_to_score(r) for r in expected], abs=1e-6)


def test_serve_rm_needs_the_token(serve_rm_url: str) -> None:
    assert post(f"{serve_rm_url}/get_reward", {"query": ["yes"]}, None)[0] == 401
    assert post(f"{serve_rm_url}/get_reward", {"query": ["yes"]}, "wrong")[0] == 401
    request = urllib.request.Request(f"{serve_rm_url}/health")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    assert info.value.code == 401
    info.value.close()
    request.add_header("Authorization", f"Bearer {TOKEN}")
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert json.loads(resp.read())["status"] == "ok"


def test_serve_rm_rejects_bad_requests(serve_rm_url: str) -> None:
    status, body = post(f"{serve_rm_url}/get_reward", {"prompts": ["x"]}, TOKEN)
    assert status == 400 and "'query' must be a list of strings" in str(body["error"])
    status, body = post(f"{serve_rm_url}/get_reward", {"query": ["yes", ""]}, TOKEN)
    assert status == 400 and "empty" in str(body["error"])


def test_http_scorer_against_serve_rm(serve_rm_url: str, seq_cls_rm: Path) -> None:
    """The two halves of the protocol fit: our client, our server, concurrent batched requests."""
    config = HttpScorerConfig(name="rm", urls=[f"{serve_rm_url}/get_reward"], batch_size=2, token_env="RM")
    scorer = HttpScorer(config, env={"RM": TOKEN})
    batch = [
        Trajectory(
            id=f"t{i}",
            group_id="g",
            group_index=i,
            group_size=5,
            prompt_ids=Tensor.from_list([1], "int32"),
            response_ids=Tensor.from_list([2], "int32"),
            logprobs=Tensor.from_list([0.0], "float32"),
            loss_mask=Tensor.from_list([1], "uint8"),
            prompt_text="",
            response_text=text,
        )
        for i, text in enumerate(TEXTS)
    ]

    async def main() -> list[float]:
        try:
            return (await scorer.score(batch)).rewards
        finally:
            await scorer.close()

    assert asyncio.run(main()) == pytest.approx(direct_rewards(seq_cls_rm, TEXTS), abs=1e-5)
    assert scorer.metrics()["reward/http/requests"] == 3
