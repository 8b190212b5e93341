"""Loading and calling user reward functions: file and module paths, sync/async, tensors, errors."""

from __future__ import annotations

import asyncio
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from streamrl.common.messages import Trajectory
from streamrl.reward.config import FunctionScorerConfig
from streamrl.reward.scorers.base import ScorerError
from streamrl.reward.scorers.function import FunctionScorer, load_reward_function

EXACT_MATCH = """
def reward_func(queries, prompts, labels, **kwargs):
    rewards = [1.0 if q[len(p):].strip() == l else 0.0 for q, p, l in zip(queries, prompts, labels)]
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"length": [len(q) for q in queries]}}
"""


def _write(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def _scorer(path: str, **kw: object) -> FunctionScorer:
    return FunctionScorer(FunctionScorerConfig(name="fn", path=path, **kw))  # type: ignore[arg-type]


def test_file_path_default_name(tmp_path: Path, traj: Callable[..., Trajectory]) -> None:
    path = _write(tmp_path, "rewards.py", EXACT_MATCH)
    batch = [traj(0, response="42", label="42"), traj(1, response="41", label="42")]
    result = asyncio.run(_scorer(str(path)).score(batch))
    assert result.rewards == [1.0, 0.0]
    assert result.scores == [1.0, 0.0]
    assert result.extra == [
        {"length": float(len("Q: 42"))},
        {"length": float(len("Q: 41"))},
    ]


def test_module_path_with_function_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, traj: Callable[..., Trajectory]
) -> None:
    pkg = tmp_path / "myrewards_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    _write(
        pkg,
        "length.py",
        "def by_length(queries, prompts, labels):\n    return {'rewards': [len(q) for q in queries]}\n",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    result = asyncio.run(_scorer("myrewards_pkg.length:by_length").score([traj(0, response="abc")]))
    assert result.rewards == [len("Q: abc")]
    assert result.scores == result.rewards  # scores default to the rewards
    assert result.extra == [{}]


def test_file_path_with_function_name(tmp_path: Path, traj: Callable[..., Trajectory]) -> None:
    path = _write(
        tmp_path,
        "two.py",
        EXACT_MATCH + "\ndef other(queries, prompts, labels):\n    return {'rewards': [7] * len(queries)}\n",
    )
    assert asyncio.run(_scorer(f"{path}:other").score([traj(0)])).rewards == [7.0]


def test_async_function_and_metadata(tmp_path: Path, traj: Callable[..., Trajectory]) -> None:
    path = _write(
        tmp_path,
        "async_rewards.py",
        """
        import asyncio

        async def reward_func(queries, prompts, labels, metadata):
            await asyncio.sleep(0)
            return {"rewards": [m["idx"] * 10 for m in metadata], "extra_logs": {"batch": 3}}
        """,
    )
    result = asyncio.run(_scorer(str(path)).score([traj(1), traj(2)]))
    assert result.rewards == [10.0, 20.0]
    assert result.extra == [
        {"batch": 3.0},
        {"batch": 3.0},
    ]  # a batch-level value is copied to each sample


def test_sync_function_runs_off_the_event_loop(tmp_path: Path, traj: Callable[..., Trajectory]) -> None:
    path = _write(
        tmp_path,
        "thread_rewards.py",
        """
        import threading

        def reward_func(queries, prompts, labels):
            return {"rewards": [float(threading.current_thread() is threading.main_thread())] * len(queries)}
        """,
    )
    assert asyncio.run(_scorer(str(path)).score([traj(0)])).rewards == [0.0]


def test_tensors_are_converted(tmp_path: Path, traj: Callable[..., Trajectory]) -> None:
    path = _write(
        tmp_path,
        "tensor_rewards.py",
        """
        import numpy as np
        import torch

        def reward_func(queries, prompts, labels):
            r = torch.tensor([0.5, -1.0], requires_grad=True) * 2
            return {"rewards": r, "scores": torch.tensor([[1.0], [0.0]]), "extra_logs": {"n": np.array([3, 4])}}
        """,
    )
    result = asyncio.run(_scorer(str(path)).score([traj(0), traj(1)]))
    assert result.rewards == [1.0, -2.0]
    assert result.scores == [1.0, 0.0]
    assert result.extra == [{"n": 3.0}, {"n": 4.0}]
    assert all(type(v) is float for v in result.rewards + result.scores)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"reward function file not found: .*nope\.py"):
        load_reward_function(str(tmp_path / "nope.py"))


def test_missing_module_and_function(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="module 'no_such_reward_module' not found"):
        load_reward_function("no_such_reward_module:f")
    path = _write(tmp_path, "r.py", EXACT_MATCH)
    with pytest.raises(ValueError, match="has no function 'missing'"):
        load_reward_function(f"{path}:missing")


def test_bad_signature_is_a_clear_error(tmp_path: Path) -> None:
    path = _write(tmp_path, "bad.py", "def reward_func(queries):\n    return {'rewards': []}\n")
    with pytest.raises(
        ValueError,
        match=r"must accept \(queries, prompts, labels, \*\*kwargs\).*reward_func\(queries\)",
    ):
        load_reward_function(str(path))


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ("return {'rewards': [1.0]}", "rewards has 1 values for a batch of 2"),
        ("return {'scores': [1.0, 1.0]}", "no 'rewards'"),
        ("return [1.0, 1.0]", "expected a dict with 'rewards'"),
        ("return None", "expected a dict with 'rewards'"),
        (
            "return {'rewards': [1.0, 2.0], 'extra_logs': {'k': [1.0]}}",
            r"extra_logs\['k'\] has 1 values",
        ),
        ("raise KeyError('answer')", "raised KeyError: 'answer'"),
    ],
)
def test_bad_output_raises_never_zero(tmp_path: Path, traj: Callable[..., Trajectory], body: str, reason: str) -> None:
    """A malformed answer as a whole fails the call (a value unusable for one sample fails that sample alone:
    tests/unit/reward/test_reward_invalid.py)."""
    path = _write(
        tmp_path,
        "broken.py",
        f"def reward_func(queries, prompts, labels):\n    {body}\n",
    )
    scorer = _scorer(str(path))
    with pytest.raises(ScorerError, match=reason):
        asyncio.run(scorer.score([traj(0), traj(1)]))
    assert scorer.metrics() == {
        "reward/function/calls": 1.0,
        "reward/function/failures": 1.0,
    }


def test_timeout(tmp_path: Path, traj: Callable[..., Trajectory]) -> None:
    path = _write(
        tmp_path,
        "slow.py",
        "import asyncio\nasync def reward_func(queries, prompts, labels):\n    await asyncio.sleep(5)\n",
    )
    with pytest.raises(ScorerError, match=r"timed out after 0\.05 s"):
        asyncio.run(_scorer(str(path), timeout_s=0.05).score([traj(0)]))
