"""The lifecycle every service shares: parse args and config, log it, run, stop cleanly.

A service entry point calls :func:`service_main` with its config class and an async ``run``
function. SIGTERM / SIGINT set ``ctx.stop``: the service stops intake and drains in-flight work
(the consumer loop gives it ``shutdown_grace_s``), then exits 0. A heartbeat key is kept fresh the
whole time; ``streamrl <service> RECIPE --check`` reads it for container health checks. SIGUSR1 logs
the stack of every asyncio task (``kill -USR1 PID`` on a service that seems stuck).

Leases (:mod:`streamrl.common.lease`), taken before ``run`` starts: the instance name, and for the
coordinator and learner their role. Once held, the bus is **fenced** by the service's lease
(``ctx.bus.fence``: the role for a singleton, the name otherwise): a process whose lease another
holds writes nothing. Their TTL is ``consumer.lease_ttl_s``. While the service starts
(``ctx.status == "starting"`` - until ``mark_running()``) a thread renews them
(:class:`streamrl.common.liveness.StartupRenewer`), so a blocking start (dataset, tokenizer, model,
wandb) never costs the lease; no service-side change is needed. Once running, the heartbeat renews
them on the event loop, whose worst pause is measured (``loop_lag_s`` in the heartbeat, a WARNING
over half the TTL, and in the stop line).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import io
import json
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import redis.asyncio as aioredis
from pydantic import Field
from redis.exceptions import NoPermissionError, RedisError, ResponseError

from streamrl.common import aio
from streamrl.common.aio import cancel_and_wait
from streamrl.common.bus import Bus, Fence, RedisLoginError, connect
from streamrl.common.config import BaseConfig, ConsumerConfig, RedisConfig, load_config, save_resolved
from streamrl.common.config_docs import service_help
from streamrl.common.consumer import ConsumerLoop
from streamrl.common.errors import ConfigError
from streamrl.common.health import check, default_instance, heartbeat_forever
from streamrl.common.lanes import LanesConfig, check_lane, lane_names, resolve_url
from streamrl.common.lease import Lease, LeaseHeldError, LeaseLostError, holder_token
from streamrl.common.liveness import StartupRenewer, watch_loop_lag
from streamrl.common.log import setup_logging
from streamrl.common.redact import redact
from streamrl.common.streams import StreamNames
from streamrl.common.telemetry.prom import NULL_METRICS, Metrics, setup_metrics
from streamrl.common.telemetry.prom_config import PromConfig
from streamrl.common.telemetry.tracing import NULL_TRACING, Tracing, setup_tracing
from streamrl.common.telemetry.tracing_config import TracingConfig

logger = logging.getLogger(__name__)
SINGLETONS = ("coordinator", "learner")
"""Services with one instance per run: each leases its role (:mod:`streamrl.common.lease`)."""
GC_YOUNG_THRESHOLD = 10_000
"""Allocations between two collections of the youngest generation once a service runs (default 700)."""


class ServiceConfig(BaseConfig):
    """Fields every service shares; they live at the top level of a recipe."""

    run_id: str = Field("default", pattern=r"^[A-Za-z0-9_.-]+$")
    """Run id: prefixes every stream and key of the run."""
    run_dir: str = "runs/default"
    """Directory for the resolved config, checkpoints, metrics and plots."""
    redis: RedisConfig = RedisConfig()
    consumer: ConsumerConfig = ConsumerConfig()
    tracing: TracingConfig = TracingConfig()
    """OpenTelemetry traces of the samples this service handles (:mod:`streamrl.common.telemetry.tracing`)."""
    prometheus: PromConfig = PromConfig()
    """This service's Prometheus endpoint (``port`` 0: none)."""
    lanes: LanesConfig = LanesConfig()
    """The run's lanes (:mod:`streamrl.common.lanes`): count 1 = none."""
    lane: int | None = Field(None, ge=0)
    """The lane this rollout, reward or coordinator instance serves (``STREAMRL_LANE``), when the run has lanes."""
    standby: bool = False
    """Coordinator and learner (one of each per run): if another instance holds the run's lease, wait
    as a standby and take over when its lease expires, instead of refusing to start."""


C = TypeVar("C", bound=ServiceConfig)


@dataclass
class ServiceContext:
    """What a running service gets: its config, the bus, stream names, a stop event, its loops."""

    service: str
    instance: str
    config: ServiceConfig
    bus: Bus
    names: StreamNames
    stop: asyncio.Event
    burst: bool = False
    loops: list[ConsumerLoop] = field(default_factory=list)  # type: ignore[type-arg]
    status: str = "starting"
    policy_version: int = -1
    loop_lag_s: float = 0.0
    """The event loop's worst pause since the service runs (s) (:mod:`streamrl.common.liveness`)."""
    paused: str = ""
    """Why the service consumes nothing for now (it resumes by itself); empty while it works. A running service
    with a reason beats ``status = paused`` with it (``Heartbeat.reason``)."""
    weights_relay: str = ""
    """``host:port`` where this instance serves the weights it holds onward (a rollout worker on the ``relay``
    transport); empty otherwise."""
    tracing: Tracing = NULL_TRACING
    metrics: Metrics = NULL_METRICS

    def mark_running(self) -> None:
        """Start-up is over (model, tokenizer, dataset loaded): report ``running`` and move every
        object built so far out of the cyclic garbage collector's reach (``gc.freeze``).

        Those objects live as long as the process. Left in the oldest generation, each full
        collection walked all of them: ~0.27 s per collection for the ~400k objects of a
        coordinator or rollout worker, ~7% of a core at a few steps per second. The youngest
        generation is also collected less often (every 10k instead of 700 allocations): a
        service allocates ~15 tracked objects per message it decodes, and with the default
        thresholds the collections it triggered cascaded into full ones every few steps.
        """
        self.status = "running"
        gc.collect()
        gc.freeze()
        _, older, oldest = gc.get_threshold()
        gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)

    def snapshot(self) -> dict[str, int | str | float]:
        """Heartbeat counters summed over this instance's consumer loops."""
        return {
            "processed": sum(loop.stats.processed for loop in self.loops),
            "failed": sum(loop.stats.failed for loop in self.loops),
            "retried": sum(loop.stats.retried for loop in self.loops),
            "dead_lettered": sum(loop.stats.dead_lettered for loop in self.loops),
            "in_flight": sum(loop.stats.in_flight for loop in self.loops),
            "policy_version": self.policy_version,
            "status": "paused" if self.paused and self.status == "running" else self.status,
            "loop_lag_s": round(self.loop_lag_s, 3),
            "reason": self.paused,
            "weights_relay": self.weights_relay,
        }

    def record_loop_lag(self, pause_s: float) -> None:
        self.loop_lag_s = max(self.loop_lag_s, pause_s)


def parse_args(service: str, argv: list[str], config_cls: type[ServiceConfig] | None = None) -> argparse.Namespace:
    """The service's arguments; ``--help`` lists every field of ``config_cls`` (type, default, docstring)."""
    wants_help = config_cls is not None and bool({"-h", "--help"} & set(argv))
    parser = argparse.ArgumentParser(
        prog=f"streamrl {service}",
        description=f"Run the streamrl {service} service.",
        epilog=service_help(service, config_cls, ServiceConfig.model_fields) if wants_help and config_cls else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("recipe", nargs="?", help="recipe file (TOML/YAML); env STREAMRL_RECIPE if omitted")
    parser.add_argument("--check", action="store_true", help="health check: exit 0 if this service heartbeats")
    parser.add_argument("--dry-run", action="store_true", help="validate and print the config, then exit")
    parser.add_argument("--burst", action="store_true", help="exit when the input stream is drained")
    parser.add_argument("--instance", default=None, help="instance name (default: hostname-pid)")
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if not o.startswith("--") or "=" not in o]
    if bad:
        parser.error(f"unrecognised arguments {bad}: overrides look like --section.field=value")
    args.overrides = overrides
    return args


def service_main(
    service: str,
    config_cls: type[C],
    run: Callable[[C, ServiceContext], Awaitable[None]],
    argv: list[str] | None = None,
) -> int:
    """Entry point shared by all services. Returns the process exit code."""
    import os

    args = parse_args(service, sys.argv[1:] if argv is None else argv, config_cls)
    recipe = args.recipe or os.environ.get("STREAMRL_RECIPE")
    try:
        config = load_config(config_cls, recipe, args.overrides, section=service)
    except ConfigError as e:
        print(f"streamrl {service}: {e}", file=sys.stderr)
        return 2
    problem = check_lane(service, config.lane, config.lanes)
    try:
        aio.event_loop()
    except ValueError as e:
        problem = str(e)
    if problem is not None:
        print(f"streamrl {service}: {problem}", file=sys.stderr)
        return 2
    instance = args.instance or default_instance()
    if args.check:
        if not config.redis.url:
            print("--check needs redis.url", file=sys.stderr)
            return 2
        url, names = aio.run(where(config))
        return check(url, names, service, args.instance)
    setup_logging(service, instance)
    shown = redact(config.model_dump(mode="json"))
    logger.info("%s config: %s", service, json.dumps(shown, sort_keys=True))
    if args.dry_run:
        print(json.dumps(shown, indent=2))
        return 0
    if not config.redis.url:
        print(f"streamrl {service}: redis.url is not set (use `streamrl up` for an embedded redis)", file=sys.stderr)
        return 2
    Path(config.run_dir).mkdir(parents=True, exist_ok=True)
    # one file per lane's service: a run's lanes share its run_dir
    lane = config.lane if config.lanes.enabled else None
    save_resolved(config, config.run_dir, service if lane is None else f"{service}.lane{lane}")
    try:
        metrics = setup_metrics(config.prometheus)
        tracing = setup_tracing(
            config.tracing, service=service, instance=instance, run_id=config.run_id, run_dir=config.run_dir
        )
    except ConfigError as e:
        print(f"streamrl {service}: {e}", file=sys.stderr)
        return 2
    try:
        return aio.run(_serve(service, instance, config, run, burst=args.burst, tracing=tracing, metrics=metrics))
    finally:
        tracing.shutdown()  # flushes the spans still queued
        metrics.close()


async def _serve(
    service: str,
    instance: str,
    config: C,
    run: Callable[[C, ServiceContext], Awaitable[None]],
    burst: bool,
    tracing: Tracing = NULL_TRACING,
    metrics: Metrics = NULL_METRICS,
) -> int:
    url, names = await where(config)
    redis = connect(url, outage_s=config.redis.outage_s, max_connections=config.redis.max_connections)
    ctx = ServiceContext(
        service=service,
        instance=instance,
        config=config,
        bus=bus_of(redis, config.redis, service),
        names=names,
        stop=asyncio.Event(),
        burst=burst,
        tracing=tracing,
        metrics=metrics,
    )
    metrics.watch_consumers(ctx.snapshot)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _request_stop, ctx, sig)
    loop.add_signal_handler(signal.SIGUSR1, _dump_tasks, service)
    interval_s = config.consumer.heartbeat_interval_s
    token = holder_token(instance)  # one per process: its leases name it
    held: list[Lease] = []

    async def renew() -> None:
        for lease in held:
            await lease.renew()

    beat: asyncio.Task[None] | None = None
    beat_error: list[BaseException] = []

    def beat_ended(task: asyncio.Task[None]) -> None:
        """Without its heartbeat (or a lease) the instance counts as dead (its entries get claimed): it stops too."""
        if not task.cancelled() and task.exception() is not None:
            beat_error.append(task.exception())  # type: ignore[arg-type]
            ctx.stop.set()

    ttl_s = config.consumer.lease_ttl
    renewer = StartupRenewer(url, held, interval_s, starting=lambda: ctx.status in ("starting", "standby"))
    lag = asyncio.create_task(watch_loop_lag(ctx.record_loop_lag, ttl_s, running=lambda: ctx.status == "running"))
    try:
        # the instance name is its consumer name: one live process per name (a killed predecessor's
        # lease expires within one TTL; a live one makes this process refuse to start)
        name = await _lease(ctx, token, ("instance", service, instance), f"instance name {service}/{instance}")
        held.extend([name] if name else [])
        renewer.start()  # the service's start-up may block the event loop: its leases are kept meanwhile
        if name is not None and service not in SINGLETONS:
            ctx.bus.fence = Fence(name.key, token)  # its writes stop the moment another process holds its name
        beat = asyncio.create_task(
            heartbeat_forever(redis, ctx.names, service, instance, interval_s, ctx.snapshot, before_beat=renew)
        )
        beat.add_done_callback(beat_ended)
        if service in SINGLETONS:
            role = await _lease(ctx, token, ("singleton", service), f"the {service} of run {config.run_id!r}")
            if role is None:
                logger.info("%s/%s: stopped while standing by", service, instance)
                return 0
            held.append(role)
            ctx.bus.fence = Fence(role.key, token)  # a deposed coordinator/learner writes nothing
        await run(config, ctx)
        if beat_error:
            raise beat_error[0]
    except (LeaseHeldError, LeaseLostError, RedisLoginError) as e:  # said in one line: the user acts on it
        logger.error("%s: %s", service, e)
        return 1
    except RedisError as e:  # one line, the traceback at debug level
        logger.debug("%s: redis error", service, exc_info=True)
        logger.error("%s: %s", service, redis_stop_reason(e, config.redis.outage_s))
        return 1
    finally:
        renewer.stop()
        await _leave(ctx, [lag, *([beat] if beat else [])], held)
    worst = f"worst event-loop pause while running: {ctx.loop_lag_s:.2f} s; lease TTL {ttl_s:.1f} s"
    logger.info("%s/%s stopped (%s)", service, instance, worst)
    return 0


def bus_of(redis: aioredis.Redis, config: RedisConfig, service: str) -> Bus:
    """A Bus on ``redis`` with the limits and lifetimes of ``config`` (a service's own, or one more it writes to),
    keeping ``service``'s ``once`` keys."""
    return Bus(
        redis,
        maxlen=config.maxlen,
        max_message_bytes=config.max_message_bytes,
        max_command_bytes=config.max_command_bytes,
        outage_s=config.outage_s,
        retain_consumed_s=config.retain_consumed_s,
        payload_orphan_ttl_s=config.payload_orphan_ttl_s,
        payload_retention_s=config.payload_retention_s,
        once_scope=service,
    )


async def where(config: ServiceConfig) -> tuple[str, StreamNames]:
    """The Redis URL and the key names a service instance uses: its lane's when it serves one
    (:mod:`streamrl.common.lanes`), else the run's."""
    assert config.redis.url is not None
    if not config.lanes.enabled:
        return config.redis.url, StreamNames(config.run_id)
    if config.lane is None:  # the home: on a Redis Cluster, the node serving the run's own keys
        names = StreamNames(config.run_id)
        return await resolve_url(config.redis.url, names.prompts, outage_s=config.redis.outage_s), names
    names = lane_names(config.run_id, config.lane)
    url = config.lanes.url(config.lane, config.redis.url)
    return await resolve_url(url, names.prompts, outage_s=config.redis.outage_s), names


def redis_stop_reason(error: RedisError, outage_s: float) -> str:
    """Why a service stops on ``error``: a refusal (an ACL's NOPERM, an unknown command, OOM, ...) is
    said as what Redis answered; only a connection lost past the outage window is "lost redis"."""
    if isinstance(error, NoPermissionError):
        return f"redis refused a command for this service's user (ACL), stopping: NOPERM {error}"
    if isinstance(error, ResponseError):
        return f"redis refused a command, stopping: {error}"
    return f"lost redis for more than {outage_s:.0f} s, stopping: {error}"


async def _leave(ctx: ServiceContext, tasks: list[asyncio.Task[None]], held: list[Lease]) -> None:
    """Stop the heartbeat, remove it and give the leases up (else they expire by themselves), close Redis."""
    await cancel_and_wait(tasks)
    redis = ctx.bus.redis
    try:
        await asyncio.wait_for(_unregister(redis, ctx.names, ctx.service, ctx.instance, held), timeout=5)
    except (RedisError, asyncio.TimeoutError) as e:
        logger.warning(
            "%s: could not remove its heartbeat (%s); it expires by itself",
            ctx.service,
            type(e).__name__ if isinstance(e, asyncio.TimeoutError) else e,
        )
    await redis.aclose()


async def _lease(ctx: ServiceContext, token: str, parts: tuple[str, ...], what: str) -> Lease | None:
    """Take the lease ``names.lease(*parts)``: wait up to one TTL for a predecessor's to expire (it
    may have just died), then refuse (LeaseHeldError); a singleton with ``standby`` waits until it is
    free or the service is stopped (None)."""
    ttl_s = ctx.config.consumer.lease_ttl
    lease = Lease(ctx.bus.redis, ctx.names.lease(*parts), token, ttl_s, what)
    standby = parts[0] == "singleton" and ctx.config.standby
    if standby:
        ctx.status = "standby"
    if not await lease.acquire(wait_s=None if standby else 1.25 * ttl_s, stop=ctx.stop):
        return None
    ctx.status = "starting"
    return lease


async def _unregister(
    redis: aioredis.Redis, names: StreamNames, service: str, instance: str, leases: list[Lease]
) -> None:
    await redis.delete(names.heartbeat(service, instance))
    await redis.srem(names.instances, f"{service}:{instance}")
    for lease in reversed(leases):  # the role first: a standby takes over at once
        await lease.release()


def _dump_tasks(service: str) -> None:
    """Log where every asyncio task of this process is waiting."""
    out = io.StringIO()
    tasks = asyncio.all_tasks()
    for task in tasks:
        task.print_stack(limit=12, file=out)
    logger.warning("%s: %d asyncio tasks\n%s", service, len(tasks), out.getvalue())


def _request_stop(ctx: ServiceContext, sig: signal.Signals) -> None:
    if not ctx.stop.is_set():
        logger.info("%s: got %s, stopping intake and draining", ctx.service, sig.name)
        ctx.status = "draining"
        ctx.stop.set()
