"""The coordinator's config: group_timeout_s is validated and named in the error."""

from __future__ import annotations

import pytest
from coordinator_fakes import config


def test_group_timeout_must_be_positive() -> None:
    assert config().group_timeout_s == 900.0
    with pytest.raises(ValueError, match="group_timeout_s"):
        config(group_timeout_s=0)


def test_a_maxlen_below_what_can_be_in_flight_is_refused_naming_the_fields() -> None:
    """Groups for batches up to version + max_staleness + prefetch_steps are in flight at once, each
    group_size trajectories: a stream capped below that would trim entries no one has read yet."""
    from streamrl.common.config import RedisConfig

    config(redis=RedisConfig(maxlen=1536), prompts_per_step=32, group_size=16, max_staleness=1)  # exactly fits
    with pytest.raises(ValueError, match=r"redis.maxlen \(1000\) .* 1536") as e:
        config(redis=RedisConfig(maxlen=1000), prompts_per_step=32, group_size=16, max_staleness=1)
    for name in ("prompts_per_step", "group_size", "max_staleness", "prefetch_steps"):
        assert name in str(e.value)


def test_evaluation_prompts_count_against_maxlen() -> None:
    from streamrl.common.config import RedisConfig
    from streamrl.coordinator.config import DatasetConfig, EvalConfig

    held_out = EvalConfig(dataset=DatasetConfig(path="eval.jsonl", tokenizer="t"), num_prompts=900)
    with pytest.raises(ValueError, match=r"eval.num_prompts"):
        config(redis=RedisConfig(maxlen=1000), prompts_per_step=8, group_size=8, eval=held_out)


def test_a_batch_far_over_redis_largest_argument_is_accepted() -> None:
    """A batch travels by reference (a manifest in 1 MiB parts, its payloads read in bounded replies): 768 groups of
    8 x 8,192 tokens (~600 MiB of payloads, over proto-max-bulk-len) is a run of 3,000 GPUs, not an error."""
    from streamrl.coordinator.config import SamplingConfig

    config(prompts_per_step=768, group_size=8, sampling=SamplingConfig(max_new_tokens=8192))


def test_each_lane_runs_its_share_of_the_batch_and_only_lane_0_evaluates() -> None:
    from streamrl.common.lanes import LanesConfig
    from streamrl.coordinator.config import DatasetConfig, EvalConfig

    held_out = EvalConfig(dataset=DatasetConfig(path="eval.jsonl", tokenizer="t"))
    lane0 = config(lanes=LanesConfig(count=4), lane=0, prompts_per_step=8, eval=held_out).for_lane()
    lane3 = config(lanes=LanesConfig(count=4), lane=3, prompts_per_step=8, eval=held_out).for_lane()
    assert (lane0.prompts_per_step, lane3.prompts_per_step) == (2, 2)
    assert lane0.eval.dataset is not None and lane3.eval.dataset is None
    assert (lane0.run_dir, lane3.run_dir) == ("runs/default", "runs/default/lane3")  # one metrics.jsonl each
    assert config(prompts_per_step=8).for_lane().prompts_per_step == 8
    with pytest.raises(ValueError, match=r"prompts_per_step = 6 .* lanes.count = 4"):
        config(lanes=LanesConfig(count=4), lane=0, prompts_per_step=6)
