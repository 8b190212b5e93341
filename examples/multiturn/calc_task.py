"""The multi-turn demo task: arithmetic problems the policy solves with a calculator tool.

Pure Python (no torch, no streamrl imports), so the reward service loads this file by path as an
OpenRLHF-compatible reward plug-in (``reward_func``). The problems are those of the arithmetic demo
(``examples/arithmetic/task.py``: prompt ``"47*85="``, label ``"3995"``); the environment is the
rollout tier's built-in calculator (``streamrl.rollout.environments.calculator``). A canonical episode::

    prompt       47*85=
    model        <calc>47*85</calc></s>          turn 1: a tool call (trained)
    environment  <result>3995</result>           the tool's answer (loss-masked)
    model        Answer: 3995</s>                turn 2: the answer (trained); the episode ends

The model can also answer at once (``Answer: 3995``), which the tiny policy cannot do reliably for
products of two 2-digit numbers; with the tool it only has to copy the operands and the result.

Reward: 1.0 when the episode ends with ``Answer: N`` and N equals the label, else 0.0, given by the
reward tier's scorer on the whole episode text (the environment's per-turn rewards are 0). One
scorer thus gives both the training reward and the held-out accuracy. ``extra_logs`` add the rate of
episodes that called the tool and the rate of well-formed answers.
"""

from __future__ import annotations

import re
from typing import Any

MODEL, ENVIRONMENT = "model", "environment"
CHARS = "0123456789+-*/()=.,# <>:abcdefghijklmnopqrstuvwxyzA"
"""Characters of the policy's tokenizer: the arithmetic, the tags, ``Answer:`` and error messages."""
# Special-token text that may appear in decoded queries: "</s>", "<pad>", ...
_SPECIAL_TOKEN = re.compile(r"</?s>|<pad>")
_ANSWER = re.compile(r"Answer: (-?\d+)")


def tool_episode(prompt: str, label: str) -> list[tuple[str, str]]:
    """The canonical episode of a problem as (who, text) pieces: call, result, answer."""
    expression = prompt.removesuffix("=")
    return [
        (MODEL, f"<calc>{expression}</calc>"),
        (ENVIRONMENT, f"<result>{label}</result>"),
        (MODEL, f"Answer: {label}"),
    ]


def direct_episode(prompt: str, label: str) -> list[tuple[str, str]]:
    """The episode that answers at once, without the tool."""
    return [(MODEL, f"Answer: {label}")]


def episode_text(query: str, prompt: str) -> str:
    """The episode after the prompt in ``query`` (prompt + episode), special-token text removed."""
    start = query.find(prompt) if prompt else -1
    text = query[start + len(prompt) :] if start >= 0 else query.partition("=")[2]
    return _SPECIAL_TOKEN.sub("", text).strip()


def parse_answer(episode: str) -> int | None:
    """N when the episode ends with ``Answer: N`` (nothing after it), else None."""
    match = _ANSWER.search(episode)
    return int(match.group(1)) if match and match.end() == len(episode) else None


def reward_func(queries: list[str], prompts: list[str], labels: list[str], **kwargs: Any) -> dict[str, Any]:
    """OpenRLHF-compatible reward: 1.0 when the episode's answer equals the label, else 0.0."""
    if not len(queries) == len(prompts) == len(labels):
        raise ValueError(f"queries, prompts and labels differ in length: {len(queries)}, {len(prompts)}, {len(labels)}")
    rewards, num_well_formed, num_tool = [], 0, 0
    for query, prompt, label in zip(queries, prompts, labels, strict=True):
        episode = episode_text(query, prompt)
        answer = parse_answer(episode)
        num_well_formed += answer is not None
        num_tool += "<result>" in episode
        rewards.append(1.0 if answer is not None and answer == int(label) else 0.0)
    n = max(len(rewards), 1)
    extra_logs = {
        "multiturn/accuracy": sum(rewards) / n,
        "multiturn/well_formed": num_well_formed / n,
        "multiturn/tool_use": num_tool / n,
    }
    return {"rewards": rewards, "scores": list(rewards), "extra_logs": extra_logs}
