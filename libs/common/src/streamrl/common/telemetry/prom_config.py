"""``[prometheus]``: the metrics endpoint a service serves for Prometheus to scrape.

Pydantic only; :mod:`streamrl.common.telemetry.prom` acts on it. Several services on one host need one port
each (``[rollout.prometheus] port = 9102``); replicas in containers can share the port number.
"""

from __future__ import annotations

import ipaddress

from pydantic import Field, model_validator

from streamrl.common.config import BaseConfig


class PromConfig(BaseConfig):
    """Where the ``/metrics`` endpoint listens and the token a scrape must carry."""

    port: int = Field(0, ge=0, le=65535)
    """TCP port of the endpoint; 0 = no endpoint and no metrics kept."""
    host: str = "127.0.0.1"
    """Interface to listen on (``0.0.0.0`` in a container: then ``token_env`` is required)."""
    token_env: str | None = None
    """Environment variable holding the bearer token every scrape must send
    (``Authorization: Bearer <token>``, 401 otherwise); None = no token, allowed on loopback only."""

    @model_validator(mode="after")
    def _check(self) -> PromConfig:
        if self.port and self.token_env is None and not is_loopback(self.host):
            raise ValueError(
                f"token_env: an endpoint on {self.host!r} (not loopback) needs a bearer token; set token_env to "
                "the environment variable that holds it"
            )
        return self


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (``127.0.0.0/8``, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
