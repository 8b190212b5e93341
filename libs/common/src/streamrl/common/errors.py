"""Domain errors. Retry policy is expressed by the exception type a handler raises."""

from __future__ import annotations


class ConfigError(ValueError):
    """Bad configuration; raised at start, names the field."""


class PoisonMessageError(Exception):
    """The entry can never be handled (undecodable, unknown type or version): dead-letter it now."""


class MessageTooLargeError(PoisonMessageError):
    """A message over ``redis.max_message_mb``: never written to a stream, and dead-lettered when read."""


class RetryableError(Exception):
    """A transient failure: leave the entry pending so it is delivered again after ``defer_s``."""

    def __init__(self, message: str, defer_s: float = 1.0) -> None:
        super().__init__(message)
        self.defer_s = defer_s


class WeightSyncError(RuntimeError):
    """A weight update missed its deadline or failed its checksum."""
