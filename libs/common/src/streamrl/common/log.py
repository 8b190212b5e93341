"""Logging set up once, in a process's entry point: text for humans, JSON lines for containers.

Every line is written with URL passwords masked (:func:`streamrl.common.redact.redact_url`), whatever
library logged it: a ``redis://user:password@host`` or an HTTP scorer's ``http://user:password@host``
never reaches a log file.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from streamrl.common.redact import redact_url


class _JsonFormatter(logging.Formatter):
    def __init__(self, service: str, instance: str) -> None:
        super().__init__()
        self.service = service
        self.instance = instance

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "service": self.service,
            "instance": self.instance,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return redact_url(json.dumps(entry))


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return redact_url(super().format(record))


def setup_logging(service: str, instance: str = "", fmt: str | None = None, level: str | None = None) -> None:
    """Configure the root logger: ``fmt`` = ``text`` | ``json`` (default from ``STREAMRL_LOG_FORMAT``)."""
    fmt = fmt or os.environ.get("STREAMRL_LOG_FORMAT", "text")
    level = level or os.environ.get("STREAMRL_LOG_LEVEL", "INFO")
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter(service, instance))
    else:
        formatter = _TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
        formatter.converter = time.localtime
        handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("httpx", "urllib3", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
