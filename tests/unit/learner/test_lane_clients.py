"""The learner's Redis clients of a run's lanes: one per distinct URL, the home's reused, none without lanes."""

from __future__ import annotations

from streamrl.common.lanes import LanesConfig
from streamrl.learner.rl.lanes import lane_urls, share_clients


def test_lanes_on_one_url_share_a_client_and_a_lane_on_the_homes_url_uses_the_homes() -> None:
    home = "redis://h:1/0"
    assert share_clients(home, [home, "redis://b:2/0", "redis://c:3/0", "redis://b:2/0"]) == [-1, 1, 2, 1]
    assert share_clients(home, [home, home]) == [-1, -1]  # lanes.urls empty: every lane on the home's Redis


def test_each_lane_has_its_url_and_a_run_without_lanes_none() -> None:
    assert lane_urls(LanesConfig(count=2), "redis://h:1/0") == ["redis://h:1/0", "redis://h:1/0"]
    assert lane_urls(LanesConfig(count=2, urls=["redis://a:1", "redis://b:2"]), "redis://h:1/0") == [
        "redis://a:1",
        "redis://b:2",
    ]
    assert lane_urls(LanesConfig(), "redis://h:1/0") == []
