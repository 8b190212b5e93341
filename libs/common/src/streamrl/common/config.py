"""Typed configuration: base class, shared sections, and loading a run from recipe + overrides.

A run is a recipe file (TOML or YAML) plus overrides. Sources, lowest to highest priority:
defaults, the recipe, environment variables ``STREAMRL_<SECTION>__<FIELD>=value`` and command-line
``--section.field=value``; a number indexes an existing list item (``--reward.scorers.0.token_env=NAME``).
Unknown keys and bad values fail at start with the field named.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from streamrl.common.errors import ConfigError as ConfigError  # re-exported: recipe errors come from here
from streamrl.common.redact import redact

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, published as tomli
    import tomli as tomllib

ENV_PREFIX = "STREAMRL_"
TOP_LEVEL_ENV = {"STREAMRL_RUN_ID": "run_id", "STREAMRL_RUN_DIR": "run_dir", "STREAMRL_LANE": "lane"}
"""Top-level recipe fields settable from single-underscore environment variables."""


class BaseConfig(BaseModel):
    """Base of every config section: unknown keys fail, values are frozen after validation."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class RedisConfig(BaseConfig):
    """Where the bus lives."""

    url: str | None = None
    """``redis://[:password@]host:port/db`` (``rediss://`` for TLS). None = the launcher starts an embedded redis-server."""
    maxlen: int = Field(100_000, ge=100)
    """Approximate MAXLEN of every stream (entries)."""
    max_message_mb: float = Field(32.0, gt=0)
    """Largest message (encoded) a service writes to or handles from a stream (MiB). A bigger output
    fails the entry that produced it (dead-lettered with the sizes); a bigger entry read is
    dead-lettered at once, its payload cut to the first 64 KiB."""
    max_command_mb: float = Field(8.0, gt=0)
    """Largest Redis command a service sends or reply it asks for, in bulk data (MiB): a batch's payloads
    are read in replies of at most this (one payload bigger than it alone), and one call of the commit
    script carries at most this much of outputs (one commit bigger than it alone). Keeps each command
    short, so no client waits long behind another's."""
    outage_s: float = Field(60.0, gt=0)
    """How long a service rides out a Redis outage (a restart, a failover): its commands reconnect and
    retry with backoff for about this long, then the service stops with the error (s)."""
    max_connections: int = Field(256, ge=4)
    """Connections a service opens at most; a command that finds them all busy waits for one."""
    payload_orphan_ttl_s: float = Field(3600.0, gt=0)
    """A trajectory's payload is written before the commit that references it, with this time to live,
    which that commit removes: the payload of a worker that died (or lost its lease) before committing
    expires after it (s). Must exceed the time from generation's end to the commit (outages included)."""
    payload_retention_s: float = Field(0.0, ge=0)
    """Keep trained payloads this long after the checkpoint covering them, and evaluation payloads this long
    after they are scored, instead of deleting them (replay, debugging) (s); 0 = delete them (trained ones
    with the learner's acknowledgement)."""
    retain_consumed_s: float = Field(0.0, ge=0)
    """Every stream read by consumer groups is trimmed to the oldest entry one of its groups still needs
    (pending or unread); consumed entries younger than this are kept too, for tools that read the
    streams (fault-suite accounting, debugging) (s). ``maxlen`` stays the hard cap."""

    @property
    def max_message_bytes(self) -> int:
        return int(self.max_message_mb * 2**20)

    @property
    def max_command_bytes(self) -> int:
        return int(self.max_command_mb * 2**20)


LEASE_TTL_FACTOR = 5.0
"""Default lease TTL in heartbeat intervals: 10 s at the default 2 s. Measured (recipes/smoke.toml, 12
steps, ``streamrl up`` on a 2-core machine at load ~8): worst event-loop pause while running 1.49 s
(coordinator, learner), 1.93 s (reward), 0.06 s (rollout); start-up blocked the loop up to 14.6 s
(learner; covered by the start-up renewer). A recipe with a short heartbeat interval (0.5 s: TTL
2.5 s) is close to that and should set ``consumer.lease_ttl_s``."""


class ConsumerConfig(BaseConfig):
    """Delivery knobs of the consumer loop (docs/design.md section 3)."""

    block_ms: int = Field(200, ge=1, le=4000)
    """XREADGROUP block time per read (ms); below the Redis client's 5 s socket read timeout."""
    count: int = Field(16, ge=1)
    """Entries read per XREADGROUP call."""
    max_in_flight: int = Field(64, ge=1)
    """Entries being handled at once per instance."""
    claim_idle_ms: int = Field(30_000, ge=100)
    """Entries pending longer than this (a consumer died) are reclaimed with XAUTOCLAIM (ms)."""
    claim_interval_s: float = Field(5.0, gt=0)
    """How often to look for idle pending entries (s)."""
    max_deliveries: int = Field(3, ge=1)
    """After this many failed deliveries an entry goes to the dead-letter stream."""
    retry_delay_s: float = Field(0.5, ge=0)
    """Pause before a failed entry is retried by this instance (s)."""
    shutdown_grace_s: float = Field(30.0, ge=0)
    """On SIGTERM, time to drain in-flight entries before cancelling them (s)."""
    heartbeat_interval_s: float = Field(2.0, gt=0)
    """Heartbeat period: the heartbeat key is written, and the leases renewed, this often (s)."""
    lease_ttl_s: float | None = Field(None, gt=0)
    """Time to live of an instance's leases (its name; the coordinator's and learner's role) (s): a
    holder silent this long loses them - a standby takes over, a restarted process may reuse the name.
    It must cover the event loop's worst pause (measured: ``loop_lag_s`` in the heartbeat, a WARNING
    above half the TTL) and be at least twice ``heartbeat_interval_s``. None: ``LEASE_TTL_FACTOR`` x
    ``heartbeat_interval_s`` (10 s at the default interval)."""

    @property
    def lease_ttl(self) -> float:
        """The lease TTL in force (s)."""
        return self.lease_ttl_s if self.lease_ttl_s is not None else LEASE_TTL_FACTOR * self.heartbeat_interval_s

    @model_validator(mode="after")
    def _lease_covers_beats(self) -> ConsumerConfig:
        if self.lease_ttl_s is not None and self.lease_ttl_s < 2 * self.heartbeat_interval_s:
            raise ValueError(
                f"consumer.lease_ttl_s ({self.lease_ttl_s:g} s) must be at least twice consumer.heartbeat_interval_s "
                f"({self.heartbeat_interval_s:g} s): one late renewal would lose the lease"
            )
        return self


T = TypeVar("T", bound=BaseModel)


def read_recipe(path: str | Path) -> dict[str, Any]:
    """Read a TOML (or YAML) recipe into a dict."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"recipe not found: {path}")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe must be a table/mapping at top level")
    return data


def _parse_value(raw: str) -> Any:
    """Parse an override value: JSON if it parses (numbers, bools, lists), else the string."""
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``a.b.c`` in nested dicts; a digit segment under a list indexes an existing item."""
    keys = [k for k in dotted.split(".") if k]
    if not keys:
        raise ConfigError(f"empty override key: {dotted!r}")
    node: dict[str, Any] | list[Any] = data
    for depth, key in enumerate(keys):
        last = depth == len(keys) - 1
        if isinstance(node, list):
            if not key.isdigit():
                raise ConfigError(f"override {dotted!r}: {'.'.join(keys[:depth])!r} is a list; index it by number")
            if int(key) >= len(node):
                raise ConfigError(
                    f"override {dotted!r}: index {key} is past the end of {'.'.join(keys[:depth])!r} "
                    f"({len(node)} items)"
                )
            if last:
                node[int(key)] = value
                return
            child = node[int(key)]
        elif last:
            node[key] = value
            return
        else:
            child = node.setdefault(key, {})
        if not isinstance(child, (dict, list)):
            raise ConfigError(f"override {dotted!r}: {'.'.join(keys[: depth + 1])!r} is not a section")
        node = child


def apply_overrides(data: dict[str, Any], overrides: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Apply ``STREAMRL_A__B=v`` environment variables, then ``a.b=v`` / ``--a.b=v`` overrides."""
    data = json.loads(json.dumps(data))  # deep copy of plain data
    environ: Mapping[str, str] = os.environ if env is None else env
    for name, raw in sorted(environ.items()):
        if name in TOP_LEVEL_ENV:
            _set_dotted(data, TOP_LEVEL_ENV[name], raw)
        elif name.startswith(ENV_PREFIX) and "__" in name:
            dotted = name[len(ENV_PREFIX) :].lower().replace("__", ".")
            _set_dotted(data, dotted, _parse_value(raw))
    for item in overrides:
        item = item.removeprefix("--")
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        key, raw = item.split("=", 1)
        _set_dotted(data, key.replace("-", "_"), _parse_value(raw))
    return data


def validate(cls: type[T], data: dict[str, Any], source: str = "config") -> T:
    """Validate ``data`` into ``cls``; a failure names every bad field."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in e.errors())
        raise ConfigError(f"invalid {source}: {problems}") from e


def load_config(
    cls: type[T], recipe: str | Path | None, overrides: list[str] | None = None, section: str | None = None
) -> T:
    """Load ``cls`` from a recipe (optionally one ``section`` of it) plus env/CLI overrides."""
    data = read_recipe(recipe) if recipe else {}
    data = apply_overrides(data, overrides or [])
    if section is not None:
        node = data.get(section, {})
        shared = {k: v for k, v in data.items() if k in cls.model_fields and k != section}
        node = {**shared, **node}
        data = node
    return validate(cls, data, source=f"{cls.__name__} ({recipe or 'defaults'})")


def save_resolved(config: BaseModel, run_dir: str | Path, name: str) -> Path:
    """Write the resolved config as JSON into the run directory, secrets masked, and return the path."""
    path = Path(run_dir) / f"config.{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(redact(config.model_dump(mode="json")), indent=2))
    return path
