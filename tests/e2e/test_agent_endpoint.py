"""An agent program with the official ``openai`` client drives a whole run through the rollout tier's
OpenAI endpoint: ``streamrl up recipes/agent.toml`` (transformers engine, function reward reading the
agent's reward, DeepSpeed learner, real Redis) and ``examples/agent/agent.py`` side by side.

From the streams and the agent's own record of every response it got:

* every trained trajectory is one of the agent's conversations, and the learner trained each one
  exactly once (the batches hold every step's full groups, no id twice);
* its tokens are exactly what the endpoint returned: the prompt is the first request's prompt as
  the engine saw it, then each reply's tokens (loss mask 1, with the behaviour log-probs the client
  got) and between them the follow-up's tokens after the chat template (mask 0, log-prob 0), so that
  each later request's prompt is the trajectory's prefix; the reward is the agent's;
* the learner's recomputed log-probs agree with the engine's (mismatch KL ~0); nothing is left
  pending or dead-lettered.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from recipe_run import entries, trained_batches

from streamrl.common.messages import WeightsPublished
from streamrl.common.streams import StreamNames
from streamrl.ops.redis_server import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "agent"))
import chat_model  # noqa: E402

STEPS, GROUP_SIZE, PROMPTS_PER_STEP = 3, 4, 2
TOKEN = "agent-e2e-token"
ENV = {
    **os.environ,
    "STREAMRL_REDIS__RETAIN_CONSUMED_S": "86400",
    "STREAMRL_REDIS__PAYLOAD_RETENTION_S": "86400",  # trained and evaluation payloads stay readable
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "STREAMRL_AGENT_TOKEN": TOKEN,
}


def test_an_openai_client_agent_drives_a_run_and_each_conversation_is_trained_once(
    tmp_path: Path, redis_url: str, run_id: str
) -> None:
    task = chat_model.prepare(tmp_path / "task")
    recipe = tmp_path / "agent.toml"
    recipe.write_text((ROOT / "recipes" / "agent.toml").read_text().replace("runs/agent_task", str(task)))
    port = free_port()
    overrides = [
        f"--run_id={run_id}",
        f"--run_dir={tmp_path / 'run'}",
        f"--redis.url={redis_url}",
        f"--total_steps={STEPS}",
        f"--coordinator.group_size={GROUP_SIZE}",
        f"--coordinator.prompts_per_step={PROMPTS_PER_STEP}",
        f"--rollout.agent.port={port}",
        "--learner.checkpoint_every=100",
    ]
    up = subprocess.Popen(
        [sys.executable, "-m", "streamrl.ops.cli", "up", str(recipe), *overrides],
        env=ENV,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    record_path = tmp_path / "agent.jsonl"
    agent = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "examples" / "agent" / "agent.py"),
            f"--base-url=http://127.0.0.1:{port}/v1",
            "--workers=4",
            "--idle-s=120",
            f"--record={record_path}",
        ],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        up_out, _ = up.communicate(timeout=540)
        agent_out, _ = agent.communicate(timeout=60)
    finally:
        for proc in (up, agent):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert up.returncode == 0, up_out[-6000:]
    assert agent.returncode == 0 and "conversations finished" in agent_out, agent_out[-3000:]
    assert TOKEN not in up_out

    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    assert client.xlen(names.dead) == 0, entries(client, names.dead)
    for stream, group in ((names.trajectories, "reward"), (names.scored, "coordinator"), (names.batches, "learner")):
        assert client.xpending(stream, group)["pending"] == 0, f"{stream}/{group} has pending entries"
    trained_versions = [w for w in entries(client, names.weights) if isinstance(w, WeightsPublished) and w.metrics]
    assert [w.version for w in trained_versions] == list(range(1, STEPS + 1))
    for w in trained_versions:
        assert math.isfinite(w.metrics["learner/loss/policy"])
        assert abs(w.metrics["learner/mismatch/kl"]) < 1e-3, w.metrics

    # trained exactly once: every step's full groups, no trajectory twice
    batches = trained_batches(client, names)
    assert [b.index for b in batches] == list(range(STEPS))
    samples = [s for b in batches for s in b.samples]
    ids = [s.trajectory.id for s in samples]
    assert len(ids) == len(set(ids)) == STEPS * PROMPTS_PER_STEP * GROUP_SIZE

    # each one is a conversation the agent had, token for token
    conversations = {r["trajectory_id"]: r for r in map(json.loads, record_path.read_text().splitlines())}
    assert set(ids) <= set(conversations), set(ids) - set(conversations)
    for s in samples:
        t, conversation = s.trajectory, conversations[s.trajectory.id]
        first, second = conversation["requests"]
        prompt, response = t.prompt_ids.tolist(), t.response_ids.tolist()
        mask, logprobs = t.loss_mask.tolist(), t.logprobs.tolist()
        assert prompt == first["prompt_token_ids"]
        assert second["prompt_token_ids"] == prompt + response[: len(second["prompt_token_ids"]) - len(prompt)]
        follow_up = second["prompt_token_ids"][len(prompt) + len(first["token_ids"]) :]
        assert len(follow_up) >= 3, "<|user|>#<|assistant|> (and </s> when the first reply was cut)"
        assert response == first["token_ids"] + follow_up + second["token_ids"]
        assert mask == [1] * len(first["token_ids"]) + [0] * len(follow_up) + [1] * len(second["token_ids"])
        assert logprobs == pytest.approx(first["logprobs"] + [0.0] * len(follow_up) + second["logprobs"], abs=1e-6)
        assert [(turn.start, turn.end) for turn in t.turns] == [
            (0, len(first["token_ids"])),
            (len(response) - len(second["token_ids"]), len(response)),
        ]
        assert [turn.policy_version for turn in t.turns] == [first["policy_version"], second["policy_version"]]
        assert t.metadata["agent_reward"] == conversation["reward"] == pytest.approx(s.reward)
