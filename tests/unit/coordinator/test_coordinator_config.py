"""The coordinator's config: group_timeout_s is validated and named in the error."""

from __future__ import annotations

import pytest
from coordinator_fakes import config


def test_group_timeout_must_be_positive() -> None:
    assert config().group_timeout_s == 900.0
    with pytest.raises(ValueError, match="group_timeout_s"):
        config(group_timeout_s=0)
