"""The multi-turn demo's plain files: the reward on whole episodes, and warm-start episodes that are
exactly what the calculator environment answers (so the warm start teaches the RL episode format)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from streamrl.rollout.environments.calculator import CalculatorEnvironment

ROOT = Path(__file__).resolve().parents[2]


def _load(path: Path, name: str):  # type: ignore[no-untyped-def]
    """A plain example file under a name of its own (two examples have a prepare.py)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


prepare = _load(ROOT / "examples" / "multiturn" / "prepare.py", "multiturn_prepare")
calc_task, model_lib = prepare.calc_task, prepare.model_lib


def test_the_reward_reads_the_answer_that_ends_the_episode() -> None:
    call = "<calc>47*85</calc><result>3995</result>"
    queries = [
        f"47*85={call}Answer: 3995</s>",
        "47*85=Answer: 3995",
        "47*85=Answer: 12",
        f"47*85={call}Answer: 3995x",
        f"<s>47*85={call}",
        "47*85=<calc>Answer: 3995",
    ]
    out = calc_task.reward_func(queries, ["47*85="] * 6, ["3995"] * 6)
    assert out["rewards"] == out["scores"] == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert out["extra_logs"] == pytest.approx(
        {"multiturn/accuracy": 3 / 6, "multiturn/well_formed": 4 / 6, "multiturn/tool_use": 3 / 6}
    )
    with pytest.raises(ValueError, match="differ in length"):
        calc_task.reward_func(queries, ["47*85="], ["3995"])


@pytest.mark.parametrize(("prompt", "label"), [("47*85=", "3995"), ("3-91=", "-88"), ("0+7=", "7")])
def test_the_warm_start_episode_is_the_one_the_environment_plays(prompt: str, label: str) -> None:
    (_, call), (_, result), (_, answer) = calc_task.tool_episode(prompt, label)
    env = CalculatorEnvironment()
    step = env.step(call)
    assert step.observation == result and not step.done
    assert env.step(answer).done
    assert calc_task.reward_func([prompt + call + result + answer], [prompt], [label])["rewards"] == [1.0]


def test_warm_start_batches_train_the_model_turns_and_their_end_only() -> None:
    tokenizer = model_lib.build_tokenizer(calc_task.CHARS)
    ids, attention, mask = prepare.encode(tokenizer, ["3*4="], [calc_task.tool_episode("3*4=", "12")])
    text = tokenizer.decode(ids[0].tolist())
    assert text == "3*4=<calc>3*4</calc></s><result>12</result>Answer: 12</s>"
    trained = tokenizer.decode([i for i, m in zip(ids[0].tolist(), mask[0].tolist(), strict=True) if m])
    assert trained == "<calc>3*4</calc></s>Answer: 12</s>"
    assert attention.sum() == len(ids[0])
    # every character of an episode is in the vocabulary (an unknown one would become <pad>)
    assert tokenizer.pad_token_id not in ids[0].tolist()
