"""How much smaller a delta weight sync is than the full weights, on weights from real RL steps.

    OMP_NUM_THREADS=1 python bench/weights_delta.py [--model runs/arith_a/model --data runs/arith_a/train.jsonl]
        [--steps 24] [--warmup 8] [--speed-mb 512]

Needs the demo's warm-started policy and data (``python examples/arithmetic/prepare.py
recipes/demo.toml`` writes ``runs/arith_a``).

Weights: GRPO on the demo's arithmetic task from that warm start, one run per setting below, each
step real: 32 prompts x 8 samples from the current published weights (temperature 1, 6 new
tokens), the task's reward function, the learner's own GRPO advantages and PPO-clip loss
(``streamrl.learner.rl.algo``, token-mean), gradient clipping at 1.0, then torch AdamW (eps 1e-8,
no weight decay). What is measured is what the learner publishes after each step:

* ``demo``: ``recipes/demo.toml`` (lr 1e-4, betas 0.9/0.999, fp32 learner). The demo publishes
  fp32; ``bf16`` is the cast of those fp32 weights (what a bf16 publish would send), ``fp32`` the
  weights it really sends.
* ``gpu_arithmetic`` (lr 5e-6) and ``gpu_7b_full`` (lr 1e-6), betas 0.9/0.95 (the learner's
  default): DeepSpeed's bf16 mixed precision on the CPU - the forward and backward run on the bf16
  model, fp32 master weights take the AdamW step, and the bf16 model is the master cast
  (round-to-nearest-even), which is what those recipes publish.

The model is the demo's tiny Llama (0.66M parameters, hidden 128), not the GPU recipes'
Qwen2-0.5B / 7B shapes: the learning rate and bf16 spacing are theirs, the weights are not (the
changed fraction depends on each weight's magnitude against its bf16 spacing; the same init scale,
0.02, as the Qwen2 builders).

Per kind of tensor (``by_kind_k1``): its elements, its median |w| at the warm start (a N(0, 0.02)
init has 0.0135) and its changed fraction per step. For k = 1, 2, 4 versions behind, over the versions after ``--warmup`` steps: the changed fraction
and ``delta_bytes_ratio`` (full bytes / wire bytes of :func:`streamrl.torchkit.delta.delta_to_bytes`,
header included; ``uncompressed_*`` without its zlib stage) for one direct delta v-k -> v and for the chain of k single-step deltas; and per
candidate encoding (``candidates_*``): each index encoding (idx32 / gaps / bitmask / dense) with each
value coding (raw / diff) alone, the per-tensor choice, the chosen delta's bytes through zlib level
1, and the XOR of all words through zlib level 1.
Speed: encode, serialise, parse + apply, verify, on a ``--speed-mb`` bf16 set with the changed
fraction measured at the ``gpu_arithmetic`` lr, one ulp at random positions, in CPU seconds (process
time, one thread: less sensitive than wall time to other jobs on the machine) per GB of full weights.

Prints a table, then one JSON line last; writes the JSON to ``bench/results/weights_delta-<date>.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import zlib
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "arithmetic"))

import task as task_lib  # noqa: E402

from streamrl.learner.rl.algo.advantages import grpo_scores  # noqa: E402
from streamrl.learner.rl.algo.losses import aggregate, ppo_clip_loss  # noqa: E402
from streamrl.torchkit.delta import (  # noqa: E402
    ENCODINGS,
    VALUE_CODINGS,
    Delta,
    apply_delta,
    delta_from_bytes,
    delta_to_bytes,
    encode_delta,
    weights_digest,
)

SETTINGS = {
    "demo": {"lr": 1e-4, "betas": (0.9, 0.999), "bf16_learner": False, "recipe": "recipes/demo.toml"},
    "gpu_arithmetic": {"lr": 5e-6, "betas": (0.9, 0.95), "bf16_learner": True, "recipe": "recipes/gpu_arithmetic.toml"},
    "gpu_7b_full": {"lr": 1e-6, "betas": (0.9, 0.95), "bf16_learner": True, "recipe": "recipes/gpu_7b_full.toml"},
}
PROMPTS_PER_STEP, GROUP_SIZE, MAX_NEW_TOKENS, GRAD_CLIP = 32, 8, 6, 1.0
Weights = dict[str, torch.Tensor]


def _sample(
    model: Any, tokenizer: Any, rows: list[dict[str, str]]
) -> tuple[torch.Tensor, torch.Tensor, int, list[float]]:
    """GROUP_SIZE samples per prompt; returns sequences, response mask, prompt width, rewards."""
    prompts = [r["prompt"] for r in rows for _ in range(GROUP_SIZE)]
    labels = [r["label"] for r in rows for _ in range(GROUP_SIZE)]
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        seqs = model.generate(
            **enc,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            max_new_tokens=MAX_NEW_TOKENS,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    width = enc["input_ids"].shape[1]
    response = seqs[:, width:]
    # response tokens up to and including the first end-of-sequence
    ended = torch.cumsum((response == tokenizer.eos_token_id).int(), dim=1)
    mask = (ended - (response == tokenizer.eos_token_id).int()) == 0
    texts = [tokenizer.decode(r[m], skip_special_tokens=True) for r, m in zip(response, mask, strict=True)]
    rewards = task_lib.reward_func([p + t for p, t in zip(prompts, texts, strict=True)], prompts, labels)["rewards"]
    attention = torch.cat([enc["attention_mask"], mask.long()], dim=1)
    return seqs, attention, width, rewards


def _train(
    model_dir: Path, rows: list[dict[str, str]], setting: dict[str, Any], steps: int, seed: int
) -> list[Weights]:
    """Published weights after each step (index 0 = the warm start), bf16 and fp32 keys both."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    master = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = master
    if setting["bf16_learner"]:  # DeepSpeed bf16: bf16 module, fp32 master copies stepped by the optimizer
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(torch.bfloat16)
        with torch.no_grad():
            for p, q in zip(model.parameters(), master.parameters(), strict=True):
                p.copy_(q)
    params = dict(master.named_parameters())
    optimizer = torch.optim.AdamW(params.values(), lr=setting["lr"], betas=setting["betas"], eps=1e-8, weight_decay=0.0)

    def publish() -> Weights:
        out = {f"bf16/{n}": p.detach().to(torch.bfloat16).clone() for n, p in model.named_parameters()}
        out |= {f"fp32/{n}": p.detach().clone() for n, p in master.named_parameters()}
        return out

    published = [publish()]
    rng = np.random.default_rng(seed)
    for step in range(steps):
        batch = [rows[i] for i in rng.choice(len(rows), PROMPTS_PER_STEP, replace=False)]
        model.eval()
        seqs, attention, width, rewards = _sample(model, tokenizer, batch)
        group = torch.arange(len(rewards)) // GROUP_SIZE
        adv = grpo_scores(torch.tensor(rewards), group)
        model.train()
        logits = model(input_ids=seqs, attention_mask=attention).logits[:, width - 1 : -1].float()
        logprobs = torch.log_softmax(logits, -1).gather(-1, seqs[:, width:, None]).squeeze(-1)
        mask = attention[:, width:].bool()
        loss_t = ppo_clip_loss(logprobs, logprobs.detach(), adv[:, None].expand_as(logprobs)).loss
        loss = aggregate(loss_t, mask, "token-mean", float(mask.sum()))
        model.zero_grad(set_to_none=True)
        loss.backward()
        if model is not master:
            for p, q in zip(model.parameters(), master.parameters(), strict=True):
                q.grad = None if p.grad is None else p.grad.float()
        torch.nn.utils.clip_grad_norm_(params.values(), GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if model is not master:
            with torch.no_grad():
                for p, q in zip(model.parameters(), master.parameters(), strict=True):
                    p.copy_(q)  # round to nearest even, as DeepSpeed's bf16 optimizer does
        published.append(publish())
        print(f"  step {step + 1}: reward {float(np.mean(rewards)):.3f}", file=sys.stderr)
    return published


def _subset(weights: Weights, prefix: str) -> Weights:
    return {n.removeprefix(prefix): t for n, t in weights.items() if n.startswith(prefix)}


def _full_bytes(weights: Weights) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


def _changed(old: Weights, new: Weights) -> tuple[int, int]:
    num = sum(
        int(
            (
                old[n].view(torch.int16 if old[n].element_size() == 2 else torch.int32)
                != new[n].view(torch.int16 if new[n].element_size() == 2 else torch.int32)
            ).sum()
        )
        for n in new
    )
    return num, sum(t.numel() for t in new.values())


def _candidates(old: Weights, new: Weights) -> dict[str, int]:
    """Wire bytes of each candidate encoding for old -> new (uncompressed unless named zlib1)."""
    out = {
        f"{e}+{v}": len(delta_to_bytes(encode_delta(old, new, 0, 1, (e,), (v,)), zlib_level=None))
        for e in ENCODINGS
        for v in VALUE_CODINGS
        if e != "dense" or v == "raw"
    }
    chosen = encode_delta(old, new, 0, 1)
    out["per_tensor_min"] = len(delta_to_bytes(chosen, zlib_level=None))
    out["per_tensor_min_zlib1"] = len(delta_to_bytes(chosen))  # the default wire form
    xor = b"".join(
        (
            old[n].view(torch.int16 if old[n].element_size() == 2 else torch.int32).reshape(-1)
            ^ new[n].view(torch.int16 if new[n].element_size() == 2 else torch.int32).reshape(-1)
        )
        .numpy()
        .tobytes()
        for n in new
    )
    out["xor_zlib1"] = len(zlib.compress(xor, 1))
    return out


def _kind(name: str) -> str:
    for kind in ("embed", "lm_head", "norm", "attn"):
        if kind in name:
            return kind
    return "mlp"


def _by_kind(versions: list[Weights], warmup: int) -> dict[str, dict[str, float]]:
    """Per kind of tensor: elements, median |w| at the start, changed fraction per step (mean after warmup)."""
    out = {}
    for kind in sorted({_kind(n) for n in versions[0]}):
        names = [n for n in versions[0] if _kind(n) == kind]
        numel = sum(versions[0][n].numel() for n in names)
        start = torch.cat([versions[0][n].float().abs().reshape(-1) for n in names])
        steps = [
            sum(_changed({n: versions[v - 1][n]}, {n: versions[v][n]})[0] for n in names) / numel
            for v in range(warmup, len(versions))
        ]
        out[kind] = {
            "numel": numel,
            "median_abs": round(float(start.median()), 5),
            "changed": round(float(np.mean(steps)), 5),
        }
    return out


def _ratios(published: list[Weights], prefix: str, warmup: int) -> dict[str, Any]:
    versions = [_subset(w, prefix) for w in published]
    full = _full_bytes(versions[0])
    single = [
        len(delta_to_bytes(encode_delta(versions[v - 1], versions[v], v - 1, v))) for v in range(1, len(versions))
    ]
    single_raw = [
        len(delta_to_bytes(encode_delta(versions[v - 1], versions[v], v - 1, v), zlib_level=None))
        for v in range(1, len(versions))
    ]
    out: dict[str, Any] = {"full_bytes": full, "per_step_changed_fraction": []}
    for v in range(1, len(versions)):
        num, total = _changed(versions[v - 1], versions[v])
        out["per_step_changed_fraction"].append(round(num / total, 5))
    for k in (1, 2, 4):
        targets = range(max(warmup, k), len(versions))
        fractions, direct, direct_raw, chain, chain_raw = [], [], [], [], []
        for v in targets:
            num, total = _changed(versions[v - k], versions[v])
            fractions.append(num / total)
            delta = encode_delta(versions[v - k], versions[v], v - k, v)
            direct.append(len(delta_to_bytes(delta)))
            direct_raw.append(len(delta_to_bytes(delta, zlib_level=None)))
            chain.append(sum(single[v - k : v]))
            chain_raw.append(sum(single_raw[v - k : v]))
        out[f"k{k}"] = {
            "changed_fraction": round(float(np.mean(fractions)), 5),
            "delta_bytes_ratio": round(full / float(np.mean(direct)), 2),
            "chain_delta_bytes_ratio": round(full / float(np.mean(chain)), 2),
            "uncompressed_delta_bytes_ratio": round(full / float(np.mean(direct_raw)), 2),
            "uncompressed_chain_delta_bytes_ratio": round(full / float(np.mean(chain_raw)), 2),
            "num_versions": len(fractions),
        }
    out["by_kind_k1"] = _by_kind(versions, warmup)
    last = len(versions) - 1
    out["candidates_k1_last_step"] = _candidates(versions[last - 1], versions[last])
    out["candidates_k4_last_step"] = _candidates(versions[last - 4], versions[last])
    return out


def _speed(fraction: float, size_mb: int, seed: int) -> dict[str, float]:
    """CPU seconds (one thread) per GB of full bf16 weights: encode, serialise (zlib 1), parse + apply, verify."""
    gen = torch.Generator().manual_seed(seed)
    rows = 896
    cols = size_mb * 2**20 // 2 // rows // 8
    old = {f"w{i}": (torch.randn(rows, cols, generator=gen) * 0.02).to(torch.bfloat16) for i in range(8)}
    new = {}
    for name, t in old.items():
        words = t.view(torch.int16).clone().reshape(-1)
        flip = torch.rand(words.numel(), generator=gen) < fraction
        # one bf16 ulp up or down, as a small AdamW step does
        words[flip] += torch.randint(0, 2, (int(flip.sum()),), generator=gen, dtype=torch.int16) * 2 - 1
        new[name] = words.view(torch.bfloat16).reshape(t.shape)
    gb = _full_bytes(old) / 1e9
    held = {n: t.clone() for n, t in old.items()}
    timings = {}
    start = time.process_time()
    delta = encode_delta(old, new, 0, 1)
    timings["encode_cpu_s_per_gb"] = (time.process_time() - start) / gb
    start = time.process_time()
    raw = delta_to_bytes(delta, zlib_level=None)
    timings["serialise_uncompressed_cpu_s_per_gb"] = (time.process_time() - start) / gb
    start = time.process_time()
    buf = delta_to_bytes(delta)
    timings["serialise_cpu_s_per_gb"] = (time.process_time() - start) / gb
    start = time.process_time()
    parsed: Delta = delta_from_bytes(buf)
    apply_delta(held, parsed, verify=False)
    timings["apply_cpu_s_per_gb"] = (time.process_time() - start) / gb
    start = time.process_time()
    assert weights_digest(held) == delta.checksum
    timings["verify_cpu_s_per_gb"] = (time.process_time() - start) / gb
    start = time.process_time()
    xor = b"".join(
        (old[n].view(torch.int16).reshape(-1) ^ new[n].view(torch.int16).reshape(-1)).numpy().tobytes() for n in new
    )
    xor_zipped = zlib.compress(xor, 1)
    timings["xor_zlib1_cpu_s_per_gb"] = (time.process_time() - start) / gb
    timings = {k: round(v, 3) for k, v in timings.items()}
    timings["uncompressed_delta_bytes_ratio"] = round(gb * 1e9 / len(raw), 2)
    timings["xor_zlib1_bytes_ratio"] = round(gb * 1e9 / len(xor_zipped), 2)
    return {
        "set_bytes": int(gb * 1e9),
        "changed_fraction": fraction,
        "delta_bytes_ratio": round(gb * 1e9 / len(buf), 2),
        **timings,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="runs/arith_a/model")
    parser.add_argument("--data", default="runs/arith_a/train.jsonl")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=8, help="versions skipped before averaging (Adam's first steps)")
    parser.add_argument("--speed-mb", type=int, default=512, help="size of the speed test's set (0: skip it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = task_lib.read_jsonl(args.data)
    results: dict[str, Any] = {}
    for name, setting in SETTINGS.items():
        start = time.perf_counter()
        print(f"{name}: lr {setting['lr']} ...", file=sys.stderr)
        published = _train(Path(args.model), rows, setting, args.steps, args.seed)
        results[name] = {
            "lr": setting["lr"],
            "betas": list(setting["betas"]),
            "recipe": setting["recipe"],
            "bf16": _ratios(published, "bf16/", args.warmup),
            "train_s": round(time.perf_counter() - start, 1),
        }
        if not setting["bf16_learner"]:
            results[name]["fp32"] = _ratios(published, "fp32/", args.warmup)
    speed_fraction = results["gpu_arithmetic"]["bf16"]["k1"]["changed_fraction"]
    speed = _speed(speed_fraction, args.speed_mb, args.seed) if args.speed_mb else {}
    print(f"{'setting':16} {'dtype':5} {'k':>2} {'changed':>9} {'ratio':>7} {'chain':>7}")
    for name, r in results.items():
        for dtype in ("bf16", "fp32"):
            for k in (1, 2, 4):
                if dtype in r:
                    m = r[dtype][f"k{k}"]
                    print(
                        f"{name:16} {dtype:5} {k:2} {m['changed_fraction']:9.4f} {m['delta_bytes_ratio']:7.2f} "
                        f"{m['chain_delta_bytes_ratio']:7.2f}"
                    )
    if speed:
        print(f"speed ({speed['set_bytes'] / 1e9:.2f} GB bf16, changed {speed_fraction:.4f}): {speed}")
    now = datetime.now(timezone.utc)
    report = {
        "bench": "weights_delta",
        "date": now.isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "command": " ".join(["python", *sys.argv]),
        "model": args.model,
        "steps": args.steps,
        "warmup": args.warmup,
        "results": results,
        "speed": speed,
    }
    out = Path(args.out) / f"weights_delta-{now:%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
