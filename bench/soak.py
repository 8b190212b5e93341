"""Soak: the demo recipe under a steady drizzle of ambiguous faults; nothing lost, nothing twice, Redis flat.

    python bench/soak.py [--minutes 30] [--kill-every-s 120] [--loss 0.01] [--engine vllm|hf]

Off CI (30 minutes by default). It prepares the arithmetic task if ``runs/arith_a`` is missing
(examples/arithmetic/prepare.py recipes/demo.toml, as ``make demo``), then runs ``recipes/demo.toml``
with the fault suite's harness (tests/faults/harness.py: a real redis-server with AOF, each service
its own process, restarted like an orchestrator would) and, for ``--minutes``:

* every service reaches Redis through the fault proxy (tests/faults/redis_proxy.py), which loses a
  random ``--loss`` fraction of the replies of every write (the command ran; the client re-sends it);
* every ``--kill-every-s`` seconds one service is SIGKILLed, in turn coordinator, rollout, reward,
  learner, and started again under its name one second later;
* Redis's ``used_memory`` (and the streams' lengths, the policy version) is sampled every
  ``--sample-s`` seconds.

Then the faults stop and the coordinator and the learner (SIGTERM: it drains) are restarted with
``total_steps`` a few steps ahead, so the run ends on its own; it is counted from every entry written (the harness's stream tap) like a
fault-suite row: issued, trained, dropped with reason, lost, trained twice, pending at the end,
steps, and the recovery after each kill (restart to the next trained batch). The maximum of
``used_memory`` is compared with the run's stated bound when libs/common has one
(``streamrl.ops.memory_budget``), else reported alone.

Writes ``bench/results/soak-<date>.json`` (settings, machine, command, the row, the kills, every
memory sample) and ``soak-<date>.png`` (used memory and policy version over time, the kills
marked). The service logs stay under the ``workdir`` named in the JSON. Last line: one JSON object.
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
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import tomllib

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "faults"))

import redis as syncredis  # noqa: E402
from harness import SERVICES, FaultRun  # noqa: E402
from redis_proxy import LoseRandom  # noqa: E402
from scenario import ROWS, Row, record  # noqa: E402

from streamrl.common.codec import decode  # noqa: E402
from streamrl.common.errors import PoisonMessageError  # noqa: E402
from streamrl.common.messages import WeightsPublished  # noqa: E402

RESULTS = ROOT / "bench" / "results"
RECIPE = ROOT / "recipes" / "demo.toml"
TASK = ROOT / "runs" / "arith_a"
ENDLESS_STEPS = 1_000_000
"""``total_steps`` while the faults go on; the coordinator's last restart sets the real end."""
DRAIN_STEPS = 5
"""Steps the run goes on after the faults stop, before it ends."""
END_TIMEOUT_S = 900.0
START_TIMEOUT_S = 900.0
"""Until the first version is published (vLLM's start, the learner's compile on a busy machine)."""


@dataclass
class Kill:
    service: str
    at: float
    restarted_at: float
    version: int


def _prepare() -> None:
    if not (TASK / "model").exists():
        subprocess.run([sys.executable, "examples/arithmetic/prepare.py", str(RECIPE)], cwd=ROOT, check=True)


def _sample(run: FaultRun, client: syncredis.Redis) -> dict[str, Any] | None:
    n = run.names
    try:
        mem = client.info("memory")
        pipe = client.pipeline(transaction=False)
        for stream in (n.prompts, n.trajectories, n.scored, n.batches, n.weights, n.dead):
            pipe.xlen(stream)
        pipe.dbsize()
        *lengths, keys = pipe.execute()
    except (syncredis.ConnectionError, syncredis.TimeoutError):
        return None
    return {
        "t": round(time.time(), 2),
        "used_memory": int(mem["used_memory"]),
        "keys": int(keys),
        "version": run.version(),
        "stream_lengths": lengths,
    }


def _sampler(run: FaultRun, every_s: float, out: list[dict[str, Any]], stop: threading.Event) -> None:
    client = syncredis.Redis(port=run.port, socket_timeout=5)
    while not stop.wait(every_s):
        sample = _sample(run, client)
        if sample is not None:
            out.append(sample)
    client.close()


def _stated_bound(run: FaultRun, end_step: int) -> tuple[int | None, str]:
    """The bytes the run may hold in Redis by libs/common's formula (docs/operations.md) for the
    recipe as run, ``end_step`` steps long; and where it came from (or why there is none)."""
    try:
        from streamrl.ops import memory_budget
    except ImportError:
        return None, "no stated bound in this checkout (streamrl.ops.memory_budget is missing)"
    data = tomllib.loads(run.recipe.read_text())
    data["total_steps"] = end_step
    try:
        bound = memory_budget.memory_bound(memory_budget.shape_from_recipe(data))
    except ValueError as e:
        return None, f"memory_budget could not bound the recipe: {e}"
    return bound.total, f"streamrl.ops.memory_budget.memory_bound: {bound.describe()}"


def _recoveries(run: FaultRun, kills: list[Kill]) -> list[float | None]:
    """Per kill: seconds from its restart to the next trained batch."""
    published = []
    for _, payload in run.tap.entries(run.names.weights):
        try:
            ev = decode(payload, WeightsPublished)
        except PoisonMessageError:
            continue
        if ev.batch_id:
            published.append(ev.published_at)
    out: list[float | None] = []
    for k in kills:
        after = [t for t in published if t >= k.restarted_at]
        out.append(round(min(after) - k.restarted_at, 1) if after else None)
    return out


def _plot(samples: list[dict[str, Any]], kills: list[Kill], bound: int | None, t0: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    minutes = [(s["t"] - t0) / 60 for s in samples]
    ax.plot(minutes, [s["used_memory"] / 2**20 for s in samples], label="redis used_memory (MiB)", color="tab:blue")
    if bound is not None:
        ax.axhline(bound / 2**20, color="tab:red", linestyle="--", label="stated bound (MiB)")
    colors = dict(zip(SERVICES, ("tab:purple", "tab:green", "tab:orange", "tab:brown"), strict=True))
    for service in SERVICES:
        at = [(k.at - t0) / 60 for k in kills if k.service == service]
        if at:
            ax.vlines(
                at,
                0,
                1,
                transform=ax.get_xaxis_transform(),
                colors=colors[service],
                alpha=0.5,
                label=f"SIGKILL {service}",
            )
    ax.set_xlabel("minutes")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    twin = ax.twinx()
    twin.plot(minutes, [s["version"] for s in samples], color="gray", linewidth=0.8, label="policy version")
    twin.set_ylabel("policy version")
    lines = ax.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left", fontsize=8)
    ax.set_title("streamrl soak: demo recipe, lost replies + a SIGKILL every interval")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _soak(run: FaultRun, args: argparse.Namespace, samples: list[dict[str, Any]], kills: list[Kill]) -> Row:
    """Start the run, inject the faults for ``args.minutes``, end the run, count it (its row)."""
    proxy = run.proxy
    assert proxy is not None
    stop_sampling = threading.Event()
    sampler = threading.Thread(target=_sampler, args=(run, args.sample_s, samples, stop_sampling), daemon=True)
    error = ""
    try:
        run.start()
        sampler.start()
        run.wait_version(1, timeout_s=START_TIMEOUT_S)  # start-up (vLLM, the learner's compile) before a kill
        faults_end = time.time() + args.minutes * 60
        next_kill = time.time() + args.kill_every_s
        while time.time() < faults_end and not run.done.is_set():
            if time.time() >= next_kill:
                service = SERVICES[len(kills) % len(SERVICES)]
                version, at = run.version(), time.time()
                run.kill(f"{service}-0")
                time.sleep(1.0)
                run.start_service(service, f"{service}-0")
                kills.append(Kill(service, at, time.time(), version))
                print(f"soak: kill {len(kills)}: SIGKILL {service} at version {version}", flush=True)
                next_kill += args.kill_every_s
            time.sleep(0.5)
        proxy.set_policy(None)
        end_step = run.version() + DRAIN_STEPS
        print(f"soak: faults over at version {end_step - DRAIN_STEPS}; the run ends at {end_step}", flush=True)
        # the coordinator and the learner learn the real end (the learner's final checkpoint then covers, and
        # acknowledges, every batch it trained: without it the batches after its last periodic checkpoint stay
        # pending, to be replayed by a next life)
        run.kill("coordinator-0")
        run.start_service("coordinator", "coordinator-0", extra=[f"--total_steps={end_step}"])
        run.kill("learner-0", signal.SIGTERM)
        run.start_service("learner", "learner-0", extra=[f"--total_steps={end_step}"])
        completed = run.wait_done(END_TIMEOUT_S, stall_s=180)
    except AssertionError as e:
        completed, end_step, error = False, max(run.version(), 1), str(e)
    finally:
        stop_sampling.set()
    if not completed:
        run.dump_stacks()
    try:
        record(run, "soak", completed, end_step, 8, None, None, early_stop=error)
    except AssertionError:
        pass  # the row holds the failures
    return ROWS[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the faults go on")
    parser.add_argument("--kill-every-s", type=float, default=120.0, help="seconds between two SIGKILLs")
    parser.add_argument("--loss", type=float, default=0.01, help="fraction of write replies lost")
    parser.add_argument("--sample-s", type=float, default=3.0, help="seconds between two memory samples")
    parser.add_argument("--engine", choices=("vllm", "hf"), default="vllm", help="rollout engine (demo: vllm)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="--FIELD=VALUE",
        help="a recipe override for every service (repeatable), e.g. --override=--learner.ds.compile=false",
    )
    args = parser.parse_args()
    if args.minutes <= 0 or args.kill_every_s <= 0 or args.sample_s <= 0:
        parser.error("--minutes, --kill-every-s and --sample-s must be positive")
    if not 0 <= args.loss <= 1:
        parser.error(f"--loss must be a fraction in [0, 1], got {args.loss}")

    now = datetime.now(timezone.utc)
    stamp = f"{now:%Y%m%d-%H%M%S}"
    workdir = Path(tempfile.gettempdir()) / f"streamrl-soak-{stamp}"
    _prepare()
    overrides = [f"--total_steps={ENDLESS_STEPS}", *(["--rollout.engine.type=hf"] if args.engine == "hf" else [])]
    overrides += args.override
    run = FaultRun("soak", TASK, workdir, recipe_source=RECIPE, base_overrides=overrides, slim_tap=True)
    proxy = run.use_proxy()
    proxy.set_policy(LoseRandom(args.loss, seed=args.seed))
    samples: list[dict[str, Any]] = []
    kills: list[Kill] = []
    try:
        row = _soak(run, args, samples, kills)
        bound, bound_source = _stated_bound(run, row.total_steps)
    finally:
        run.close()  # no process left behind, whatever happened (Ctrl-C included)

    recoveries = _recoveries(run, kills)
    max_used = max((s["used_memory"] for s in samples), default=0)
    t0 = run.started_at
    RESULTS.mkdir(exist_ok=True)
    png = RESULTS / f"soak-{stamp}.png"
    if samples:
        _plot(samples, kills, bound, t0, png)
    c = row.counts
    summary = {
        "bench": "soak",
        "date": now.isoformat(timespec="seconds"),
        "minutes": args.minutes,
        "ok": not row.failures and (bound is None or max_used <= bound),
        "issued": c.issued,
        "trained": c.trained,
        "lost": c.lost,
        "trained_twice": c.trained_twice,
        "pending_end": c.pending_end,
        "steps": c.steps,
        "kills": len(kills),
        "replies_lost": len(proxy.lost),
        "version_at_first_kill": kills[0].version if kills else None,
        "max_used_memory": max_used,
        "bound": bound,
        "max_recovery_s": max((r for r in recoveries if r is not None), default=None),
        "plot": str(png.relative_to(ROOT)) if samples else None,
    }
    result = {
        **summary,
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}",
        "command": " ".join(["python", "bench/soak.py", *sys.argv[1:]]),
        "settings": {**vars(args), "recipe": str(RECIPE.relative_to(ROOT)), "drain_steps": DRAIN_STEPS},
        "workdir": str(workdir),
        "bound_source": bound_source,
        "row": row.to_json(),
        "kills": [{**vars(k), "recovery_s": r} for k, r in zip(kills, recoveries, strict=True)],
        "replies_lost_by_kind": proxy.lost_by_kind(),
        "samples": samples,
    }
    out = RESULTS / f"soak-{stamp}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"soak: {'ok' if summary['ok'] else 'FAILED: ' + '; '.join(row.failures + c.notes)}", flush=True)
    print(json.dumps({**summary, "file": str(out.relative_to(ROOT))}))


if __name__ == "__main__":
    main()
