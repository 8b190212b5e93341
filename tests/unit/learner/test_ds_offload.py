"""ZeRO offload settings: what reaches DeepSpeed, and what is refused at start."""

from __future__ import annotations

import pytest


def test_offload_settings_reach_deepspeed_and_are_refused_where_zero_cannot_offload() -> None:
    from pydantic import ValidationError

    from streamrl.learner.ds_config import DeepSpeedConfig

    ds = DeepSpeedConfig(zero_stage=3, offload_optimizer=True, offload_params=True).to_deepspeed_dict(cuda=True)
    zero = ds["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert "fused" not in ds["optimizer"]["params"]  # the states step on the host
    assert (
        "offload_optimizer"
        not in DeepSpeedConfig(zero_stage=3, offload_optimizer=True).to_deepspeed_dict(train=False)["zero_optimization"]
    )
    with pytest.raises(ValidationError, match="offload_optimizer=true needs zero_stage >= 1"):
        DeepSpeedConfig(zero_stage=0, offload_optimizer=True)
    with pytest.raises(ValidationError, match="offload_params=true needs zero_stage = 3"):
        DeepSpeedConfig(zero_stage=2, offload_params=True)
