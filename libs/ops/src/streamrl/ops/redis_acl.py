"""Redis ACL users of a run: one per service, each allowed only the commands, on the keys, its job needs.

Redis is started with the file :func:`acl_file` renders (``redis-server --aclfile users.acl``); the
``default`` user is off, so every client logs in as one of these users
(``redis://rollout:PASSWORD@redis:6379/0``). The file holds SHA-256 hashes of the passwords, never
the passwords. What each user may do, keys under ``streamrl:{run}:`` (:mod:`streamrl.common.streams`):

    user         consumes and trims (group)   follows            writes
    coordinator  scored (coordinator)         weights, dead      prompts, batches, dead, state:* but
                                                                 state:learner*, groups*, batched:*,
                                                                 once:coordinator:*, payload:* (RENAME,
                                                                 UNLINK, DEL)
    rollout      prompts (rollout)            weights            trajectories, dead, served,
                                                                 payload:* (SET, PERSIST, EXISTS)
    reward       trajectories (reward)        -                  scored, dead; reads payload:* (GET, GETRANGE)
    learner      batches (learner, + XRANGE,  -                  weights, dead, state:learner*,
                 XREAD)                                          once:learner:*, batched:* (GET, HMGET,
                                                                 UNLINK, EXPIRE)
    observer     -                            every key (reads)  nothing

and every service: its own heartbeats ``hb:{service}:*`` and leases ``lease:instance:{service}:*``
(the coordinator and learner also ``lease:singleton:{service}``, which fences their writes: the
bus's scripts GET it), the ``instances`` set, and reading every heartbeat (to judge a peer dead,
:mod:`streamrl.common.peers`). On the streams a user gets exactly the commands of its role there;
on its own state keys (the coordinator's ``state:*`` and group buffers, the learner's
``state:learner*``) every data command (:data:`OWN_STATE`), so that how a service keeps its own
state is its own business. The coordinator's ``state:*`` leaves out the learner's ledger
(:func:`but_prefix`: glob patterns for "any name not starting with ``learner``").

``once:{service}:{op}`` keys (:mod:`streamrl.common.tx`) make a write run once however often the client
re-sends it: only the coordinator and the learner make such writes (transactions, the coordinator's
fenced scripts, ``Bus.publish``), each in its own namespace, with GET, SET and DEL (:data:`ONCE`): neither can
read, delete or pre-empt the other's (a deleted ``once`` key would let a re-sent write run twice). Rollout and
reward write only through consumer commits, which acknowledge an input entry and are made idempotent by checking
that it is still pending (XPENDING), not by a ``once`` key.

Each consumer loop trims the stream it consumes to what its groups still need
(:mod:`streamrl.common.trim`: XINFO GROUPS, XPENDING, TIME, XTRIM MINID ~), so a consumer may XTRIM
its input; ACL cannot tell a trim by consumption from any other, so that is as narrow as it gets.
No user may trim (or delete) a stream it does not consume.

Each grant is one ACL selector, ``(%R~key +xread ...)``: Redis allows a command when one selector
lists the command *and* matches every key it touches with the access it needs. So a rollout
worker may XACK and XCLAIM on ``prompts`` (a consumer needs write access to its stream for that)
but not XADD there: XADD is granted on ``trajectories`` alone.

Scripts grant nothing: Redis checks every command a Lua script calls against the caller's ACL, on
the keys the command really touches. The shared commit script (:data:`streamrl.common.bus.COMMIT_LUA`)
writes each service's outputs and acks as that service's user, so a rollout worker asking it to XADD
to ``weights`` is refused like a direct XADD. The script commands themselves (EVAL, EVALSHA,
SCRIPT LOAD / EXISTS) are allowed on every key the user may touch (a script declares the keys it
touches; EVAL counts each as read and written, so the heartbeat keys of other services that the
dead-peer script checks with EXISTS are declared too). No service sends MULTI / EXEC (a re-sent
EXEC would run twice): those are not granted.

**Lanes** (``lanes.count = K > 1``, :mod:`streamrl.common.lanes`; ``acl --lanes K``): a user is one per
service whatever the lane, and one file serves every lane's Redis. Rollout and reward get their grants above on
each lane's keys (``streamrl:{run/lanek}:``) and nothing on the home's. The coordinator gets its grants on each
lane's keys and on the home's (lane 0's coordinator joins: it publishes the joined ``batches`` and their
parts on the home), plus the joiner's lease (``lease:singleton:joiner`` of the home) and, on each lane,
XADD on ``weights`` (the mirror of the home's) and consuming ``batches`` (the lane batches it joins). The
learner keeps its grants on the home and reads and deletes the payloads of every lane's batches
(``batched:*``: GET, HMGET, UNLINK, EXPIRE). The observer reads the home and every lane.

Run ``python -m streamrl.ops.redis_acl --help``: ``passwords`` prints new random passwords as
``.env`` lines, ``acl --run-id RUN`` renders the file from ``STREAMRL_REDIS_PASSWORD_<USER>``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import secrets
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from streamrl.common.lanes import lane_names
from streamrl.common.lease import takes_key
from streamrl.common.streams import StreamNames
from streamrl.common.tx import once_key

SERVICES = ("coordinator", "rollout", "reward", "learner")
"""The streamrl services; each logs in as the user of its own name and consumes as the group of that name."""
USERS = (*SERVICES, "observer")
"""Every ACL user: the services and ``observer`` (read-only, for status tools and health checks)."""
PASSWORD_ENV = "STREAMRL_REDIS_PASSWORD_{user}"
"""Environment variable holding a user's password (``{user}`` upper-cased)."""
MIN_PASSWORD_CHARS = 16
_PASSWORD = re.compile(r"^[A-Za-z0-9._~-]+$")
"""Characters that go into a ``redis://user:password@host`` URL as they are."""
_RUN_ID = re.compile(r"^[A-Za-z0-9_.-]+$")
"""As ``ServiceConfig.run_id``: no glob character can widen a key pattern."""

CONNECTION = ("ping",)
"""What a client sends besides AUTH (always allowed): the pool's health check. Not ``client|setinfo``,
which redis-py also sends: Redis 7.0 does not know it (an ACL naming it fails to load) and the client
ignores its refusal (on Redis >= 7.2 one line per user in ACL LOG)."""
SCRIPTS = ("eval", "evalsha", "script|load", "script|exists")
"""The bus's scripts (commit, transactions, the dead-peer check, lease renewal): EVALSHA, loaded on a miss."""
CONSUME = (
    "xgroup|create",
    "xgroup|delconsumer",
    "xreadgroup",
    "xack",
    "xclaim",
    "xpending",
    "xinfo|consumers",
    "xinfo|groups",
    "xtrim",
    "time",
)
"""A :class:`streamrl.common.consumer.ConsumerLoop` on its stream: reading, acking, claiming what a dead
consumer held (XPENDING + XCLAIM), forgetting a dead consumer, and trimming by consumption (XTRIM MINID,
TIME for the age of what is kept)."""
FOLLOW = ("xread", "xrange", "xrevrange", "xlen")
"""A :class:`streamrl.common.follower.StreamFollower` (and a look at the last entries)."""
PUBLISH = ("xadd",)
LEASE = ("set", "get", "pexpire", "del", "incr")
"""A :class:`streamrl.common.lease.Lease` on its instance name (and, for the coordinator and the learner, its
role), with its take count (``{lease}:takes``); the bus's scripts GET the lease that fences them."""
ONCE = ("get", "set", "del")
"""The ``once`` keys of :mod:`streamrl.common.tx`: looked up (a re-send), set with the replies, removed
when a commit without an entry failed."""
SERVER_WIDE = ("-@dangerous", "-scan", "-randomkey", "-dbsize", "-lolwut")
"""Taken out of every category grant: administration, and the reads that name no key (they would see
every key of the server, e.g. ``KEYS``, ``SCAN``)."""
OWN_STATE = ("@read", "@write", *SERVER_WIDE)
"""Every data command on a service's own state keys: the ACL guards what services share (the streams,
each other's keys), not which data types one uses for its own state."""
READ_ONLY = ("@read", *SERVER_WIDE)
"""The observer's commands: every read, nothing that writes."""


@dataclass(frozen=True)
class Grant:
    """Some commands on some keys with one access: one ACL selector."""

    access: Literal["R", "W", "RW"]
    """What the commands may do to the keys: read, write, or both (Redis' ``%R~``, ``%W~``, ``~``)."""
    keys: tuple[str, ...]
    """Full key names or glob patterns (built from :class:`StreamNames`)."""
    commands: tuple[str, ...]
    """Commands, ``command|subcommand`` or ``@category``, lower case, applied in order; a leading ``-``
    takes one out again."""

    def rule(self) -> str:
        prefix = {"R": "%R~", "W": "%W~", "RW": "~"}[self.access]
        commands = (c if c.startswith("-") else "+" + c for c in self.commands)
        return "(" + " ".join([*(prefix + k for k in self.keys), *commands]) + ")"


def grants(user: str, run_id: str, lanes: int = 1) -> list[Grant]:
    """What ``user`` may do in run ``run_id`` of ``lanes`` lanes (see the module docstring), one :class:`Grant`
    per selector."""
    if user not in USERS:
        raise ValueError(f"unknown Redis user {user!r}; known: {', '.join(USERS)}")
    if not _RUN_ID.match(run_id):
        raise ValueError(f"run_id {run_id!r}: use letters, digits, '_', '.' and '-' only")
    if lanes < 1:
        raise ValueError(f"lanes: {lanes} < 1")
    home = StreamNames(run_id)
    if lanes == 1:
        return _grants(user, home)
    spaces = [lane_names(run_id, k) for k in range(lanes)]
    if user == "observer":
        return [Grant("R", (home.all_keys, *(n.all_keys for n in spaces)), READ_ONLY)]
    if user in ("rollout", "reward"):
        return [g for names in spaces for g in _grants(user, names)]
    if user == "coordinator":
        joiner = [Grant("RW", _lease_keys(home.lease("singleton", "joiner")), LEASE)]
        for names in spaces:
            joiner += [Grant("W", (names.weights,), PUBLISH), Grant("RW", (names.batches,), (*CONSUME, "xrange"))]
        return [*(g for names in spaces for g in _grants(user, names)), *_grants(user, home), *joiner]
    payloads = tuple(names.batched_samples("*", "*") for names in spaces)
    return [*_grants(user, home), Grant("RW", payloads, ("get", "hmget", "unlink", "expire"))]


def _lease_keys(key: str) -> tuple[str, str]:
    """A lease and its take count (an instance lease's glob covers both)."""
    return key, takes_key(key)


def _grants(user: str, names: StreamNames) -> list[Grant]:
    """What ``user`` may do on the keys of ``names`` (a run's, or one lane's)."""
    if user == "observer":
        return [Grant("R", (names.all_keys,), READ_ONLY)]
    consumes = {
        "coordinator": names.scored,
        "rollout": names.prompts,
        "reward": names.trajectories,
        "learner": names.batches,
    }[user]
    common = [
        Grant("RW", (consumes,), CONSUME),
        Grant("W", (names.dead,), PUBLISH),
        Grant("RW", (names.heartbeat(user, "*"),), ("set", "del")),
        Grant("R", (names.heartbeat("*", "*"),), ("exists", "mget")),
        Grant("RW", (names.instances,), ("sadd", "srem", "smembers")),
        Grant("RW", (names.lease("instance", user, "*"),), LEASE),
    ]
    if user in ("coordinator", "learner"):  # one per run (streamrl.common.lifecycle.SINGLETONS)
        common.append(Grant("RW", _lease_keys(names.lease("singleton", user)), LEASE))
        common.append(Grant("RW", (once_key([names.all_keys], "*", user),), ONCE))  # their own transactions run once
    if user == "coordinator":
        state = but_prefix(names.state(""), "learner")  # the run state, less the learner's ledger
        own = [
            Grant("W", (names.prompts, names.batches), PUBLISH),
            Grant("R", (names.weights, names.dead), FOLLOW),
            Grant(
                "RW", (*state, names.group_buffer("*"), names.group_index, names.batched_samples("*", "*")), OWN_STATE
            ),
            # payloads: renamed under their batch, deleted with the records the coordinator drops (evaluation
            # payloads given redis.payload_retention_s instead, when set) - one selector with the batch's keys:
            # a command's keys must all match one selector
            Grant(
                "RW",
                (names.payload_prefix + "*", names.batched_samples("*", "*")),
                ("rename", "unlink", "del", "pexpire"),
            ),
        ]
    elif user == "rollout":
        own = [
            Grant("W", (names.trajectories,), PUBLISH),
            Grant("R", (names.weights,), FOLLOW),
            Grant("RW", (names.served_versions,), ("hset", "hdel")),
            # each trajectory's payload, written once before the commit that PERSISTs it
            Grant("RW", (names.payload_prefix + "*",), ("set", "persist", "exists")),
        ]
    elif user == "reward":
        own = [Grant("W", (names.scored,), PUBLISH), Grant("R", (names.payload_prefix + "*",), ("get", "getrange"))]
    else:
        own = [
            Grant("W", (names.weights,), PUBLISH),
            # the ledger reads what is still to come (after a restart); the prefetch waits for the next batch (XREAD)
            Grant("R", (names.batches,), ("xrange", "xread")),
            Grant("R", (names.state("batch_index"),), ("get",)),  # how far the coordinator has published (gaps)
            Grant("RW", (names.state("learner*"),), OWN_STATE),
            # a batch's payloads, read by reference and deleted once the batch is trained and checkpointed
            Grant("RW", (names.batched_samples("*", "*"),), ("get", "hmget", "unlink", "expire")),
        ]
    return common + own


def but_prefix(base: str, word: str) -> tuple[str, ...]:
    """Glob patterns that together match every key ``base + name`` whose non-empty ``name`` does not start
    with ``word`` (ACL key patterns cannot say "not"): ``[^l]*``, ``l``, ``l[^e]*``, ``le``, ... for
    ``learner``. ``word``: letters, digits and ``_`` only."""
    if not word or not re.fullmatch(r"[A-Za-z0-9_]+", word):
        raise ValueError(f"but_prefix: {word!r} must be letters, digits and '_' (a glob would widen the patterns)")
    patterns = []
    for i, letter in enumerate(word):
        if i:
            patterns.append(base + word[:i])
        patterns.append(f"{base}{word[:i]}[^{letter}]*")
    return tuple(patterns)


def user_rule(user: str, run_id: str, password: str, lanes: int = 1) -> str:
    """The ACL file line of ``user``: enabled, its password's SHA-256, no default access, its selectors."""
    check_password(user, password)
    return rule_line(user, password, grants(user, run_id, lanes))


def rule_line(user: str, password: str, selectors: list[Grant], keyless: tuple[str, ...] = ()) -> str:
    """The ACL file line of a user allowed ``selectors`` and the commands ``keyless`` (which name no key, e.g.
    ``info``), besides the connection's."""
    root = ["resetkeys", "resetchannels", "-@all", *("+" + c for c in (*CONNECTION, *keyless))]
    if any(g.access != "R" for g in selectors):
        # services run scripts: one may declare any key the user may touch (its commands are checked one by one)
        touched = dict.fromkeys(k for g in selectors for k in g.keys)
        root += [*("+" + c for c in SCRIPTS), *("~" + k for k in touched)]
    digest = hashlib.sha256(password.encode()).hexdigest()
    return " ".join(["user", user, "on", f"#{digest}", *root, *(g.rule() for g in selectors)])


def check_password(user: str, password: str) -> None:
    env = PASSWORD_ENV.format(user=user.upper())
    if len(password) < MIN_PASSWORD_CHARS:
        raise ValueError(f"{env}: the password of {user} needs at least {MIN_PASSWORD_CHARS} characters")
    if not _PASSWORD.match(password):
        raise ValueError(f"{env}: use letters, digits and '._~-' only (the password goes into a redis:// URL)")


def acl_file(run_id: str, passwords: Mapping[str, str], lanes: int = 1) -> str:
    """The ACL file of run ``run_id`` (of ``lanes`` lanes; the same file on every lane's Redis): ``default`` off,
    then one line per user of :data:`USERS`."""
    missing = [PASSWORD_ENV.format(user=u.upper()) for u in USERS if not passwords.get(u)]
    if missing:
        raise ValueError(f"no password for {', '.join(missing)}")
    lines = ["user default off resetkeys resetchannels -@all"]
    lines += [user_rule(user, run_id, passwords[user], lanes) for user in USERS]
    return "\n".join(lines) + "\n"


def passwords_from_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Each user's password from ``STREAMRL_REDIS_PASSWORD_<USER>`` (absent ones left out)."""
    env = os.environ if env is None else env
    found = {user: env.get(PASSWORD_ENV.format(user=user.upper()), "") for user in USERS}
    return {user: password for user, password in found.items() if password}


def new_passwords() -> dict[str, str]:
    """A random password per user (48 hex digits each)."""
    return {user: secrets.token_hex(24) for user in USERS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m streamrl.ops.redis_acl", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("passwords", help="print a new random password per user, as .env lines")
    acl = sub.add_parser("acl", help="render the ACL file from STREAMRL_REDIS_PASSWORD_<USER> variables")
    acl.add_argument("--run-id", required=True, help="the run whose keys the users may touch")
    acl.add_argument("--lanes", type=int, default=1, help="the run's lanes.count (the same file on every lane's Redis)")
    acl.add_argument("--out", type=Path, help="write the file here (mode 0644) instead of printing it")
    args = parser.parse_args(argv)
    if args.command == "passwords":
        for user, password in new_passwords().items():
            print(f"{PASSWORD_ENV.format(user=user.upper())}={password}")
        return 0
    try:
        text = acl_file(args.run_id, passwords_from_env(), args.lanes)
    except ValueError as e:
        print(f"redis_acl: {e}", file=sys.stderr)
        return 2
    if args.out is None:
        sys.stdout.write(text)
        return 0
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(text)
    tmp.chmod(0o644)  # read by the redis-server user; it holds hashes of random passwords only
    tmp.replace(args.out)
    print(f"redis_acl: wrote {len(USERS)} users of run {args.run_id} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
