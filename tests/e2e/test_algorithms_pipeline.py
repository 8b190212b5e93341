"""Each advantage estimator and off-policy correction through the whole CPU pipeline.

Every run is ``streamrl up`` on the smoke recipe (function reward, DeepSpeed learner, real Redis)
with the algorithm swapped by command-line overrides; the corrections run the vLLM rollout engine
(the mismatch they correct is vLLM's), the estimators the transformers engine (~35 s less a run here:
their pipeline is the same tokens either way). Estimators run 3 synchronous
steps with finite losses (PPO also with 4 optimizer updates per batch); TIS / ICEPOP / Seq-Mask-TIS run with async staleness 1 and must report
their mismatch metrics.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from streamrl.common.codec import decode
from streamrl.common.messages import BatchManifest, WeightsPublished
from streamrl.common.streams import StreamNames

pytestmark = pytest.mark.slow
ENV = {
    **os.environ,
    "STREAMRL_REDIS__RETAIN_CONSUMED_S": "86400",
    "STREAMRL_REDIS__PAYLOAD_RETENTION_S": "86400",  # trained and evaluation payloads stay readable
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "OMP_NUM_THREADS": "2",
    "TOKENIZERS_PARALLELISM": "false",
}
STEPS = 3
A = "--learner.algo."
CASES = {
    "grpo": [f"{A}advantage.estimator=grpo"],
    "rloo": [f"{A}advantage.estimator=rloo"],
    "reinforce_baseline": [f"{A}advantage.estimator=reinforce_baseline"],
    "dr_grpo": [
        f"{A}advantage.estimator=dr_grpo",
        f"{A}loss.aggregation=seq-mean-token-sum-norm",
        f"{A}loss.norm_constant=5",
    ],
    "gae": [f"{A}advantage.estimator=gae", f"{A}advantage.lam=0.95", f"{A}critic={{}}"],
    # PPO with 2 epochs of 2 mini-batches: 4 optimizer updates per batch, on the policy and the critic
    "ppo_updates": [
        f"{A}advantage.estimator=gae",
        f"{A}critic={{}}",
        "--learner.mini_batches=2",
        "--learner.ppo_epochs=2",
    ],
    "tis": [f"{A}correction.type=tis", "--coordinator.max_staleness=1"],
    "icepop": [f"{A}correction.type=icepop", "--coordinator.max_staleness=1"],
    "seq_mask_tis": [f"{A}correction.type=seq_mask_tis", "--coordinator.max_staleness=1"],
}
CORRECTIONS = ("tis", "icepop", "seq_mask_tis")
"""Cases that need vLLM's behaviour log-probs (the engine/learner mismatch they correct)."""


@pytest.mark.parametrize("case", list(CASES))
def test_algorithm_runs_in_the_pipeline(
    case: str, tiny_task: Path, tmp_path: Path, redis_url: str, write_recipe
) -> None:  # type: ignore[no-untyped-def]
    recipe = write_recipe(tiny_task, tmp_path / "run", redis_url, dense_reward=True)
    run_id = f"algo-{case}-{os.getpid()}"
    overrides = [
        f"--run_id={run_id}",
        f"--total_steps={STEPS}",
        "--coordinator.eval.dataset=null",
        "--learner.export_every=null",
        *CASES[case],
    ]
    if (
        case not in CORRECTIONS
    ):  # the estimators' pipeline is the engine's tokens: the transformers engine starts in seconds
        overrides.append("--rollout.engine.type=hf")
    proc = subprocess.run(
        [sys.executable, "-m", "streamrl.ops.cli", "up", str(recipe), *overrides],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    steps = [m for _, f in client.xrange(names.weights) if (m := decode(f[b"d"])) and isinstance(m, WeightsPublished)]
    trained = [w for w in steps if w.metrics]
    assert [w.version for w in trained] == list(range(1, STEPS + 1))
    for w in trained:
        for key in ("learner/loss/policy", "learner/loss/total", "learner/grad_norm"):
            assert math.isfinite(w.metrics[key]), (case, key, w.metrics)
        if case in ("gae", "ppo_updates"):
            assert math.isfinite(w.metrics["learner/loss/value"]) and w.metrics["learner/loss/value"] > 0
        assert w.metrics["learner/updates"] == (4 if case == "ppo_updates" else 1), (case, w.metrics)
        if case in CORRECTIONS:
            for key in ("learner/mismatch/kl", "learner/correction/masked_frac", "learner/correction/weight_mean"):
                assert math.isfinite(w.metrics[key]), (case, key)
    if case in CORRECTIONS:
        batches = [decode(f[b"d"], BatchManifest) for _, f in client.xrange(names.batches)]
        assert max(max(b.staleness) for b in batches) == 1, "async mode should train on one-step-stale samples"
        stale = [w for w in trained if w.metrics["learner/staleness_max"] == 1]
        assert stale and any(abs(w.metrics["learner/mismatch/kl"]) > 0 for w in stale)
