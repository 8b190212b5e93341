"""The RL learner on a vision-language policy (the tiny Idefics3 of streamrl.torchkit.testing).

Episodes hold an image in the prompt and, in some, an image returned by an environment step inside
the response (its tokens masked, as the rollout tier records them). Checked against plain
transformers (``AutoModelForImageTextToText`` fed the processor's pixel inputs): the learner's response
log-probs and entropies, and the gradient of its whole loss (KL to a reference vision-language model
included) computed by hand over the model's tokens only. The pixels are really used (another image,
other log-probs; only after the image), environment tokens add nothing to the gradient, a step trains
the vision tower or leaves it as loaded (``freeze_vision_tower``), the published weights carry the
checkpoint's names, and bad images or image-token counts are refused naming the trajectory.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import pytest
import torch
from safetensors import safe_open
from test_multiturn_gradient import learner_gradient
from transformers import AutoModelForImageTextToText, AutoProcessor

from streamrl.common.messages import Image, SamplingParams, ScoredTrajectory, Tensor, TrainingBatch, Trajectory, Turn
from streamrl.learner.ds_config import DeepSpeedConfig
from streamrl.learner.engine import ModelEngine
from streamrl.learner.rl.batch import collate
from streamrl.learner.rl.config import LearnerConfig
from streamrl.learner.rl.trainer import RLTrainer
from streamrl.learner.vision import ImageInputs, check_learner, token_types
from streamrl.torchkit.testing import build_tiny_idefics3

IMAGE_TOKEN_ID = 387  # <image> in the tiny Idefics3's tokenizer
PROMPT = "<|im_start|>user\n<image>what is in the picture<|im_end|>\n<|im_start|>assistant\n"
ENV_TEXT = "<|im_end|>\n<|im_start|>user\n<image>and now<|im_end|>\n<|im_start|>assistant\n"
ZERO0 = DeepSpeedConfig(dtype="fp32", zero_stage=0, scheduler="constant", lr=1e-2, grad_clip=0.0)


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_idefics3(tmp_path_factory.mktemp("tiny_idefics3"))


@pytest.fixture(scope="module")
def vl_ref_dir(tmp_path_factory: pytest.TempPathFactory, vl_dir: Path) -> Path:
    """The same model with other weights (vision tower included): the KL reference."""
    out = tmp_path_factory.mktemp("tiny_idefics3_ref")
    torch.manual_seed(1)
    model = AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(out)
    for f in vl_dir.iterdir():  # tokenizer and processor files
        if not (out / f.name).exists():
            (out / f.name).write_bytes(f.read_bytes())
    return out


@pytest.fixture(scope="module")
def processor(vl_dir: Path) -> Any:
    return AutoProcessor.from_pretrained(vl_dir)


def png(seed: int, size: tuple[int, int] = (40, 56)) -> bytes:
    """A random RGB picture, PNG-encoded."""
    pixels = np.random.default_rng(seed).integers(0, 256, size=(*size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    PIL.Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def pil(data: bytes) -> PIL.Image.Image:
    return PIL.Image.open(io.BytesIO(data)).convert("RGB")


def episode(
    processor: Any,
    j: int,
    image: bytes,
    env_image: bytes | None,
    seed: int = 0,
    unmask_env: bool = False,
    env_logprob: float | None = None,
) -> Trajectory:
    """Trajectory ``g/{j}``: the prompt's image, 3 model tokens, then (with ``env_image``) an environment
    step with that image (mask 0) and 4 more model tokens. ``unmask_env``: loss mask 1 on the step's text
    tokens; ``env_logprob``: garbage behaviour log-probs around it on the step's tokens."""
    rng = np.random.default_rng(100 * seed + j)
    prompt = processor(text=[PROMPT], images=[[pil(image)]])["input_ids"][0]
    ids = rng.integers(1, 384, size=3).tolist()
    mask, turns = [1, 1, 1], [Turn(start=0, end=3, policy_version=0)]
    images = [Image(media_type="image/png", data=image)]
    if env_image is not None:
        env = processor(text=[ENV_TEXT], images=[[pil(env_image)]], add_special_tokens=False)["input_ids"][0]
        ids += env
        mask += [1 if unmask_env and t != IMAGE_TOKEN_ID else 0 for t in env]
        turns.append(Turn(start=len(ids), end=len(ids) + 4, policy_version=0))
        ids += rng.integers(1, 384, size=4).tolist()
        mask += [1] * 4
        images.append(Image(media_type="image/png", data=env_image))
    logprobs = np.where(np.array(mask) == 1, rng.uniform(-6.0, -5.0, size=len(ids)), 0.0)
    if env_logprob is not None:
        logprobs = np.where(np.array(mask) == 1, logprobs, env_logprob + 3 * rng.standard_normal(len(ids)))
    return Trajectory(
        id=f"g/{j}",
        group_id="g",
        group_index=j,
        group_size=3,
        prompt_ids=Tensor.from_list(prompt, "int32"),
        response_ids=Tensor.from_list(ids, "int32"),
        logprobs=Tensor.from_numpy(logprobs.astype(np.float32)),
        loss_mask=Tensor.from_list(mask, "uint8"),
        sampling=SamplingParams(temperature=[1.0, 0.7, 1.0][j]),
        images=images,
        turns=turns if env_image is not None else [],
    )


def text_episode(j: int) -> Trajectory:
    rng = np.random.default_rng(50 + j)
    ids = rng.integers(1, 384, size=5).tolist()
    return Trajectory(
        id=f"t/{j}",
        group_id="t",
        group_index=j,
        group_size=2,
        prompt_ids=Tensor.from_list([5, 6, 7, 8], "int32"),
        response_ids=Tensor.from_list(ids, "int32"),
        logprobs=Tensor.from_list([-5.0] * 5, "float32"),
        loss_mask=Tensor.from_list([1] * 5, "uint8"),
    )


def batch_of(trajectories: list[Trajectory], rewards: list[float] | None = None) -> TrainingBatch:
    rewards = rewards or [1.0, 0.0, 0.5, 0.25, 0.75][: len(trajectories)]
    samples = [ScoredTrajectory(trajectory=t, reward=r) for t, r in zip(trajectories, rewards, strict=True)]
    return TrainingBatch(id="batch-0", index=0, samples=samples, policy_version=0, staleness=[0] * len(samples))


def group(processor: Any, **kwargs: Any) -> list[Trajectory]:
    """Three episodes of one prompt image: two with an environment image (different ones), one without."""
    return [
        episode(processor, 0, png(0), png(10), **kwargs),
        episode(processor, 1, png(0), None, **kwargs),
        episode(processor, 2, png(0), png(11), **kwargs),
    ]


def reference_forward(model: Any, processor: Any, traj: Trajectory) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain transformers: log-probs and entropies [T] of every response token (logits over the
    sampling temperature), the model fed the processor's pixel inputs for the trajectory's images."""
    prompt, response = traj.prompt_ids.tolist(), traj.response_ids.tolist()
    kwargs: dict[str, Any] = {}
    if traj.images:
        images = [pil(image.data) for image in traj.images]  # type: ignore[arg-type]
        pixels = processor(text=[processor.image_token * len(images)], images=[images], return_tensors="pt")
        kwargs = {"pixel_values": pixels["pixel_values"], "pixel_attention_mask": pixels["pixel_attention_mask"]}
    logits = model(input_ids=torch.tensor([prompt + response]), **kwargs).logits[0]
    steps = logits[len(prompt) - 1 : len(prompt) - 1 + len(response)] / traj.sampling.temperature
    logp_all = torch.log_softmax(steps.float(), dim=-1)
    logp = logp_all.gather(1, torch.tensor(response)[:, None])[:, 0]
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def test_image_rows_logprobs_equal_transformers(vl_dir: Path, processor: Any) -> None:
    trainer = RLTrainer(LearnerConfig(model=str(vl_dir), ds=ZERO0))
    trajs = [*group(processor), text_episode(0)]
    rl = collate(batch_of(trajs), trainer.pad_id, trainer.images)
    assert rl.has_images and rl.pixels[3] is None and not rl.select([3]).has_images
    reference = AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logp, ent = trainer._logprobs(trainer.policy, rl, with_entropy=True)  # image rows and a text row, row by row
        flat_logp, flat_ent = trainer._logprobs(trainer.policy, rl.select([3]), with_entropy=True)  # flat varlen path
        wants = [reference_forward(reference, processor, t) for t in trajs]
    assert ent is not None and flat_ent is not None
    for i, (want_logp, want_ent) in enumerate(wants):
        n = len(want_logp)
        torch.testing.assert_close(logp[i, :n], want_logp, rtol=0, atol=2e-5)
        torch.testing.assert_close(ent[i, :n], want_ent, rtol=0, atol=2e-5)
        assert bool((logp[i, n:] == 0).all())
    torch.testing.assert_close(flat_logp[0, :5], wants[3][0], rtol=0, atol=2e-5)
    torch.testing.assert_close(flat_ent[0, :5], wants[3][1], rtol=0, atol=2e-5)


def test_the_pixels_are_used(vl_dir: Path, processor: Any) -> None:
    """Another prompt image changes every response log-prob; another environment image only those after it."""
    trainer = RLTrainer(LearnerConfig(model=str(vl_dir), ds=ZERO0))

    def logprobs(image: bytes, env_image: bytes) -> torch.Tensor:
        rl = collate(batch_of([episode(processor, 0, image, env_image)]), trainer.pad_id, trainer.images)
        with torch.no_grad():
            return trainer._logprobs(trainer.policy, rl, with_entropy=False)[0][0]

    base = logprobs(png(0), png(10))
    other_prompt_image = logprobs(png(1), png(10))
    other_env_image = logprobs(png(0), png(11))
    env_start = 3  # the environment step follows the first 3 model tokens
    assert float((base - other_prompt_image).abs()[:env_start].min()) > 1e-4
    torch.testing.assert_close(other_env_image[: env_start + 1], base[: env_start + 1], rtol=0, atol=1e-6)
    assert float((base - other_env_image).abs()[-4:].min()) > 1e-4


ALGO: dict[str, Any] = {
    "advantage": {"estimator": "grpo"},
    "kl": {"placement": "loss", "estimator": "k3", "coef": 0.1},
    "loss": {"aggregation": "token-mean", "entropy_coef": 0.01},
}


def reference_gradient(
    policy_dir: Path, ref_dir: Path, processor: Any, batch: TrainingBatch
) -> dict[str, torch.Tensor]:
    """ALGO's loss written out over the model's tokens (found from ``turns``, not the loss mask); its gradient."""
    policy = AutoModelForImageTextToText.from_pretrained(policy_dir, dtype=torch.float32, attn_implementation="eager")
    ref = AutoModelForImageTextToText.from_pretrained(ref_dir, dtype=torch.float32, attn_implementation="eager")
    trajs = [s.trajectory for s in batch.samples]

    def model_tokens(traj: Trajectory) -> torch.Tensor:
        turns = traj.turns or [Turn(start=0, end=len(traj.response_ids), policy_version=0)]
        return torch.tensor([t for turn in turns for t in range(turn.start, turn.end)])

    logp, entropy, ref_logp = [], [], []
    for traj in trajs:
        lp, ent = reference_forward(policy, processor, traj)
        logp.append(lp[model_tokens(traj)])
        entropy.append(ent[model_tokens(traj)])
        with torch.no_grad():
            ref_logp.append(reference_forward(ref, processor, traj)[0][model_tokens(traj)])
    returns = torch.tensor([s.reward for s in batch.samples])
    score = (returns - returns.mean()) / (returns.std() + 1e-6)  # one group
    policy_terms = [-score[i] * torch.exp(lp - lp.detach()) for i, lp in enumerate(logp)]
    k3 = [torch.exp(r - lp) - 1 - (r - lp) for lp, r in zip(logp, ref_logp, strict=True)]
    tokens = sum(x.numel() for x in logp)
    loss = (torch.cat(policy_terms).sum() + 0.1 * torch.cat(k3).sum() - 0.01 * torch.cat(entropy).sum()) / tokens
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in policy.named_parameters()}


def test_gradient_matches_transformers_and_ignores_environment_tokens(
    vl_dir: Path, vl_ref_dir: Path, processor: Any
) -> None:
    cfg = LearnerConfig(model=str(vl_dir), ref_model=str(vl_ref_dir), ds=ZERO0, algo=ALGO)
    trainer = RLTrainer(cfg)
    assert trainer.ref is not None and trainer.ref.processor is not None
    batch = batch_of(group(processor), rewards=[1.0, 0.0, 0.5])
    got = learner_gradient(trainer, batch)
    want = reference_gradient(vl_dir, vl_ref_dir, processor, batch)
    assert got.keys() == want.keys()
    scale = max(float(g.abs().max()) for g in want.values())
    assert scale > 1e-4
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-5 * scale, msg=n)
    tower_grad = got["model.vision_model.embeddings.patch_embedding.weight"]
    assert float(tower_grad.abs().max()) > 1e-6  # the images are trained on

    garbage = learner_gradient(trainer, batch_of(group(processor, env_logprob=-2.0), rewards=[1.0, 0.0, 0.5]))
    for n in got:
        assert torch.equal(garbage[n], got[n]), n
    unmasked = learner_gradient(trainer, batch_of(group(processor, unmask_env=True), rewards=[1.0, 0.0, 0.5]))
    assert any(not torch.allclose(unmasked[n], got[n], rtol=1e-3, atol=1e-3 * scale) for n in got)


@pytest.mark.parametrize("freeze", [False, True])
def test_a_step_trains_the_policy_and_the_tower_unless_frozen(vl_dir: Path, processor: Any, freeze: bool) -> None:
    trainer = RLTrainer(LearnerConfig(model=str(vl_dir), ds=ZERO0, freeze_vision_tower=freeze))
    module = trainer.policy.module
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    metrics = trainer.step(batch_of([*group(processor), text_episode(0), text_episode(1)]))
    assert metrics["learner/grad_norm"] > 0
    changed = {n for n, p in module.named_parameters() if not torch.equal(p, before[n])}
    tower = {n for n in before if n.startswith("model.vision_model.")}
    assert tower and (tower & changed) == (set() if freeze else tower)
    assert "model.connector.modality_projection.proj.weight" in changed
    assert "model.text_model.layers.0.self_attn.q_proj.weight" in changed
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trainable == set(before) - (tower if freeze else set())


def test_published_and_exported_weights_carry_the_checkpoint_names(
    vl_dir: Path, processor: Any, tmp_path: Path
) -> None:
    engine = ModelEngine.from_config(str(vl_dir), ZERO0, "causal_lm")
    with safe_open(str(vl_dir / "model.safetensors"), "pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    published = {name: tuple(t.shape) for name, t in engine.iter_full_params()}
    assert published == saved  # lm_head.weight is tied to model.text_model.embed_tokens.weight, in neither
    out = engine.export_hf(tmp_path / "export")
    reloaded = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    assert AutoProcessor.from_pretrained(out).image_seq_len == processor.image_seq_len
    for name, tensor in reloaded.state_dict().items():
        torch.testing.assert_close(tensor, engine.module.state_dict()[name], rtol=0, atol=0, msg=name)


# ------------------------------------------------------------------ refused inputs (no model needed)


def check(processor: Any, traj: Trajectory) -> None:
    ImageInputs(processor, IMAGE_TOKEN_ID)([traj])


def test_bad_images_are_refused_naming_the_trajectory(processor: Any) -> None:
    good = episode(processor, 0, png(0), png(10))
    with pytest.raises(ValueError, match=r"trajectory g/0: image 1: 9 bytes of image/png cannot be decoded as PNG"):
        check(processor, _with_images(good, [good.images[0], Image(media_type="image/png", data=b"not a png")]))
    with pytest.raises(ValueError, match=r"trajectory g/0: image 0 \(uri 's3://b/x.png'\) has no inline bytes"):
        check(processor, _with_images(good, [Image(media_type="image/png", uri="s3://b/x.png"), good.images[1]]))
    with pytest.raises(ValueError, match="trajectory g/0: image 0: media_type 'image/tiff'"):
        check(processor, _with_images(good, [Image(media_type="image/tiff", data=png(0)), good.images[1]]))


def _with_images(traj: Trajectory, images: list[Image]) -> Trajectory:
    import msgspec

    return msgspec.structs.replace(traj, images=images)


def test_image_token_counts_must_match_the_images(processor: Any) -> None:
    good = episode(processor, 0, png(0), png(10))
    with pytest.raises(
        ValueError, match=r"trajectory g/0: prompt and response hold 8 image tokens .* 1 image\(s\), which"
    ):
        check(processor, _with_images(good, good.images[:1]))
    with pytest.raises(ValueError, match=r"trajectory g/0: prompt and response hold 8 image tokens .* 0 image\(s\)"):
        check(processor, _with_images(good, []))
    unmasked = episode(processor, 0, png(0), png(10), unmask_env=True)
    mask = unmasked.loss_mask.to_numpy().copy()
    mask[unmasked.response_ids.to_numpy() == IMAGE_TOKEN_ID] = 1
    import msgspec

    with pytest.raises(ValueError, match=r"trajectory g/0: response token \d+ is an image token with loss mask 1"):
        check(processor, msgspec.structs.replace(unmasked, loss_mask=Tensor.from_numpy(mask)))
    with pytest.raises(ValueError, match=r"trajectory g/0 carries 2 image.* text-only model"):
        collate(batch_of([good]), pad_id=0)


def test_group_members_share_one_processing_of_their_images(processor: Any) -> None:
    calls = []
    inputs = ImageInputs(processor, IMAGE_TOKEN_ID)
    real = inputs._expand
    inputs._expand = lambda t: calls.append(t.id) or real(t)  # type: ignore[method-assign]
    rows = inputs([episode(processor, j, png(0), None) for j in range(3)])
    assert calls == ["g/0"] and all(torch.equal(r["pixel_values"], rows[0]["pixel_values"]) for r in rows)  # type: ignore[index]


def test_per_token_processor_outputs_are_rebuilt_for_the_row(processor: Any) -> None:
    """``token_types`` gives a whole prompt the values the processor itself gives it (Idefics3 marks its
    image tokens and their wrappers in ``mm_token_type_ids`` when asked)."""
    images = [pil(png(0)), pil(png(1))]
    text = "hello <image> and <image> bye"
    full = processor(text=[text], images=[images], return_mm_token_type_ids=True, return_tensors="np")
    alone = processor(text=["<image><image>"], images=[images], return_mm_token_type_ids=True, return_tensors="np")
    rebuilt = token_types(full["input_ids"], alone["input_ids"], alone["mm_token_type_ids"])
    assert rebuilt.sum() > 0 and np.array_equal(rebuilt, full["mm_token_type_ids"])


def test_unsupported_learner_settings_are_refused(tiny_qwen_dir: Path) -> None:
    with pytest.raises(ValueError, match="freeze_vision_tower = true needs a vision-language model"):
        ModelEngine.from_config(str(tiny_qwen_dir), ZERO0, freeze_vision_tower=True)
    with pytest.raises(ValueError, match="needs a critic"):
        gae = LearnerConfig(model="m", algo={"advantage": {"estimator": "gae"}, "critic": {}})
        check_learner(uses_critic=gae.algo.uses_critic, zero_stage=0, world_size=1)
    with pytest.raises(ValueError, match=r"2 ranks needs ds\.zero_stage = 0"):
        check_learner(uses_critic=False, zero_stage=2, world_size=2)
    check_learner(uses_critic=False, zero_stage=3, world_size=1)
    check_learner(uses_critic=False, zero_stage=0, world_size=4)
