"""How soon the transformers engine serves new weights that arrive during a long decode, with and without
``rollout.engine.partial_rollout``.

Two random Qwen2 checkpoints of one shape (A: the engine's, B: the update; ``--size``) and a
:class:`ZmqPublisher` on this machine (ZMQ, the hf engine's portable path). Per mode (``partial_rollout``
false, then true) an engine is built on A and warmed up, then ``--repeats`` times:

* one ``generate`` of ``--prompts`` random prompts x ``--samples`` samples x exactly ``--new-tokens``
  new tokens (``min_new_tokens = max_new_tokens``, temperature 1) starts; at ``--at`` of the decode's
  length (measured first, without an update) the next version is published and ``update_weights``
  called, and right after it a 1-token request is submitted;
* ``applied_ms``: the update's arrival -> ``update_weights`` returned (the transfer included): the
  next decode step runs under the new weights;
* ``running_first_new_token_ms``: arrival -> the first token of the running decode under the new
  version - with partial_rollout ``applied_ms`` + one decode step (the decode's mean step), and the
  switch token recorded in the samples (``Sample.versions``) is reported; without it the running
  decode never serves the new version (null);
* ``new_request_first_token_ms``: arrival -> the 1-token request's answer (which records the new
  version: it waits for the update in both modes);
* ``decode_s``: the long call's own time with the update inside it (``decode_s_no_update`` is the
  same call without one);
* ``transfer_ms``: an update while the engine is idle (pull + verify + load).

Medians over the repeats. Sizes: ``tiny`` (hidden 128, 2 layers), ``25m`` (hidden 512, 8 layers),
``0.5b`` (Qwen2-0.5B-shaped: hidden 896, 24 layers, 14 heads, 2 KV heads, vocab 151,936; bf16 on CUDA)::

    python bench/partial_rollout.py [--device cpu|cuda] [--size 25m] [--prompts 2] [--samples 2] [--new-tokens 512]
    python bench/partial_rollout.py --device cuda --size 0.5b --prompts 64 --samples 8 --new-tokens 512

Prints a table, then one JSON object last, and writes it to ``bench/results/`` (or ``--out``, else ``$OUT``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for src in ("libs/common/src", "libs/torchkit/src", "services/learner/src", "services/rollout/src"):
    if str(ROOT / src) not in sys.path:
        sys.path.insert(0, str(ROOT / src))

import torch  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2},
    "25m": {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8, "num_attention_heads": 8},
    "0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151_936,
    },
}


def _build(folder: Path, size: str, seed: int, dtype: torch.dtype) -> None:
    """A random Qwen2 of ``size`` with the test tokenizer (ids past its vocabulary decode to '')."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from streamrl.torchkit.testing import build_tokenizer

    vocab, eos = build_tokenizer(folder)
    shape = {"vocab_size": vocab, "num_key_value_heads": 1, **SHAPES[size]}
    config = Qwen2Config(**shape, tie_word_embeddings=True, max_position_embeddings=4096, eos_token_id=eos)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(dtype)
    model.generation_config.eos_token_id = eos
    model.save_pretrained(folder)


def _prompts(count: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, min(vocab, 380), (16,), generator=gen).tolist() for _ in range(count)]


async def _once(
    engine: Any, server: Any, models: list[Any], version: int, args: argparse.Namespace, at_s: float
) -> dict[str, Any]:
    """One long decode with an update (``version``) arriving ``at_s`` into it."""
    from streamrl.common.messages import SamplingParams
    from streamrl.rollout.engines.engine import GenerationRequest

    long = SamplingParams(
        temperature=1.0, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, n=args.samples, seed=version
    )
    from streamrl.torchkit.testing import weights_event

    published = server.publish(models[version % 2].items(), version=version)
    checksum = published["checksum"]
    start = time.perf_counter()
    running = asyncio.create_task(engine.generate([GenerationRequest(p, long) for p in args.prompt_ids]))
    await asyncio.sleep(at_s)
    assert not running.done(), "the decode ended before the update: raise --new-tokens or lower --at"
    arrival = time.perf_counter()
    update = asyncio.create_task(
        engine.update_weights(weights_event(version, endpoint=server.endpoint, checksum=checksum), 600)
    )
    await asyncio.sleep(0)  # the update is queued first
    probe = asyncio.create_task(
        engine.generate([GenerationRequest(args.prompt_ids[0], SamplingParams(max_new_tokens=1))])
    )
    await update
    applied = time.perf_counter()
    ((first,),) = await probe
    probed = time.perf_counter()
    results = await running
    ended = time.perf_counter()
    assert first.version_start == version, f"the probe ran under version {first.version_start}, not {version}"
    samples = [s for group in results for s in group]
    switches = [s.versions[1][0] if s.versions else None for s in samples]
    return {
        "applied_ms": (applied - arrival) * 1e3,
        "new_request_first_token_ms": (probed - arrival) * 1e3,
        "decode_s": ended - start,
        "switch_tokens": switches,
        "served_in_running": all(s.version_end == version for s in samples),
    }


async def _mode(partial: bool, args: argparse.Namespace, folder: Path, models: list[Any]) -> dict[str, Any]:
    from streamrl.common.messages import SamplingParams
    from streamrl.rollout.engines.config import EngineConfig
    from streamrl.rollout.engines.engine import GenerationRequest
    from streamrl.rollout.engines.hf_engine import HFEngine
    from streamrl.torchkit.testing import weights_event
    from streamrl.torchkit.weights.zmq import ZmqPublisher

    config = EngineConfig(
        type="hf",
        model=str(folder),
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.new_tokens + 64,
        max_num_seqs=args.prompts * args.samples + 1,  # a free slot for the 1-token request
        partial_rollout=partial,
    )
    engine = HFEngine(config)
    server = ZmqPublisher()
    try:
        long = SamplingParams(
            temperature=1.0, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, n=args.samples
        )
        requests = [GenerationRequest(p, long) for p in args.prompt_ids]
        await engine.generate(requests)  # warm-up (on CUDA: captures the decode graphs)
        start = time.perf_counter()
        await engine.generate(requests)
        decode_s = time.perf_counter() - start
        published = server.publish(models[1].items(), version=1)
        checksum = published["checksum"]
        start = time.perf_counter()
        await engine.update_weights(weights_event(1, endpoint=server.endpoint, checksum=checksum), 600)
        transfer_ms = (time.perf_counter() - start) * 1e3
        runs = [await _once(engine, server, models, v, args, args.at * decode_s) for v in range(2, 2 + args.repeats)]
    finally:
        engine.close()
        server.close()
    step_ms = decode_s / args.new_tokens * 1e3
    median = {
        k: statistics.median(r[k] for r in runs) for k in ("applied_ms", "new_request_first_token_ms", "decode_s")
    }
    return {
        "partial_rollout": partial,
        "decode_s_no_update": decode_s,
        "step_ms": step_ms,
        "transfer_ms": transfer_ms,
        **median,
        "running_first_new_token_ms": median["applied_ms"] + step_ms if partial else None,
        "served_in_running": [r["served_in_running"] for r in runs],
        "switch_tokens": [sorted(set(r["switch_tokens"]), key=str) for r in runs],
        "runs": [{k: v for k, v in r.items() if k != "switch_tokens"} for r in runs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--size", choices=sorted(SHAPES), default="25m")
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default=None, help="default: bf16 on CUDA, else float32"
    )
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--at", type=float, default=0.25, help="the update arrives this fraction into the decode")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        folders = [Path(tmp) / name for name in ("a", "b")]
        for seed, folder in enumerate(folders):
            _build(folder, args.size, seed, dtype)
        from transformers import AutoModelForCausalLM

        models = [AutoModelForCausalLM.from_pretrained(f, dtype=dtype).state_dict() for f in folders]
        parameters = sum(t.numel() for k, t in models[0].items() if k != "lm_head.weight")
        args.prompt_ids = _prompts(args.prompts, 384)
        modes = [asyncio.run(_mode(partial, args, folders[0], models)) for partial in (False, True)]
    print(
        f"{'partial_rollout':>16} {'applied ms':>11} {'running 1st new tok ms':>23} {'new request ms':>15} {'decode s':>9} {'step ms':>8}"
    )
    for m in modes:
        running = "-" if m["running_first_new_token_ms"] is None else f"{m['running_first_new_token_ms']:.1f}"
        print(
            f"{m['partial_rollout']!s:>16} {m['applied_ms']:>11.1f} {running:>23} "
            f"{m['new_request_first_token_ms']:>15.1f} {m['decode_s']:>9.2f} {m['step_ms']:>8.2f}"
        )
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H%M%S")
    result = {
        "bench": "partial_rollout",
        "date": stamp,
        "machine": f"{platform.node()} {platform.processor() or platform.machine()} "
        f"{os.cpu_count()} cpus" + (f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""),
        "command": "python " + " ".join(sys.argv),
        "torch": torch.__version__,
        "size": args.size,
        "parameters": parameters,
        "dtype": args.dtype,
        "device": args.device,
        "batch": {"prompts": args.prompts, "samples": args.samples, "new_tokens": args.new_tokens, "at": args.at},
        "modes": modes,
    }
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench" / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"partial_rollout-{args.device}-{args.size}-{stamp}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
