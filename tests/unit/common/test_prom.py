"""The Prometheus endpoint answers a real HTTP scrape: token, off switch, start-up errors; Redis gauges: integration."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest
from prom_scrape import scrape
from pydantic import ValidationError

from streamrl.common.errors import ConfigError
from streamrl.common.telemetry.prom import NULL_METRICS, PromMetrics, setup_metrics
from streamrl.common.telemetry.prom_config import PromConfig


def test_with_a_token_every_scrape_must_carry_it() -> None:
    served = setup_metrics(PromConfig(port=_free_port(), token_env="METRICS_TOKEN"), env={"METRICS_TOKEN": "s3cret"})
    try:
        assert isinstance(served, PromMetrics)
        served.set_engine_queue_depth(2)
        for token in (None, "wrong"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                scrape(served.port, token)
            refused.value.close()  # the error holds the refused response's connection
            assert refused.value.code == 401
        assert scrape(served.port, "s3cret")[("streamrl_engine_queue_depth", ())] == 2
    finally:
        served.close()


def test_port_zero_is_off() -> None:
    metrics = setup_metrics(PromConfig())
    assert metrics is NULL_METRICS and metrics.port == 0
    metrics.count_samples("generated", 3)
    metrics.watch_streams("redis://127.0.0.1:1/0", {"prompts": "x"})  # never connects
    metrics.close()


def test_a_missing_token_variable_fails_at_start() -> None:
    with pytest.raises(ConfigError, match="environment variable METRICS_TOKEN is not set"):
        setup_metrics(PromConfig(port=_free_port(), token_env="METRICS_TOKEN"), env={})


def test_a_busy_port_fails_at_start_naming_the_field() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ConfigError, match=r"prometheus.port: cannot listen on 127.0.0.1:\d+"):
            setup_metrics(PromConfig(port=taken.getsockname()[1]))


def test_an_endpoint_off_loopback_needs_a_token() -> None:
    with pytest.raises(ValidationError, match="token_env"):
        PromConfig(port=9100, host="0.0.0.0")
    assert PromConfig(port=9100, host="0.0.0.0", token_env="METRICS_TOKEN").host == "0.0.0.0"
    assert PromConfig(port=9100, host="::1").token_env is None
    assert PromConfig(host="0.0.0.0").port == 0  # no endpoint, nothing to protect


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
