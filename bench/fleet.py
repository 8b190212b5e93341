"""Fleet simulation: how large a rollout fleet one coordinator and one Redis keep busy.

For growing fleets of N simulated GPUs it runs, on this machine, a real ``redis-server``, the real
coordinator (``streamrl coordinator``) and the real reward tier (``streamrl reward``, one replica, a
cheap Python reward function: ``fleet_reward.py``) with simulated rollout workers and a simulated
learner (``fleet_sim.py``: real bus traffic - PromptWorkItems taken through the ConsumerLoop,
8k-token Trajectory messages committed, batches consumed - manifests, their payloads read -, WeightsPublished versions).
Model and sizing: ``fleet_model.py`` (tokens/s per GPU, why 5,000, what an H200-equivalent is).

Each step waits (up to ``--quiet-wait-s``) for other people's work on this shared machine to fall
under 0.25 cores, starts everything afresh, waits out the warm-up, then for ``--window-s`` seconds samples
every 2 s each stream's consumer-group backlog (``XINFO GROUPS``: entries not yet delivered +
pending), Redis memory and traffic, and reads at both ends the CPU time of every process from /proc and
each Redis command's p50 / p99 / p99.9 time (``INFO latencystats``, reset as the window starts; reported as
``redis_command_p99_ms`` and its largest, ``redis_p99_max_ms``).
The step is **sustained** when the simulated GPUs finish >= 95% of their capacity in the window and
the backlogs downstream of them (trajectories, scored, batches) do not grow (least-squares growth over
the window <= 5% of what the stream's group handled, or 1 entry), with no process dead, no dead letter
and Redis under ``--max-redis-gb`` (``fleet_model.judge``). Prompts waiting for a GPU are by design
(admission lets 2x what the fleet decodes at once be issued); a coordinator too slow to issue them shows as
starved GPUs. Sizes double from ``--start`` until a step fails, then ``--refine`` bisections
narrow the limit. The largest sustained step is measured again when the 1-minute load average was
above 1.5 at its start and other people's work was using the machine then (>= 0.25 cores; the load
average also remembers this bench's previous step); of two measurements of a size, the one during
which other work used less CPU counts.

Like a retention job, the driver trims what every consumer group has consumed (``XTRIM MINID``): by
entry count alone (``redis.maxlen``) the streams would hold ~11 GB each at 100,000 8k-token entries.

Usage: python bench/fleet.py [--quick] [--sizes 256,512] [--window-s 60] ... The last line printed
is one JSON object, also written to bench/results/fleet-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import fleet_model as fm
import fleet_probes as probes
import redis as syncredis
from fleet_payload_costs import payload_costs
from fleet_profile import coordinator_split

from streamrl.common.aio import EVENT_LOOP_ENV, EVENT_LOOPS
from streamrl.common.config import ConsumerConfig
from streamrl.common.streams import StreamNames
from streamrl.coordinator import state as st
from streamrl.ops.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
RUN_ID = "fleet"
JUDGED_BACKLOGS = ("trajectories", "scored", "batches")
"""Backlogs that must not grow in a sustained step (see the module docstring)."""
REWARD_FILE = ROOT / "bench" / "fleet_reward.py"
SAMPLE_EVERY_S = 2.0
SINGLE_THREADED = {"redis", "coordinator", "reward", "learner_sim"}
"""Components that are one process with one busy thread (the CPU they can use is one core)."""
CLK_TCK = os.sysconf("SC_CLK_TCK")
QUIET_CORES = 0.25
"""Other work under this many cores (over 5 s, before a step) counts as a quiet machine."""


# -- the task -----------------------------------------------------------------------------------------
def build_task(folder: Path, spec: fm.FleetSpec, num_prompts: int = 4096) -> tuple[Path, Path]:
    """A word-level tokenizer (``w0``..``w999``, one token per word) and prompts of ``prompt_tokens`` words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["[PAD]", "[UNK]", "[EOS]", *(f"w{i}" for i in range(1000))])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]")
    tokenizer.save_pretrained(folder / "tokenizer")
    with (folder / "prompts.jsonl").open("w") as f:
        for i in range(num_prompts):
            words = " ".join(f"w{(i * 7 + j) % 1000}" for j in range(spec.prompt_tokens))
            f.write(json.dumps({"prompt": words, "label": str(i % 10)}) + "\n")
    return folder / "tokenizer", folder / "prompts.jsonl"


def write_recipe(
    path: Path,
    *,
    run_dir: Path,
    redis_url: str,
    spec: fm.FleetSpec,
    sizing: fm.RunSizing,
    tokenizer: Path,
    dataset: Path,
) -> Path:
    path.write_text(f"""run_id = "{RUN_ID}"
run_dir = "{run_dir}"

[redis]
url = "{redis_url}"

[coordinator]
group_size = {spec.group_size}
prompts_per_step = {sizing.prompts_per_step}
max_staleness = {sizing.max_staleness}
prefetch_steps = 0
total_steps = 1000000

[coordinator.dataset]
path = "{dataset}"
tokenizer = "{tokenizer}"

[coordinator.sampling]
max_new_tokens = {spec.response_tokens}

[[reward.scorers]]
name = "fleet"
type = "function"
path = "{REWARD_FILE}"
""")
    return path


# -- processes ---------------------------------------------------------------------------------------
def spawn(name: str, cmd: list[str], logs: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRL_")}
    env[EVENT_LOOP_ENV] = os.environ.get(EVENT_LOOP_ENV, "uvloop")  # (--event-loop sets it for every process)
    path = [str(ROOT / "bench"), *filter(None, [os.environ.get("PYTHONPATH")])]  # (a worktree's sources first)
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(path))
    log = (logs / f"{name}.log").open("wb")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def stop_all(procs: dict[str, subprocess.Popen[bytes]], grace_s: float = 15.0) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs.values():
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- one step ------------------------------------------------------------------------------------------
def start_step(
    num_gpus: int,
    args: argparse.Namespace,
    spec: fm.FleetSpec,
    sizing: fm.RunSizing,
    folder: Path,
    task: tuple[Path, Path],
    redis_url: str,
    profile: bool,
) -> dict[str, subprocess.Popen[bytes]]:
    recipe = write_recipe(
        folder / "recipe.toml",
        run_dir=folder / "run",
        redis_url=redis_url,
        spec=spec,
        sizing=sizing,
        tokenizer=task[0],
        dataset=task[1],
    )
    common = [
        f"--redis-url={redis_url}",
        f"--run-id={RUN_ID}",
        f"--tokens-per-s={spec.tokens_per_s}",
        f"--response-tokens={spec.response_tokens}",
        f"--prompt-tokens={spec.prompt_tokens}",
        f"--group-size={spec.group_size}",
        f"--seqs-per-gpu={spec.seqs_per_gpu}",
        f"--gpus-per-worker={args.gpus_per_worker}",
    ]
    sim = [sys.executable, str(ROOT / "bench" / "fleet_sim.py")]
    cli = [sys.executable, "-m", "streamrl.ops.cli"]
    profiled = [sys.executable, "-m", "cProfile", "-o", str(folder / "coordinator.prof"), *cli[1:]]
    procs = {
        "learner_sim": spawn("learner_sim", [*sim, "learner", *common, f"--step-s={sizing.learner_step_s}"], folder)
    }
    coordinator = [*(profiled if profile else cli), "coordinator", str(recipe), "--instance=coordinator"]
    procs["coordinator"] = spawn("coordinator", coordinator, folder)
    procs["reward"] = spawn("reward", [*cli, "reward", str(recipe), "--instance=reward-0"], folder)
    workers = num_gpus // args.gpus_per_worker
    num_procs = args.sim_procs or (1 if workers <= 64 else 2)
    first = 0
    for p in range(num_procs):
        count = workers // num_procs + (p < workers % num_procs)
        procs[f"rollout_sim{p}"] = spawn(
            f"rollout_sim{p}", [*sim, "rollout", *common, f"--workers={count}", f"--first-worker={first}"], folder
        )
        first += count
    return procs


def run_step(
    num_gpus: int,
    args: argparse.Namespace,
    spec: fm.FleetSpec,
    task: tuple[Path, Path],
    logs: Path,
    profile: bool = False,
) -> dict[str, Any]:
    """Run one fleet size; ``profile``: the coordinator under cProfile (a diagnostic, slower)."""
    sizing = fm.size_run(num_gpus, spec, max_staleness=args.max_staleness, learner_step_s=args.learner_step_s)
    folder = logs / f"n{num_gpus}-{int(time.time())}"
    folder.mkdir(parents=True)
    others_before, waited_s = wait_quiet(args.quiet_wait_s)
    load_before = os.getloadavg()[0]
    capacity = fm.trajectories_per_s(num_gpus, spec)
    print(
        f"-- {num_gpus} GPUs: capacity {capacity:.1f} trajectories/s, {sizing.prompts_per_step} groups/batch, "
        f"load {load_before:.2f}, other work {others_before:.2f} cores (waited {waited_s:.0f} s)",
        flush=True,
    )
    server = RedisServer(folder / "redis", appendonly=False).start()
    client = syncredis.Redis.from_url(server.url)
    client.config_set("slowlog-max-len", probes.SLOWLOG_LEN)
    names = StreamNames(RUN_ID)
    procs = start_step(num_gpus, args, spec, sizing, folder, task, server.url, profile)
    pids = {"redis": server.proc.pid, **{k: p.pid for k, p in procs.items()}, "driver": os.getpid()}  # type: ignore[union-attr]
    try:
        problems = warm_up(client, names, procs, args.warmup_s or spec.generation_s + 10)
        window = measure(client, names, procs, pids, args) if not problems else None
        final = (
            probes.cpu_ticks(pids, {}).get("coordinator", 0) / CLK_TCK,
            probes.read_groups(client, names)["scored"]["handled"],
        )
    finally:
        stop_all(procs)
        server.stop()
    if window is None:
        return {"num_gpus": num_gpus, "sustained": False, "reasons": problems, "logs": str(folder)}
    result = summarize(num_gpus, spec, sizing, window, load_before, os.getloadavg()[0], folder)
    result["other_cores_before"] = round(others_before, 2)
    if profile:
        result["coordinator_profile"] = coordinator_split(folder / "coordinator.prof", *final)
    return result


def wait_quiet(max_wait_s: float, threshold_cores: float = QUIET_CORES, sample_s: float = 5.0) -> tuple[float, float]:
    """Wait (at most ``max_wait_s``) until other work on the machine used under ``threshold_cores`` over
    ``sample_s``: (the cores it used in the last sample, seconds waited). Nothing of this bench runs
    between steps, so all busy CPU is someone else's."""
    started = time.monotonic()
    while True:
        busy0 = fm.machine_ticks(Path("/proc/stat").read_text())[0]
        time.sleep(sample_s)
        cores = (fm.machine_ticks(Path("/proc/stat").read_text())[0] - busy0) / CLK_TCK / sample_s
        waited = time.monotonic() - started
        if cores < threshold_cores or waited >= max_wait_s:
            return cores, waited


def dead_processes(procs: dict[str, subprocess.Popen[bytes]]) -> list[str]:
    return [f"{name} exited with {p.returncode} (see its log)" for name, p in procs.items() if p.poll() is not None]


def sim_stats(client: syncredis.Redis, names: StreamNames) -> dict[str, dict[str, Any]]:
    return {probes.text(k): json.loads(v) for k, v in client.hgetall(names.state("fleet_sim")).items()}


def warm_up(
    client: syncredis.Redis, names: StreamNames, procs: dict[str, subprocess.Popen[bytes]], warmup_s: float
) -> list[str]:
    """Wait ``warmup_s``, then until the learner trained a batch (at most 2 more warm-ups): [] or why not."""
    started = time.monotonic()
    while True:
        time.sleep(1.0)
        if dead := dead_processes(procs):
            return dead
        probes.read_groups(client, names)  # trims as it goes
        elapsed = time.monotonic() - started
        if elapsed >= warmup_s and sim_stats(client, names).get("learner", {}).get("batches", 0) >= 1:
            return []
        if elapsed >= 3 * warmup_s:
            return [f"no batch trained {elapsed:.0f} s after the start"]


def measure(
    client: syncredis.Redis,
    names: StreamNames,
    procs: dict[str, subprocess.Popen[bytes]],
    pids: dict[str, int],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Sample the window: backlogs every 2 s; CPU, traffic and counters at both ends."""
    machine0 = fm.machine_ticks(Path("/proc/stat").read_text())
    ticks0 = probes.cpu_ticks(pids, {})
    client.config_resetstat()  # (command latencies count from here; the other stats are read as deltas)
    commands0, stats0, wall0 = probes.command_stats(client), client.info("stats"), time.time()
    sims0, groups0 = sim_stats(client, names), probes.read_groups(client, names)
    t0 = time.monotonic()
    series: list[list[float]] = []
    memory_mb, rss, problems = 0.0, dict.fromkeys(pids, 0.0), []
    while time.monotonic() - t0 < args.window_s:
        time.sleep(SAMPLE_EVERY_S)
        groups = probes.read_groups(client, names)
        series.append([round(time.monotonic() - t0, 2), *(groups[s]["backlog"] for s in probes.GROUPS)])
        memory_mb = max(memory_mb, client.info("memory")["used_memory"] / 2**20)
        rss = {k: max(v, probes.rss_mb(pids[k])) for k, v in rss.items()}
        if memory_mb > args.max_redis_gb * 1024:
            problems.append(f"redis used {memory_mb:.0f} MB (> --max-redis-gb {args.max_redis_gb})")
            break
        if dead := dead_processes(procs):
            problems += dead
            break
    elapsed = time.monotonic() - t0
    ticks1, machine1 = probes.cpu_ticks(pids, ticks0), fm.machine_ticks(Path("/proc/stat").read_text())
    counters = client.mget([names.state(c) for c in st.COUNTERS])
    return {
        "window_s": elapsed,
        "series": series,
        "redis_memory_mb_max": memory_mb,
        "rss_mb_max": rss,
        "problems": problems,
        "groups": (groups0, probes.read_groups(client, names)),
        "sims": (sims0, sim_stats(client, names)),
        "cores": {k: (ticks1[k] - ticks0.get(k, ticks1[k])) / CLK_TCK / elapsed for k in ticks1},
        "machine_cores": (machine1[0] - machine0[0]) / CLK_TCK / elapsed,
        "interrupt_cores": (machine1[1] - machine0[1]) / CLK_TCK / elapsed,
        "redis_commands": {
            k: (c - commands0.get(k, (0, 0))[0], u - commands0.get(k, (0, 0))[1])
            for k, (c, u) in probes.command_stats(client).items()
        },
        "redis_net": {
            k: client.info("stats")[k] - stats0[k] for k in ("total_net_input_bytes", "total_net_output_bytes")
        },
        "counters": {c: int(v) for c, v in zip(st.COUNTERS, counters, strict=True) if v},
        "slow_commands": probes.slow_commands(client, since=wall0),
        "latencies": probes.command_latencies(client),
        "dead_letters": client.xlen(names.dead),
    }


def summarize(
    num_gpus: int,
    spec: fm.FleetSpec,
    sizing: fm.RunSizing,
    w: dict[str, Any],
    load_before: float,
    load_after: float,
    folder: Path,
) -> dict[str, Any]:
    secs = w["window_s"]
    (g0, g1), (s0, s1) = w["groups"], w["sims"]
    generated = sum(v["generated"] for k, v in s1.items() if k.startswith("rollout")) - sum(
        v["generated"] for k, v in s0.items() if k.startswith("rollout")
    )
    traj_bytes = next(v["trajectory_bytes"] for k, v in s1.items() if k.startswith("rollout"))
    handled = {s: g1[s]["handled"] - g0[s]["handled"] for s in probes.GROUPS}
    rates = {
        "capacity": fm.trajectories_per_s(num_gpus, spec),
        "generated": generated / secs,
        "scored": handled["trajectories"] / secs,
        "stored": handled["scored"] / secs,
        "batched": (g1["batches"]["added"] - g0["batches"]["added"]) * sizing.batch_samples / secs,
        "trained": handled["batches"] * sizing.batch_samples / secs,
    }
    growth = {s: fm.backlog_growth([(row[0], row[1 + i]) for row in w["series"]]) for i, s in enumerate(probes.GROUPS)}
    judged = {s: g for s, g in growth.items() if s in JUDGED_BACKLOGS}
    problems = list(w["problems"]) + ([f"{w['dead_letters']} dead letters"] if w["dead_letters"] else [])
    verdict = fm.judge(
        utilization=rates["generated"] / rates["capacity"], growth=judged, handled=handled, problems=problems
    )
    cores = {k: round(v, 3) for k, v in w["cores"].items()}
    sims = sum(v for k, v in cores.items() if k.startswith("rollout_sim"))
    cores = {**{k: v for k, v in cores.items() if not k.startswith("rollout_sim")}, "rollout_sims": round(sims, 3)}
    cores["interrupts"] = round(w["interrupt_cores"], 3)
    cores["others"] = round(max(0.0, w["machine_cores"] - sum(cores.values())), 3)
    per_traj = max(rates["stored"], 1e-9)
    result = {
        "num_gpus": num_gpus,
        "h200_equivalents_offered": round(fm.h200_equivalents(rates["capacity"], spec), 1),
        "h200_equivalents_achieved": round(fm.h200_equivalents(rates["stored"], spec), 1),
        "sustained": verdict.sustained,
        "reasons": verdict.reasons,
        "sizing": asdict(sizing),
        "window_s": round(secs, 1),
        "load_1m_before": round(load_before, 2),
        "load_1m_after": round(load_after, 2),
        "rates_per_s": {k: round(v, 2) for k, v in rates.items()},
        "utilization": round(rates["generated"] / rates["capacity"], 4),
        "trajectory_bytes": traj_bytes,
        "batch_mb": round(sizing.batch_samples * traj_bytes / 2**20, 1),
        "mb_per_s": {
            "trajectories": round(rates["generated"] * traj_bytes / 2**20, 1),
            "redis_in": round(w["redis_net"]["total_net_input_bytes"] / secs / 2**20, 1),
            "redis_out": round(w["redis_net"]["total_net_output_bytes"] / secs / 2**20, 1),
        },
        "backlog_growth": {k: round(v, 1) for k, v in growth.items()},
        "handled": handled,
        "backlog_series": {"columns": ["t_s", *probes.GROUPS], "rows": w["series"]},
        "cpu_cores": cores,
        "cpu_ms_per_trajectory": {k: round(1e3 * v / per_traj, 3) for k, v in cores.items()},
        "bottleneck": fm.bottleneck(cores, os.cpu_count() or 1, SINGLE_THREADED),
        "redis_memory_mb_max": round(w["redis_memory_mb_max"], 1),
        "rss_mb_max": {k: round(v, 1) for k, v in w["rss_mb_max"].items()},
        "redis_commands_top": {
            k: {"calls_per_s": round(c / secs, 1), "ms_per_s": round(u / 1e3 / secs, 1)}
            for k, (c, u) in sorted(w["redis_commands"].items(), key=lambda kv: -kv[1][1])[:12]
        },
        "redis_slow_commands": w["slow_commands"],
        "redis_command_p99_ms": {k: v["p99"] for k, v in sorted(w["latencies"].items(), key=lambda kv: -kv[1]["p99"])},
        "redis_p99_max_ms": max((v["p99"] for v in w["latencies"].values()), default=0.0),
        "coordinator_counters": w["counters"],
        "logs": str(folder),
    }
    print(
        f"   {'SUSTAINED' if verdict.sustained else 'NOT sustained'}: generated {rates['generated']:.1f}/s of "
        f"{rates['capacity']:.1f}, stored {rates['stored']:.1f}/s, cores {cores}, slowest command p99 "
        f"{result['redis_p99_max_ms']} ms; {'; '.join(verdict.reasons)}",
        flush=True,
    )
    return result


# -- the sweep -------------------------------------------------------------------------------------------
def round_gpus(n: float, per_worker: int) -> int:
    return max(per_worker, round(n / per_worker) * per_worker)


def sweep(
    args: argparse.Namespace, spec: fm.FleetSpec, task: tuple[Path, Path], logs: Path, deadline: float
) -> list[dict[str, Any]]:
    """Explicit ``--sizes``, or doubling from ``--start`` until a step fails, then ``--refine`` bisections."""
    steps: list[dict[str, Any]] = []
    if args.sizes:
        return [
            run_step(round_gpus(int(n), args.gpus_per_worker), args, spec, task, logs) for n in args.sizes.split(",")
        ]
    good, bad = 0, 0
    n = round_gpus(args.start, args.gpus_per_worker)
    while n <= args.max_gpus and time.monotonic() < deadline:
        steps.append(run_step(n, args, spec, task, logs))
        if not steps[-1]["sustained"]:
            bad = n
            break
        good, n = n, 2 * n
    if bad and not good:  # the first size failed: go down
        while bad > args.gpus_per_worker and not good and time.monotonic() < deadline:
            n = round_gpus(bad / 2, args.gpus_per_worker)
            steps.append(run_step(n, args, spec, task, logs))
            good, bad = (n, bad) if steps[-1]["sustained"] else (0, n)
    for _ in range(args.refine):
        n = round_gpus((good + bad) / 2, args.gpus_per_worker)
        if not good or not bad or n in (good, bad) or time.monotonic() >= deadline:
            break
        steps.append(run_step(n, args, spec, task, logs))
        good, bad = (n, bad) if steps[-1]["sustained"] else (good, n)
    return steps


def disturbance(step: dict[str, Any]) -> tuple[float, float]:
    """How much other people's work disturbed a step: their cores in its window, then the load at its start."""
    return step.get("cpu_cores", {}).get("others", 0.0), step.get("load_1m_before", 0.0)


def largest(steps: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The largest sustained step; a size measured twice counts by its less disturbed measurement."""
    cleanest: dict[int, dict[str, Any]] = {}
    for step in steps:
        seen = cleanest.get(step["num_gpus"])
        if not step.get("diagnostic") and (seen is None or disturbance(step) < disturbance(seen)):
            cleanest[step["num_gpus"]] = step
    ok = [s for s in cleanest.values() if s["sustained"]]
    return max(ok, key=lambda s: s["num_gpus"]) if ok else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke check: one small fleet, a 20 s window")
    parser.add_argument("--sizes", default="", help="fleet sizes (GPUs) to run, comma-separated; default: search")
    parser.add_argument("--start", type=int, default=256, help="search: first fleet size (GPUs)")
    parser.add_argument("--max-gpus", type=int, default=8192, help="search: largest fleet size tried")
    parser.add_argument(
        "--refine", type=int, default=2, help="search: bisections between the last good and first bad size"
    )
    parser.add_argument("--window-s", type=float, default=45.0, help="measured window per step (s)")
    parser.add_argument(
        "--warmup-s", type=float, default=0.0, help="warm-up before the window (s); 0 = generation time + 10"
    )
    parser.add_argument(
        "--quiet-wait-s",
        type=float,
        default=45.0,
        help="before each step, wait up to this long for other work on the machine to drop under 0.25 cores",
    )
    parser.add_argument("--budget-s", type=float, default=540.0, help="search: no new step starts after this (s)")
    parser.add_argument("--tokens-per-s", type=float, default=fm.H200_TOKENS_PER_S, help="per simulated GPU")
    parser.add_argument("--response-tokens", type=int, default=8192)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--seqs-per-gpu", type=int, default=8, help="sequences a simulated GPU decodes at once")
    parser.add_argument("--gpus-per-worker", type=int, default=8, help="simulated GPUs behind one rollout consumer")
    parser.add_argument("--sim-procs", type=int, default=0, help="processes for the rollout simulators; 0 = auto")
    parser.add_argument("--max-staleness", type=int, default=8)
    parser.add_argument("--learner-step-s", type=float, default=2.0, help="simulated learner step (s)")
    parser.add_argument("--max-redis-gb", type=float, default=4.0, help="a step whose Redis grows past this fails")
    parser.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        default="uvloop",
        help="the event loop of every process (STREAMRL_EVENT_LOOP)",
    )
    parser.add_argument(
        "--per-gpu-consumers",
        type=int,
        default=128,
        help="then run this many GPUs with one rollout consumer each (their own Redis traffic); 0 = skip",
    )
    parser.add_argument(
        "--no-profile",
        dest="profile",
        action="store_false",
        help="skip the extra step that profiles the coordinator at the largest sustained size",
    )
    parser.add_argument("--out", default="", help="result file (default bench/results/fleet-<date>.json)")
    args = parser.parse_args()
    os.environ[EVENT_LOOP_ENV] = args.event_loop
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: every step's finally stops its processes
    if args.quick:
        args.sizes, args.window_s, args.refine, args.profile = args.sizes or "64", min(args.window_s, 20.0), 0, False
        args.per_gpu_consumers, args.quiet_wait_s = 0, 0.0
    spec = fm.FleetSpec(
        tokens_per_s=args.tokens_per_s,
        response_tokens=args.response_tokens,
        prompt_tokens=args.prompt_tokens,
        group_size=args.group_size,
        seqs_per_gpu=args.seqs_per_gpu,
    )
    now = datetime.now(timezone.utc)
    started, load_start = time.monotonic(), os.getloadavg()[0]
    logs = Path(tempfile.gettempdir()) / f"streamrl-fleet-{now:%Y%m%d-%H%M%S}"
    logs.mkdir(parents=True)
    task = build_task(logs, spec)
    steps = sweep(args, spec, task, logs, started + args.budget_s)
    best = largest(steps)
    if (
        best is not None
        and best["load_1m_before"] > 1.5
        and best["other_cores_before"] >= QUIET_CORES
        and not args.quick
    ):
        print(
            f"-- load was {best['load_1m_before']} at the start of {best['num_gpus']} GPUs: measuring it again",
            flush=True,
        )
        steps.append({**run_step(best["num_gpus"], args, spec, task, logs), "rerun": True})
        best = largest(steps)
    if args.per_gpu_consumers:
        n = args.per_gpu_consumers
        print(f"-- {n} GPUs with one rollout consumer per GPU (not judged)", flush=True)
        one = argparse.Namespace(**{**vars(args), "gpus_per_worker": 1})
        step = run_step(n, one, spec, task, logs)
        steps.append({**step, "diagnostic": "one consumer per GPU", "reclaim": reclaim_cost(step, n, logs)})
    if best is not None and args.profile:
        print(f"-- {best['num_gpus']} GPUs again with the coordinator under cProfile (not judged)", flush=True)
        steps.append({**run_step(best["num_gpus"], args, spec, task, logs, profile=True), "diagnostic": "profile"})
    costs = payload_costs(logs / "payload-costs", spec) if steps and not args.quick else None
    report(args, spec, steps, best, now, load_start, time.monotonic() - started, logs, costs)


def reclaim_cost(step: dict[str, Any], consumers: int, logs: Path) -> dict[str, Any]:
    """The consumers' look for dead peers (``ConsumerLoop._reclaim_from_the_dead``): every claim_interval_s
    each consumer reads XINFO CONSUMERS and sends one EXISTS per other consumer holding entries, so the
    group sends ``W (W - 1) / claim_interval_s`` EXISTS per second: measured here, projected from the
    Redis CPU of one round trip."""
    interval_s = ConsumerConfig().claim_interval_s
    trip = probes.round_trip_cost(logs / "round-trip")
    commands = step.get("redis_commands_top", {})
    projection = {}
    for w in sorted({consumers, 500, 1000, 2000}):
        rate = w * (w - 1) / interval_s
        projection[str(w)] = {
            "exists_per_s": round(rate),
            "redis_cores": round(rate * trip["redis_us_per_request"] / 1e6, 2),
        }
    return {
        "where": "streamrl.common.consumer.ConsumerLoop._reclaim_from_the_dead: one EXISTS round trip per peer",
        "consumers": consumers,
        "claim_interval_s": interval_s,
        "exists_per_s_measured": commands.get("exists", {}).get("calls_per_s"),
        "exists_per_s_expected": round(consumers * (consumers - 1) / interval_s),
        "xinfo_consumers_per_s_measured": commands.get("xinfo|consumers", {}).get("calls_per_s"),
        "round_trip": trip,
        "projection": projection,
    }


def ceilings(steps: list[dict[str, Any]], spec: fm.FleetSpec) -> dict[str, dict[str, Any]]:
    """Each one-process component's CPU fitted over the judged steps as ``fixed + per trajectory x rate``,
    and the rate (and H200-equivalents) at which it would fill one core of its own."""
    measured = [s for s in steps if "cpu_cores" in s and not s.get("diagnostic")]
    out: dict[str, dict[str, Any]] = {}
    for name in sorted(SINGLE_THREADED):
        fit = fm.linear_fit([(s["rates_per_s"]["stored"], s["cpu_cores"][name]) for s in measured])
        if fit is None:
            continue
        rate = fm.core_ceiling(*fit)
        out[name] = {
            "fixed_cores": round(fit[0], 3),
            "ms_per_trajectory": round(1e3 * fit[1], 3),
            "steps": len(measured),
            "one_core_trajectories_per_s": round(rate, 1) if rate else None,
            "one_core_h200_equivalents": round(fm.h200_equivalents(rate, spec)) if rate else None,
        }
    return out


def report(
    args: argparse.Namespace,
    spec: fm.FleetSpec,
    steps: list[dict[str, Any]],
    best: dict[str, Any] | None,
    now: datetime,
    load_start: float,
    wall_s: float,
    logs: Path,
    costs: dict[str, Any] | None,
) -> None:
    judged = [s for s in steps if not s.get("diagnostic")]
    first_bad = min((s for s in judged if not s["sustained"]), key=lambda s: s["num_gpus"], default=None)
    profiled = next((s["coordinator_profile"] for s in steps if "coordinator_profile" in s), None)
    target = 1000.0
    achieved = best["h200_equivalents_offered"] if best else 0.0
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    summary = {
        "bench": "fleet",
        "date": now.isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()}, nproc {os.cpu_count()}, Python {platform.python_version()}",
        "load_1m_at_start": round(load_start, 2),
        "commit": commit,
        "command": " ".join(["python", "bench/fleet.py", *sys.argv[1:]]),
        "wall_s": round(wall_s, 1),
        "spec": {
            **asdict(spec),
            "generation_s": spec.generation_s,
            "gpus_per_worker": args.gpus_per_worker,
            "h200_tokens_per_s_assumed": fm.H200_TOKENS_PER_S,
            "max_staleness": args.max_staleness,
            "learner_step_s": args.learner_step_s,
        },
        "criterion": (
            f"sustained: simulated GPUs finish >= {fm.MIN_UTILIZATION:.0%} of capacity in the window; the "
            f"backlog (undelivered + pending) of {', '.join(JUDGED_BACKLOGS)} grows by <= "
            f"{fm.MAX_BACKLOG_GROWTH:.0%} of what its group handled, or 1 entry (least-squares over 2 s "
            "samples); no process dead, no dead letter, redis under --max-redis-gb"
        ),
        "largest_sustained_gpus": best["num_gpus"] if best else 0,
        "largest_sustained_h200_equivalents": achieved,
        "largest_sustained_trajectories_per_s": best["rates_per_s"]["stored"] if best else 0.0,
        "target_h200_equivalents": target,
        "target_met": achieved >= target,
        "short_of_target_factor": round(target / achieved, 2) if 0 < achieved < target else None,
        "first_failing_gpus": first_bad["num_gpus"] if first_bad else None,
        "what_breaks_first": (first_bad.get("bottleneck", "") + "; " + "; ".join(first_bad["reasons"]))
        if first_bad
        else None,
        "single_core_ceilings": ceilings(steps, spec),
        "coordinator_profile": profiled,
        "redis_payload_costs": costs,
        "steps": steps,
        "logs": str(logs),
    }
    RESULTS.mkdir(exist_ok=True)
    out = Path(args.out) if args.out else RESULTS / f"fleet-{now:%Y%m%d-%H%M%S}.json"
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "steps"} | {"file": str(out)}))


if __name__ == "__main__":
    main()
