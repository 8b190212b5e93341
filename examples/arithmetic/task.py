"""The built-in demo task: integer arithmetic problems, their split, JSONL files and the reward.

Pure Python (no torch, no streamrl imports), so the reward service can load this file by path
as an OpenRLHF-compatible reward plug-in (``reward_func``) and the coordinator can read the JSONL
it writes (one ``{"prompt": ..., "label": ...}`` object per line).

Two formats:

* plain (workload a): prompt ``"47+85="``, expected response ``"132"`` then end-of-sequence.
* scratchpad (workload b, generation-heavy): addition of long numbers where the response first
  writes one ``"x+y+c=s,"`` step per column, least significant first, then ``"#"`` and the sum:
  ``"47+85="`` -> ``"7+5+0=12,4+8+1=13,#132"``. The long chain is the model's own work (it carries
  the digits), so every one of the >= 128 generated tokens is honest generation, not padding.

Reward: 1.0 when the final answer equals the label exactly, else 0.0. There is no format bonus:
the warm start already teaches the format (well-formed rate ~100%), and a bonus that nearly every
sample earns only shrinks the group-normalised signal. The well-formed rate is still logged.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

OPERATORS = ("+", "-", "*")
ANSWER_MARK = "#"
# Special-token text that may appear in decoded queries: "</s>", "<pad>", "<|im_end|>", ...
_SPECIAL_TOKEN = re.compile(r"<\|?/?[A-Za-z_][A-Za-z0-9_]*\|?>")
# A well-formed response: one integer, or scratchpad steps then the mark and one integer.
_WELL_FORMED = re.compile(r"(?:(?:\d\+\d\+\d=\d{1,2},)*" + re.escape(ANSWER_MARK) + r")?(-?\d+)")
# Above this many distinct problems, sample instead of enumerating the whole space.
_MAX_ENUMERATED = 1_000_000


@dataclass(frozen=True)
class TaskSpec:
    """Which problems to generate and how to split them.

    Example:
        >>> spec = TaskSpec(operators="+", digits=2, num_eval=500, seed=0)
        >>> train, held_out = make_splits(spec)
    """

    operators: str = "+"
    """Operators to draw from, a subset of ``"+-*"``."""
    digits: int = 2
    """Operands are integers in [0, 10**digits)."""
    num_eval: int = 500
    """Held-out problems (never in the training split)."""
    num_train: int | None = None
    """Training problems; None = every remaining problem (capped at 200,000 when sampling)."""
    scratchpad: bool = False
    """Column-by-column trace before the answer (addition only; workload b)."""
    seed: int = 0
    """Seed of the generator and the split."""

    def __post_init__(self) -> None:
        if not self.operators or any(op not in OPERATORS for op in self.operators):
            raise ValueError(f"operators must be a non-empty subset of {''.join(OPERATORS)!r}, got {self.operators!r}")
        if len(set(self.operators)) != len(self.operators):
            raise ValueError(f"operators has duplicates: {self.operators!r}")
        if not 1 <= self.digits <= 30:
            raise ValueError(f"digits must be in [1, 30], got {self.digits}")
        if self.num_eval < 1:
            raise ValueError(f"num_eval must be >= 1, got {self.num_eval}")
        if self.num_train is not None and self.num_train < 1:
            raise ValueError(f"num_train must be >= 1 or None, got {self.num_train}")
        if self.scratchpad and self.operators != "+":
            raise ValueError("scratchpad traces are defined for addition only: set operators='+'")
        total = len(self.operators) * 10 ** (2 * self.digits)
        wanted = self.num_eval + (self.num_train or 1)
        if wanted > total:
            raise ValueError(f"{wanted} problems requested but only {total} distinct ones exist")


@dataclass(frozen=True)
class Problem:
    """One problem: the prompt text, the full target response, and the label (the answer)."""

    prompt: str
    response: str
    label: str


def solve(a: int, op: str, b: int) -> int:
    """The exact result of ``a op b``."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unknown operator {op!r}")


def scratchpad_trace(a: int, b: int) -> str:
    """Column-by-column addition trace, least significant column first: ``"7+5+0=12,4+8+1=13,"``."""
    da, db = str(a)[::-1], str(b)[::-1]
    carry, steps = 0, []
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        s = x + y + carry
        steps.append(f"{x}+{y}+{carry}={s},")
        carry = s // 10
    return "".join(steps)


def make_problem(a: int, op: str, b: int, scratchpad: bool = False) -> Problem:
    """Build the prompt, target response and label for ``a op b``."""
    label = str(solve(a, op, b))
    response = f"{scratchpad_trace(a, b)}{ANSWER_MARK}{label}" if scratchpad else label
    return Problem(prompt=f"{a}{op}{b}=", response=response, label=label)


def _decode_index(index: int, spec: TaskSpec) -> tuple[int, str, int]:
    """Map an integer in [0, |ops| * n^2) to one problem (a, op, b)."""
    n = 10**spec.digits
    op_index, rest = divmod(index, n * n)
    a, b = divmod(rest, n)
    return a, spec.operators[op_index], b


def _problem_indices(spec: TaskSpec) -> tuple[list[int], list[int]]:
    """Distinct problem indices for the held-out and training splits, disjoint by construction."""
    rng = random.Random(spec.seed)
    total = len(spec.operators) * 10 ** (2 * spec.digits)
    if total <= _MAX_ENUMERATED:
        order = list(range(total))
        rng.shuffle(order)
        held_out = order[: spec.num_eval]
        rest = order[spec.num_eval :]
        return held_out, rest if spec.num_train is None else rest[: spec.num_train]
    num_train = spec.num_train if spec.num_train is not None else 200_000
    seen: set[int] = set()
    chosen: list[int] = []
    while len(chosen) < spec.num_eval + num_train:  # rejection sampling of distinct indices
        index = rng.randrange(total)
        if index not in seen:
            seen.add(index)
            chosen.append(index)
    return chosen[: spec.num_eval], chosen[spec.num_eval :]


def make_splits(spec: TaskSpec) -> tuple[list[Problem], list[Problem]]:
    """Deterministic (train, held_out) problem lists for ``spec``; no prompt appears in both."""
    held_out_idx, train_idx = _problem_indices(spec)

    def build(indices: list[int]) -> list[Problem]:
        return [make_problem(*_decode_index(i, spec), scratchpad=spec.scratchpad) for i in indices]

    return build(train_idx), build(held_out_idx)


def write_jsonl(path: str | Path, problems: list[Problem]) -> None:
    """Write ``{"prompt", "label"}`` lines (plus ``"response"``, the SFT target) to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for p in problems:
            f.write(json.dumps({"prompt": p.prompt, "label": p.label, "response": p.response}) + "\n")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read the rows written by :func:`write_jsonl`."""
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def spec_dict(spec: TaskSpec) -> dict[str, Any]:
    """The spec as a JSON-able dict (stored next to the data to detect stale files)."""
    return asdict(spec)


def extract_response(query: str, prompt: str) -> str:
    """The generated text of ``query`` (prompt + response), cut at the first special token.

    The prompt may be preceded by special-token text (a BOS) and the response followed by EOS and
    padding; whatever follows the first special token after the prompt is ignored.
    """
    start = query.find(prompt) if prompt else -1
    if start >= 0:
        response = query[start + len(prompt) :]
    else:  # the prompt was re-tokenized differently: fall back to the first "="
        _, _, response = query.partition("=")
    return _SPECIAL_TOKEN.split(response, maxsplit=1)[0].strip()


def parse_answer(response: str) -> int | None:
    """The final answer in ``response``, or None when the response is not well formed.

    Plain responses must be exactly one integer. Scratchpad responses must be ``"x+y+c=s,"`` steps,
    the answer mark and one integer; the arithmetic of the steps is not checked.
    """
    match = _WELL_FORMED.fullmatch(response.strip())
    return int(match.group(1)) if match else None


def reward_func(queries: list[str], prompts: list[str], labels: list[str], **kwargs: Any) -> dict[str, Any]:
    """OpenRLHF-compatible reward: 1.0 when the final answer equals the label, else 0.0.

    ``queries`` are prompt + response texts. Returns ``rewards`` and ``scores`` (identical, in
    [0, 1]) and ``extra_logs`` with the batch accuracy and well-formed rate.
    """
    if not len(queries) == len(prompts) == len(labels):
        raise ValueError(f"queries, prompts and labels differ in length: {len(queries)}, {len(prompts)}, {len(labels)}")
    rewards, num_well_formed = [], 0
    for query, prompt, label in zip(queries, prompts, labels, strict=True):
        answer = parse_answer(extract_response(query, prompt))
        num_well_formed += answer is not None
        rewards.append(1.0 if answer is not None and answer == int(label) else 0.0)
    n = max(len(rewards), 1)
    extra_logs = {
        "arithmetic/accuracy": sum(rewards) / n,
        "arithmetic/well_formed": num_well_formed / n,
    }
    return {"rewards": rewards, "scores": list(rewards), "extra_logs": extra_logs}
