"""RESP framing for the fault proxy: where a command or a reply ends, and what kind of command it is.

Pure functions over bytes, no I/O:

* :func:`next_frame` finds the end of the next complete RESP value (RESP2 and RESP3 types) in a
  buffer, or says it is not complete yet; :func:`parse_command` also returns a command's arguments.
* :func:`command_kind` names a command the way the fault table lists write points: the command,
  the script's name for ``EVAL``/``EVALSHA`` (from :class:`ScriptNames`), and the first key with the
  run's prefix and the per-instance / per-group parts replaced by ``*`` (``XADD batches``,
  ``SET lease:singleton:coordinator``, ``EVALSHA bus.COMMIT_LUA trajectories``).
"""

from __future__ import annotations

import ast
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

CRLF = b"\r\n"
SIMPLE = b"+-:_,#(!"
"""Types whose value runs to the end of the line (``!`` and ``=`` are lengths, handled apart)."""
AGGREGATE = {ord("*"): 1, ord("~"): 1, ord(">"): 1, ord("%"): 2, ord("|"): 2}
"""Aggregate types and how many values each announced element stands for (maps count pairs)."""
BULK = b"$=!"

WRITES = frozenset(
    """XADD XACK XAUTOCLAIM XCLAIM XGROUP XTRIM XDEL XREADGROUP XSETID SET SETEX PSETEX SETNX GETSET GETDEL
    INCR INCRBY INCRBYFLOAT DECR DECRBY HSET HSETNX HMSET HINCRBY HINCRBYFLOAT HDEL DEL UNLINK EXPIRE PEXPIRE
    EXPIREAT PEXPIREAT PERSIST SADD SREM SPOP SMOVE LPUSH RPUSH LPUSHX RPUSHX LREM LPOP RPOP LMOVE BLMOVE LTRIM
    LSET ZADD ZREM ZINCRBY ZPOPMIN ZPOPMAX ZREMRANGEBYSCORE ZREMRANGEBYRANK EVAL EVALSHA FCALL EXEC COPY
    RENAME APPEND""".split()
)
"""Commands with an effect on the data (``XREADGROUP`` and ``XAUTOCLAIM`` move entries into a
consumer's pending list): the ones whose lost reply is an ambiguous fault."""


class IncompleteError(Exception):
    """The buffer ends inside the value: read more."""


def _line_end(buf: bytes | bytearray, pos: int) -> int:
    end = buf.find(CRLF, pos)
    if end < 0:
        raise IncompleteError
    return end


def _skip(buf: bytes | bytearray, pos: int) -> int:
    """The position after the RESP value starting at ``pos`` (raises :class:`IncompleteError`)."""
    if pos >= len(buf):
        raise IncompleteError
    kind = buf[pos]
    end = _line_end(buf, pos + 1)
    if kind in BULK:
        n = int(buf[pos + 1 : end])
        if n < 0:
            return end + 2
        stop = end + 2 + n + 2
        if stop > len(buf):
            raise IncompleteError
        return stop
    if kind in AGGREGATE:
        n = int(buf[pos + 1 : end])
        pos = end + 2
        count = max(n, 0) * AGGREGATE[kind]
        for _ in range(count):
            pos = _skip(buf, pos)
        if kind == ord("|"):  # an attribute precedes the value it describes: one frame with it
            pos = _skip(buf, pos)
        return pos
    if kind in SIMPLE:
        return end + 2
    raise ValueError(f"not RESP: type byte {bytes([kind])!r} at offset {pos}")


def next_frame(buf: bytes | bytearray, pos: int = 0) -> int | None:
    """End offset of the complete RESP value at ``pos``, or None when the buffer ends inside it.

    Raises ValueError on bytes that are not RESP.
    """
    try:
        return _skip(buf, pos)
    except IncompleteError:
        return None


def parse_command(buf: bytes | bytearray, pos: int = 0) -> tuple[list[bytes], int] | None:
    """The arguments of the client command at ``pos`` (an array of bulk strings, or an inline
    command line) and the offset after it; None while incomplete."""
    if pos >= len(buf):
        return None
    if buf[pos] != ord("*"):  # inline command (redis-cli style): one line of words
        end = buf.find(CRLF, pos)
        return (bytes(buf[pos:end]).split(), end + 2) if end >= 0 else None
    end = next_frame(buf, pos)
    if end is None:
        return None
    args: list[bytes] = []
    head = buf.find(CRLF, pos)
    n = int(buf[pos + 1 : head])
    cursor = head + 2
    for _ in range(n):
        if buf[cursor] != ord("$"):
            raise ValueError(f"a command argument must be a bulk string, got type {bytes([buf[cursor]])!r}")
        line = buf.find(CRLF, cursor)
        size = int(buf[cursor + 1 : line])
        args.append(bytes(buf[line + 2 : line + 2 + size]))
        cursor = line + 2 + size + 2
    return args, end


_RUN_PREFIX = re.compile(rb"^streamrl:\{[^}]*\}:")
_NAME_PART = re.compile(r"^[a-z_]+$")


def key_shape(key: bytes) -> str:
    """A run key without its ``streamrl:{run}:`` prefix, its parts after the first that are not plain
    lower-case names (instances, group ids, hashes) as ``*``: ``hb:rollout:*``, ``groups:*``."""
    text = _RUN_PREFIX.sub(b"", key).decode(errors="replace")
    parts = text.split(":")
    shaped = [parts[0]] + [p if _NAME_PART.match(p) else "*" for p in parts[1:]]
    out: list[str] = []
    for p in shaped:
        if not (p == "*" and out and out[-1] == "*"):
            out.append(p)
    return ":".join(out)


@dataclass
class ScriptNames:
    """sha1 -> name of every Lua script the code base defines (``module.CONSTANT``), plus any script
    body seen on the wire (``EVAL`` / ``SCRIPT LOAD``: named by its first line when not known)."""

    names: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_sources(cls, *roots: Path) -> ScriptNames:
        """Every module-level string constant named ``*_LUA`` under ``roots`` (read, not imported), also
        as wrapped by a module's ``PROLOGUE`` + body + ``EPILOGUE`` (the coordinator's fenced scripts)."""
        out = cls()
        bodies: dict[str, str] = {}
        wrappers: list[tuple[str, str]] = []
        for root in roots:
            for path in sorted(root.rglob("*.py")):
                constants = _string_constants(path)
                bodies.update({f"{path.stem}.{k}": v for k, v in constants.items() if k.endswith("_LUA")})
                if "PROLOGUE" in constants and "EPILOGUE" in constants:
                    wrappers.append((constants["PROLOGUE"], constants["EPILOGUE"]))
        for name, body in bodies.items():
            out.names[_sha(body.encode())] = name
            for prologue, epilogue in wrappers:
                out.names.setdefault(_sha((prologue + body + epilogue).encode()), f"{name} (fenced)")
        return out

    def learn(self, body: bytes) -> str:
        sha = _sha(body)
        if sha not in self.names:
            lines = [ln.strip() for ln in body.decode(errors="replace").splitlines()]
            first = next((ln for ln in lines if ln and not ln.startswith("#!")), "")
            self.names[sha] = f"script {sha[:8]} ({first[:40]})"
        return self.names[sha]

    def name(self, sha: bytes) -> str:
        text = sha.decode(errors="replace").lower()
        return self.names.get(text, f"script {text[:8]}")


def _string_constants(path: Path) -> dict[str, str]:
    """Module-level ``NAME = "..."`` string constants of a Python file (empty when it does not parse)."""
    text = path.read_text(errors="replace")
    if "_LUA" not in text and "PROLOGUE" not in text:
        return {}
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return {}
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                out[node.targets[0].id] = node.value.value
    return out


def _sha(body: bytes) -> str:
    return hashlib.sha1(body).hexdigest()


FIRST_KEY_AT = {"XREADGROUP": None, "XGROUP": 2, "XAUTOCLAIM": 1, "XCLAIM": 1, "EVAL": 3, "EVALSHA": 3, "FCALL": 3}
"""Where the first key is for commands where it is not the first argument (None: found by name)."""


def first_key(args: list[bytes]) -> bytes | None:
    name = args[0].upper().decode(errors="replace")
    if name in ("EVAL", "EVALSHA", "FCALL"):
        return args[3] if len(args) > 3 and int(args[2] or 0) > 0 else None
    if name == "XREADGROUP":
        upper = [a.upper() for a in args]
        return (
            args[upper.index(b"STREAMS") + 1]
            if b"STREAMS" in upper and upper.index(b"STREAMS") + 1 < len(args)
            else None
        )
    at = FIRST_KEY_AT.get(name, 1)
    return args[at] if at is not None and len(args) > at else None


def command_kind(args: list[bytes], scripts: ScriptNames) -> str:
    """The table's name of one command (see the module docstring)."""
    if not args:
        return "(empty)"
    name = args[0].upper().decode(errors="replace")
    if name == "SCRIPT" and len(args) > 2 and args[1].upper() == b"LOAD":
        scripts.learn(args[2])
        return "SCRIPT LOAD"
    label = name
    if name == "EVAL" and len(args) > 1:
        label = f"EVAL {scripts.learn(args[1])}"
    elif name == "EVALSHA" and len(args) > 1:
        label = f"EVALSHA {scripts.name(args[1])}"
    key = first_key(args)
    return f"{label} {key_shape(key)}" if key is not None else label


def is_write(args: list[bytes]) -> bool:
    return bool(args) and args[0].upper().decode(errors="replace") in WRITES
