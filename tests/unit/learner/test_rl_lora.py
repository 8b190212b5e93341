"""LoRA in the RL learner (``learner.lora``): the adapter trains on a frozen base, and a version is the
adapter alone (peft naming, adapter tensors only); bad settings are refused at start, by name."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest
import torch
from test_trainer_updates import scored_batch
from transformers import AutoModelForCausalLM

from streamrl.learner.ds_config import DeepSpeedConfig
from streamrl.learner.rl.adapter import adapter_shape, check_target_modules, iter_adapter
from streamrl.learner.rl.algo.config import AlgoConfig, KLConfig
from streamrl.learner.rl.config import LearnerConfig, RLLoraConfig
from streamrl.learner.rl.trainer import RLTrainer
from streamrl.torchkit.weights.zmq import ZmqPublisher

DS = DeepSpeedConfig(dtype="fp32", zero_stage=0, scheduler="constant", lr=1e-2, grad_clip=0.0)


def lora_config(model: Path, **lora: object) -> LearnerConfig:
    return LearnerConfig(model=str(model), ds=DS, total_steps=4, lora=RLLoraConfig(rank=4, alpha=8.0, **lora))


def test_lora_rl_trains_the_adapter_on_a_frozen_base(tiny_qwen_dir: Path) -> None:
    trainer = RLTrainer(lora_config(tiny_qwen_dir))
    module = trainer.policy.module
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    before = dict(iter_adapter(module, 0))
    batch = scored_batch()
    metrics = [trainer.step(batch) for _ in range(3)]
    assert all(m["learner/grad_norm"] > 0 for m in metrics)
    # on-policy the surrogate loss is -mean(A) whatever the weights; the log-probs it is taken over move
    moved = [m["learner/mismatch/kl"] for m in metrics]
    assert len(set(moved)) == 3, f"the policy's log-probs did not move: {moved}"
    after = dict(iter_adapter(module, 0))
    assert after.keys() == before.keys()
    assert all(not torch.equal(after[n], before[n]) for n in after if ".lora_B." in n)
    # the base is as loaded: every non-adapter weight equals the checkpoint's
    base = dict(AutoModelForCausalLM.from_pretrained(tiny_qwen_dir, dtype=torch.float32).named_parameters())
    for name, p in module.named_parameters():
        if ".lora_" not in name:
            plain = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            assert torch.equal(p.detach(), base[plain].detach()), name


def test_adapter_version_carries_only_adapter_tensors(tiny_qwen_dir: Path) -> None:
    trainer = RLTrainer(lora_config(tiny_qwen_dir, target_modules=["q_proj", "v_proj"]))
    module = trainer.policy.module
    shape = adapter_shape(module)
    assert (shape.rank, shape.alpha, shape.target_modules) == (4, 8.0, ["q_proj", "v_proj"])
    tensors = list(iter_adapter(module, 0))
    # 2 layers x (q, v) x (A, B), named as peft saves them
    assert len(tensors) == 8
    assert all(
        n.startswith("base_model.model.model.layers.") and n.endswith((".lora_A.weight", ".lora_B.weight"))
        for n, _ in tensors
    )
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in module.named_parameters() if ".lora_" in n)
    full_bytes = sum(t.numel() * t.element_size() for _, t in trainer.policy.iter_full_params())
    server = ZmqPublisher(tied_aliases={})
    try:
        published = server.publish(tensors, version=1)
        num_bytes = published["num_bytes"]
    finally:
        server.close()
    assert num_bytes == adapter_bytes
    assert num_bytes < 0.02 * full_bytes
    print(f"adapter version: {num_bytes} bytes, full weights {full_bytes} bytes ({num_bytes / full_bytes:.2%})")


def test_target_modules_the_model_lacks_are_named(tiny_qwen_dir: Path) -> None:
    lora = RLLoraConfig(target_modules=["q_proj", "query_key_value", "c_attn"])
    with pytest.raises(ValueError, match=r"\['query_key_value', 'c_attn'\] name no module") as e:
        check_target_modules(str(tiny_qwen_dir), lora)
    assert "q_proj" in str(e.value) and "learner.lora.target_modules" in str(e.value)
    with pytest.raises(ValueError, match="name no module"):
        RLTrainer(lora_config(tiny_qwen_dir, target_modules=["nope_proj"]))


def test_adapter_sync_cannot_take_the_broadcast_transport(tiny_qwen_dir: Path) -> None:
    with pytest.raises(pydantic.ValidationError, match=r"cannot travel over learner\.weights_transport = 'broadcast'"):
        LearnerConfig(model=str(tiny_qwen_dir), lora=RLLoraConfig(), weights_transport="broadcast")
    merged = LearnerConfig(model=str(tiny_qwen_dir), lora=RLLoraConfig(sync="merged"), weights_transport="broadcast")
    assert merged.lora is not None and merged.lora.sync == "merged"


def test_the_kl_reference_is_the_policy_with_its_adapter_off(tiny_qwen_dir: Path) -> None:
    """No second copy of the base: the reference log-probs come from the policy with the adapter disabled,
    the same figures as a separate reference model loaded from the base folder."""
    algo = AlgoConfig(kl=KLConfig(placement="loss", coef=0.5, estimator="k3"))
    shared = RLTrainer(lora_config(tiny_qwen_dir).model_copy(update={"algo": algo}))
    separate = RLTrainer(lora_config(tiny_qwen_dir).model_copy(update={"algo": algo, "ref_model": str(tiny_qwen_dir)}))
    assert shared.ref is shared.policy and separate.ref is not None and separate.ref is not separate.policy
    for seed in (0, 1, 2):
        a, b = shared.step(scored_batch(seed=seed)), separate.step(scored_batch(seed=seed))
        kl = [k for k in a if k.startswith("learner/kl")]
        assert kl, sorted(a)
        for key in [*kl, "learner/loss/total"]:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    assert a["learner/kl_ref"] > 1e-6, "the adapter moved the policy away from its base"
