"""docs/architecture.md names every stream and key of ``streamrl.common.streams`` and every message type."""

from __future__ import annotations

import inspect
from pathlib import Path

import msgspec

from streamrl.common import messages
from streamrl.common.streams import StreamNames

PAGE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
RUN = "{run}"


def key_patterns() -> dict[str, str]:
    """``StreamNames`` member -> the key it builds, arguments shown as ``{name}`` (``hb:{service}:{instance}``).

    A ``*parts`` member shows the key up to its parts (``streamrl:{run}:lease:``).
    """
    names = StreamNames(RUN[1:-1])
    patterns = {}
    for member, value in inspect.getmembers(StreamNames):
        if member.startswith("_") or member == "run_id":
            continue
        if isinstance(value, property):
            patterns[member] = getattr(names, member)
            continue
        params = list(inspect.signature(value).parameters.values())[1:]
        if params and params[0].kind is inspect.Parameter.VAR_POSITIONAL:
            patterns[member] = getattr(names, member)("").rstrip(":") + ":"
        else:
            patterns[member] = getattr(names, member)(*(f"{{{p.name}}}" for p in params))
    return patterns


def message_structs() -> list[type[msgspec.Struct]]:
    """Every struct defined in ``messages.py`` (the messages and the parts they carry)."""
    return [
        cls
        for _, cls in inspect.getmembers(messages, inspect.isclass)
        if issubclass(cls, msgspec.Struct) and cls.__module__ == messages.__name__ and not cls.__name__.startswith("_")
    ]


def test_key_patterns_are_built_with_the_run_hash_tag() -> None:
    patterns = key_patterns()
    assert patterns["prompts"] == "streamrl:{run}:prompts"
    assert patterns["heartbeat"] == "streamrl:{run}:hb:{service}:{instance}"
    assert patterns["lease"] == "streamrl:{run}:lease:"
    assert len(patterns) >= 14


def test_every_stream_and_key_is_on_the_architecture_page() -> None:
    page = PAGE.read_text()
    missing = [f"{member} ({key})" for member, key in key_patterns().items() if key not in page]
    missing += [f"StreamNames.{member}" for member in key_patterns() if f"`{member}" not in page]
    assert not missing, f"docs/architecture.md does not name: {', '.join(missing)}"


def test_every_message_type_with_its_tag_and_version_is_on_the_architecture_page() -> None:
    page = PAGE.read_text()
    missing = []
    for tag, cls in messages.MESSAGE_TYPES.items():
        versions = sorted(messages.SUPPORTED_VERSIONS[tag])
        row = f"| `{cls.__name__}` | `{tag}` | {', '.join(map(str, versions))} |"
        if row not in page:
            missing.append(row)
    missing += [f"`{cls.__name__}`" for cls in message_structs() if f"`{cls.__name__}`" not in page]
    assert not missing, "docs/architecture.md lacks: " + "; ".join(missing)
