"""Redaction of what is shown: URL passwords and secret-named fields are masked, nothing else changes."""

from __future__ import annotations

import logging

import pytest

from streamrl.common.log import setup_logging
from streamrl.common.redact import MASK, is_secret_name, redact, redact_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:s3cret@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
        ("rediss://svc:s3cret@redis.internal:6380/1", "rediss://svc:***@redis.internal:6380/1"),
        ("redis://:p@ss:w@host:6379/0", "redis://:***@host:6379/0"),
        ("redis://u@x:pa:ss@host/0", "redis://u@x:***@host/0"),
        ("https://bot:tok@rm.example:8000/score", "https://bot:***@rm.example:8000/score"),
    ],
)
def test_redact_url_masks_the_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize(
    "url",
    ["redis://127.0.0.1:6379/0", "rediss://redis.internal:6380/1", "redis://user@host:6379", "http://host:80/a:b@c"],
)
def test_redact_url_leaves_urls_without_password_alone(url: str) -> None:
    assert redact_url(url) == url


def test_redact_url_finds_urls_inside_text() -> None:
    line = "connect to redis://:a1@h1:1/0 then rediss://u:b2@h2:2/0 (retry)"
    assert redact_url(line) == "connect to redis://:***@h1:1/0 then rediss://u:***@h2:2/0 (retry)"


@pytest.mark.parametrize("name", ["password", "PASSWORD", "auth_token", "token", "hmac_secret", "api_key", "apikey"])
def test_secret_names(name: str) -> None:
    assert is_secret_name(name)


@pytest.mark.parametrize(
    "name", ["token_env", "tokenizer", "max_new_tokens", "prompt_key", "label_key", "url", "secret_env", "run_id"]
)
def test_names_that_are_not_secrets(name: str) -> None:
    assert not is_secret_name(name)


def test_redact_masks_nested_config_and_keeps_the_rest() -> None:
    config = {
        "run_id": "r1",
        "redis": {"url": "redis://:s3cret@127.0.0.1:6379/0", "maxlen": 100},
        "reward": {"scorers": [{"type": "http", "urls": ["http://u:pw@rm:8000"], "token_env": "RM_TOKEN"}]},
        "weights": {"hmac_secret": "k3y", "password": None, "api_key": ""},
    }
    shown = redact(config)
    assert shown == {
        "run_id": "r1",
        "redis": {"url": f"redis://:{MASK}@127.0.0.1:6379/0", "maxlen": 100},
        "reward": {"scorers": [{"type": "http", "urls": [f"http://u:{MASK}@rm:8000"], "token_env": "RM_TOKEN"}]},
        "weights": {"hmac_secret": MASK, "password": None, "api_key": ""},
    }
    assert config["redis"]["url"] == "redis://:s3cret@127.0.0.1:6379/0"  # the input is not changed


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_log_lines_are_written_with_url_passwords_masked(
    fmt: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever logs a URL (a library's own line, an exception's text), the line written masks its password."""
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))  # restored after setup_logging replaces them
    monkeypatch.setattr(root, "level", root.level)
    setup_logging("reward", "r0", fmt=fmt, level="INFO")
    try:
        raise ConnectionError("cannot reach http://u:pw-123@rm:8000/score")
    except ConnectionError:
        logging.getLogger("aiohttp.client").exception("posting to %s failed", "https://u:pw-123@rm:8000")
    err = capsys.readouterr().err
    assert "pw-123" not in err
    assert err.count(f"u:{MASK}@rm:8000") >= 2  # the message and the exception
