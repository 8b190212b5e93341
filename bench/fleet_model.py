"""The arithmetic of the fleet benchmark (pure): fleet size <-> trajectories/s, run sizing, the
"sustained" verdict, CPU accounting from /proc, and which component broke first.

A simulated GPU generates ``tokens_per_s`` response tokens per second, spread over ``seqs_per_gpu``
sequences decoded at once (``seqs_per_gpu / group_size`` prompt groups), so one group takes
``seqs_per_gpu * response_tokens / tokens_per_s`` seconds and the fleet's capacity is
``num_gpus * tokens_per_s / response_tokens`` trajectories per second. An "H200-equivalent" is the
output of one GPU at the assumed H200 rate: ``H200-eq = trajectories/s * response_tokens / tokens_per_s``.

Simplifications: every response has exactly ``response_tokens`` tokens; a GPU's throughput does not
depend on how many sequences it holds (a real engine is slower per sequence with more of them and
idles below its batch size); prompt (prefill) time is not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

H200_TOKENS_PER_S = 5000.0
"""Assumed decode throughput of one H200 for a 7-8B model in an RL rollout (many concurrent 8k-token
sequences, bf16): an 8B model with grouped-query attention holds ~128 KiB of KV cache per token, so the
~110 GB left after the weights hold ~200 sequences at a mean context of ~4k tokens; one decode step then
reads ~16 GB of weights + ~100 GB of KV cache, ~25 ms at 4.8 TB/s, i.e. ~8k tokens/s at full memory
bandwidth; ~60% of that is 5k. An assumption, not a measurement (no vLLM on the GPU machine here)."""


@dataclass(frozen=True)
class FleetSpec:
    """What one simulated GPU does."""

    tokens_per_s: float = H200_TOKENS_PER_S
    """Response tokens one simulated GPU generates per second."""
    response_tokens: int = 8192
    """Tokens of every response (a trajectory's length)."""
    prompt_tokens: int = 512
    """Tokens of every prompt."""
    group_size: int = 8
    """Samples per prompt (GRPO group)."""
    seqs_per_gpu: int = 8
    """Sequences one simulated GPU decodes at once (a multiple of group_size)."""

    def __post_init__(self) -> None:
        if self.tokens_per_s <= 0:
            raise ValueError(f"tokens_per_s must be > 0, got {self.tokens_per_s}")
        if self.response_tokens < 1 or self.prompt_tokens < 1:
            raise ValueError("response_tokens and prompt_tokens must be >= 1")
        if self.group_size < 1 or self.seqs_per_gpu % self.group_size:
            raise ValueError(f"seqs_per_gpu ({self.seqs_per_gpu}) must be a multiple of group_size ({self.group_size})")

    @property
    def groups_per_gpu(self) -> int:
        return self.seqs_per_gpu // self.group_size

    @property
    def generation_s(self) -> float:
        """Seconds one group takes on its GPU."""
        return self.seqs_per_gpu * self.response_tokens / self.tokens_per_s


def trajectories_per_s(num_gpus: int, spec: FleetSpec) -> float:
    """Capacity of ``num_gpus`` simulated GPUs (trajectories/s)."""
    return num_gpus * spec.tokens_per_s / spec.response_tokens


def h200_equivalents(rate_per_s: float, spec: FleetSpec, h200_tokens_per_s: float = H200_TOKENS_PER_S) -> float:
    """How many H200s produce ``rate_per_s`` trajectories of ``spec.response_tokens`` tokens per second."""
    return rate_per_s * spec.response_tokens / h200_tokens_per_s


@dataclass(frozen=True)
class RunSizing:
    """Coordinator and learner settings that keep a fleet busy, so only the pipeline can starve it."""

    prompts_per_step: int
    """Groups per training batch."""
    max_staleness: int
    learner_step_s: float
    """Simulated learner step (s)."""
    batch_samples: int
    in_flight_groups_max: int
    """Groups admission allows in flight or waiting for a batch: ``(max_staleness + 1) * prompts_per_step``."""


def size_run(
    num_gpus: int,
    spec: FleetSpec,
    *,
    max_staleness: int,
    learner_step_s: float,
    in_flight_margin: float = 2.0,
    learner_headroom: float = 1.25,
) -> RunSizing:
    """Batch size such that (1) the learner, one batch per ``learner_step_s``, trains ``learner_headroom``
    times the fleet's capacity, and (2) admission (groups for ``max_staleness + 1`` batches) lets
    ``in_flight_margin`` times the fleet's concurrent groups be issued besides one batch's worth: groups
    complete but not yet trained (waiting for their batch, queued at or in the learner, scored but not
    yet stored) hold admission too: with a margin of 1.25 (and max_staleness 4) this bench starved the
    fleet with no process saturated. No prefetch: every prompt issued can start at once (its required
    version is the current one)."""
    if max_staleness < 1:
        raise ValueError(
            "max_staleness must be >= 1 (0 is the synchronous mode: the fleet idles while the learner trains)"
        )
    if learner_step_s <= 0:
        raise ValueError(f"learner_step_s must be > 0, got {learner_step_s}")
    for_learner = learner_headroom * trajectories_per_s(num_gpus, spec) * learner_step_s / spec.group_size
    for_fleet = in_flight_margin * num_gpus * spec.groups_per_gpu / max_staleness
    pps = max(1, math.ceil(max(for_learner, for_fleet)))
    return RunSizing(
        prompts_per_step=pps,
        max_staleness=max_staleness,
        learner_step_s=learner_step_s,
        batch_samples=pps * spec.group_size,
        in_flight_groups_max=(max_staleness + 1) * pps,
    )


def linear_fit(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares ``y = a + b x`` over ``points`` as ``(a, b)``; None without two distinct x."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / max(n, 1)
    var = sum((x - mean_x) ** 2 for x, _ in points)
    if n < 2 or var == 0:
        return None
    mean_y = sum(y for _, y in points) / n
    b = sum((x - mean_x) * (y - mean_y) for x, y in points) / var
    return mean_y - b * mean_x, b


def core_ceiling(fixed_cores: float, cores_per_rate: float) -> float | None:
    """The rate at which a component using ``fixed_cores + cores_per_rate * rate`` fills one core."""
    if cores_per_rate <= 0 or fixed_cores >= 1:
        return None
    return (1 - fixed_cores) / cores_per_rate


# -- the verdict -----------------------------------------------------------------------------------
MIN_UTILIZATION = 0.95
"""Sustained needs the simulated GPUs to finish at least this share of their capacity in the window."""
MAX_BACKLOG_GROWTH = 0.05
"""...and no stream's backlog to grow by more than this share of the entries its group handled in the
window (or by more than one entry, whichever is larger)."""


def backlog_growth(samples: list[tuple[float, float]]) -> float:
    """Growth of a backlog over its samples ``(t_s, backlog)``: the least-squares slope times the span."""
    if len(samples) < 2:
        return 0.0
    n = len(samples)
    mean_t = sum(t for t, _ in samples) / n
    mean_b = sum(b for _, b in samples) / n
    var = sum((t - mean_t) ** 2 for t, _ in samples)
    if var == 0:
        return 0.0
    slope = sum((t - mean_t) * (b - mean_b) for t, b in samples) / var
    return slope * (samples[-1][0] - samples[0][0])


@dataclass(frozen=True)
class Verdict:
    sustained: bool
    reasons: list[str]
    """Why not (empty when sustained)."""


def judge(*, utilization: float, growth: dict[str, float], handled: dict[str, float], problems: list[str]) -> Verdict:
    """Sustained: utilization >= MIN_UTILIZATION, every backlog's growth within MAX_BACKLOG_GROWTH of
    what its group handled, and no problem (a process died, a dead letter, Redis over its memory cap)."""
    reasons = list(problems)
    if utilization < MIN_UTILIZATION:
        reasons.append(f"GPUs finished {utilization:.1%} of their capacity (< {MIN_UTILIZATION:.0%}): starved")
    for stream, grew in growth.items():
        allowed = max(1.0, MAX_BACKLOG_GROWTH * handled.get(stream, 0.0))
        if grew > allowed:
            reasons.append(f"{stream} backlog grew by {grew:.0f} entries over the window (> {allowed:.0f})")
    return Verdict(sustained=not reasons, reasons=reasons)


# -- CPU ----------------------------------------------------------------------------------------------
def process_ticks(stat_line: str) -> int:
    """utime + stime (clock ticks, every thread) from the text of ``/proc/<pid>/stat``."""
    fields = stat_line[stat_line.rindex(")") + 2 :].split()  # the command name may hold spaces and ')'
    return int(fields[11]) + int(fields[12])


def machine_ticks(proc_stat: str) -> tuple[int, int]:
    """(busy, interrupts) clock ticks of all CPUs from the text of ``/proc/stat``: busy is everything but
    idle and iowait; interrupts (irq + softirq: loopback traffic is handled there) are charged to no process."""
    values = [int(v) for v in proc_stat.splitlines()[0].split()[1:]]
    total = sum(values[:8])  # guest time is already counted in user
    return total - values[3] - values[4], values[5] + values[6]


SATURATED_CORE = 0.9
"""A single-threaded component using this much of one core is saturated."""
SATURATED_MACHINE = 0.9
"""The machine is saturated when this share of all its cores is busy."""


def bottleneck(cores: dict[str, float], num_cores: int, single_threaded: set[str]) -> str:
    """What limits a step, from the cores each component used (``others``: processes not ours)."""
    busy = sum(cores.values())
    ranked = sorted(cores.items(), key=lambda kv: -kv[1])
    shares = ", ".join(f"{name} {used:.2f}" for name, used in ranked)
    saturated = [name for name, used in ranked if name in single_threaded and used >= SATURATED_CORE]
    if saturated:
        return f"{saturated[0]} saturates its core ({cores[saturated[0]]:.2f} cores; all: {shares})"
    if busy >= SATURATED_MACHINE * num_cores:
        return f"the machine's {num_cores} cores are saturated ({busy:.2f} busy: {shares})"
    return f"no CPU saturated ({busy:.2f} of {num_cores} cores busy: {shares})"
