"""The arithmetic demo task: deterministic generation, disjoint splits, the reward's parsing, the tokenizer."""

from __future__ import annotations

import operator
import random
import re
from pathlib import Path

import model as model_lib
import pytest
import task as task_lib


def test_splits_are_deterministic_and_seeded() -> None:
    spec = task_lib.TaskSpec(operators="+-", digits=2, num_eval=100, seed=3)
    assert task_lib.make_splits(spec) == task_lib.make_splits(spec)
    other = task_lib.make_splits(task_lib.TaskSpec(operators="+-", digits=2, num_eval=100, seed=4))
    assert other[1] != task_lib.make_splits(spec)[1]


@pytest.mark.parametrize(
    "spec",
    [
        task_lib.TaskSpec(operators="+", digits=2, num_eval=500),  # enumerated: every problem is used
        task_lib.TaskSpec(operators="+*", digits=1, num_eval=20, num_train=150),
        task_lib.TaskSpec(operators="+", digits=16, num_eval=50, num_train=400, scratchpad=True),  # sampled
    ],
)
def test_train_and_held_out_prompts_do_not_overlap(spec: task_lib.TaskSpec) -> None:
    train, held_out = task_lib.make_splits(spec)
    train_prompts, held_prompts = (
        {p.prompt for p in train},
        {p.prompt for p in held_out},
    )
    assert len(held_prompts) == len(held_out) == spec.num_eval
    assert len(train_prompts) == len(train)
    assert not train_prompts & held_prompts
    if spec.num_train is None:
        assert len(train) + len(held_out) == len(spec.operators) * 10 ** (2 * spec.digits)
    else:
        assert len(train) == spec.num_train


def test_labels_are_the_exact_results() -> None:
    train, _ = task_lib.make_splits(task_lib.TaskSpec(operators="+-*", digits=2, num_eval=10, num_train=300))
    for p in train:
        match = re.fullmatch(r"(\d+)([-+*])(\d+)=", p.prompt)
        assert match is not None
        a, op, b = match.groups()
        assert int(p.label) == {
            "+": operator.add,
            "-": operator.sub,
            "*": operator.mul,
        }[op](int(a), int(b))
        assert p.response == p.label


def test_scratchpad_trace_carries_and_is_long() -> None:
    rng = random.Random(0)
    for _ in range(200):
        a, b = rng.randrange(10**16), rng.randrange(10**16)
        problem = task_lib.make_problem(a, "+", b, scratchpad=True)
        trace, _, answer = problem.response.partition(task_lib.ANSWER_MARK)
        assert int(answer) == a + b
        total, carry = 0, 0
        for i, step in enumerate(s for s in trace.split(",") if s):
            x, y, c, column = (int(v) for v in step.replace("=", "+").split("+"))
            assert c == carry and x + y + c == column
            total += (column % 10) * 10**i
            carry = column // 10
        assert total + carry * 10 ** (i + 1) == a + b
        # Workload b's claim: >= 128 generated tokens (one per character, plus EOS).
        assert len(problem.response) + 1 >= 128
    assert task_lib.make_problem(47, "+", 85, scratchpad=True).response == "7+5+0=12,4+8+1=13,#132"


@pytest.mark.parametrize(
    ("query", "prompt", "label", "reward"),
    [
        ("12+3=15", "12+3=", "15", 1.0),
        (
            "12+3=15</s><pad><pad>",
            "12+3=",
            "15",
            1.0,
        ),  # EOS and padding decoded as text
        ("<s>12+3=15</s>", "12+3=", "15", 1.0),  # a BOS in front of the prompt
        ("12+3= 15 ", "12+3=", "15", 1.0),
        ("12+3=015", "12+3=", "15", 1.0),  # same integer
        ("12+3=15</s>99", "12+3=", "15", 1.0),  # whatever follows EOS is ignored
        ("12+3=16", "12+3=", "15", 0.0),
        ("12+3=1", "12+3=", "15", 0.0),
        ("12+3=151515", "12+3=", "15", 0.0),  # never stopped
        ("12+3=15+1", "12+3=", "15", 0.0),
        ("12+3=", "12+3=", "15", 0.0),
        ("1-5=-4", "1-5=", "-4", 1.0),
        ("1-5=4", "1-5=", "-4", 0.0),
        ("47+85=7+5+0=12,4+8+1=13,#132</s>", "47+85=", "132", 1.0),
        (
            "47+85=7+5+0=12,#132",
            "47+85=",
            "132",
            1.0,
        ),  # trace arithmetic is not checked, only its shape
        ("47+85=x#132", "47+85=", "132", 0.0),  # malformed trace
        ("47+85=#13#2", "47+85=", "132", 0.0),
        (
            "4+4=8",
            "12+3=",
            "8",
            1.0,
        ),  # prompt not found in the query: answer after the first "="
    ],
)
def test_reward_parsing(query: str, prompt: str, label: str, reward: float) -> None:
    out = task_lib.reward_func([query], [prompt], [label])
    assert out["rewards"] == [reward]
    assert out["scores"] == [reward]


def test_reward_logs_accuracy_and_well_formed_rate() -> None:
    out = task_lib.reward_func(["1+1=2", "1+1=3", "1+1=x"], ["1+1="] * 3, ["2"] * 3)
    assert out["rewards"] == [1.0, 0.0, 0.0]
    assert out["extra_logs"] == {
        "arithmetic/accuracy": 1 / 3,
        "arithmetic/well_formed": 2 / 3,
    }
    with pytest.raises(ValueError, match="differ in length"):
        task_lib.reward_func(["1+1=2"], ["1+1="], [])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"operators": "/"},
        {"operators": "++"},
        {"digits": 0},
        {"num_eval": 0},
        {"scratchpad": True, "operators": "+-"},
    ],
)
def test_bad_specs_are_rejected(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        task_lib.TaskSpec(**kwargs)  # type: ignore[arg-type]


def test_more_problems_than_exist_is_rejected() -> None:
    with pytest.raises(ValueError, match="distinct ones exist"):
        task_lib.TaskSpec(digits=1, num_eval=90, num_train=20)


def test_jsonl_round_trip(tmp_path: Path) -> None:
    train, _ = task_lib.make_splits(task_lib.TaskSpec(num_eval=5, num_train=7))
    task_lib.write_jsonl(tmp_path / "train.jsonl", train)
    rows = task_lib.read_jsonl(tmp_path / "train.jsonl")
    assert rows == [{"prompt": p.prompt, "label": p.label, "response": p.response} for p in train]


def test_saved_tokenizer_reloads_as_one_token_per_character(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = model_lib.build_tokenizer()
    model_lib.save(
        model_lib.build_model(model_lib.PRESETS["small"], tokenizer),
        tokenizer,
        tmp_path,
    )
    loaded = AutoTokenizer.from_pretrained(tmp_path)  # the loading path transformers, TRL and vLLM take
    text = "47+85=7+5+0=12,4+8+1=13,#132"
    ids = loaded(text)["input_ids"]
    assert ids == tokenizer(text)["input_ids"]
    assert len(ids) == len(text)  # nothing added, nothing merged
    assert loaded.decode([*ids, loaded.eos_token_id]) == text + "</s>"
    assert (loaded.pad_token_id, loaded.padding_side) == (0, "left")
