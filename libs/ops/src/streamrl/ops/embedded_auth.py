"""The users of ``streamrl up``'s embedded Redis: a new password per service at every start, never shown.

An embedded redis-server (no ``redis.url`` in the recipe) is never open to whoever can reach its port
(any local user can reach 127.0.0.1). At each start the launcher makes a random password per user
(:func:`new_passwords`): one per service and ``observer``, with the grants of :mod:`streamrl.ops.redis_acl`
(what a service may do is the same as under compose or Kubernetes), and ``launcher``, which reads what
the progress display shows, writes the run's desired replica counts (``streamrl scale``) and the Ray
backend's incarnation counters, and runs ``INFO`` (memory use). The ``default`` user is off.

What is written, and where (:func:`write_files`, into the server's data folder ``{run_dir}/redis``):

* ``users.acl``: the ACL file the server loads (``--aclfile``): SHA-256 hashes, not passwords; mode 0600.
* ``launcher.url``: the launcher user's URL, password included, mode 0600, for ``streamrl scale`` (named in
  ``up.json`` as ``credentials``) and whoever runs the launcher's account.

The services' passwords are written nowhere: each service process gets its own user's URL in its
environment (``STREAMRL_REDIS__URL``, and ``lanes.urls`` with lanes), which only its own account can
read (``/proc/PID/environ`` is mode 0400). A new launch makes new passwords (the ACL file is not in the
AOF), so a resumed run never reuses a password a process of the old one knew.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from streamrl.common.streams import StreamNames
from streamrl.ops.ray_backend import incarnations_key
from streamrl.ops.redis_acl import USERS, Grant, acl_file, grants, rule_line
from streamrl.ops.scaling import replicas_key

LAUNCHER = "launcher"
"""The launcher's own user (the progress display, ``streamrl scale``, memory checks)."""
ACL_FILE = "users.acl"
LAUNCHER_URL_FILE = "launcher.url"


def new_passwords() -> dict[str, str]:
    """A random password (48 hex digits) for every user of :data:`~streamrl.ops.redis_acl.USERS` and the launcher."""
    return {user: secrets.token_hex(24) for user in (*USERS, LAUNCHER)}


def launcher_grants(run_id: str, lanes: int = 1) -> list[Grant]:
    """What the launcher user may do: read every key of the run (each lane's too), set the desired replica
    counts (a service's and its lanes', in one transaction) and count the Ray backend's actor incarnations
    (both on the home)."""
    home = StreamNames(run_id)
    own = Grant(
        "RW", (replicas_key(home), incarnations_key(home)), ("hset", "hgetall", "hkeys", "hdel", "hincrby", "del")
    )
    return [*grants("observer", run_id, lanes), own]


def acl_text(run_id: str, passwords: Mapping[str, str], lanes: int = 1) -> str:
    """The ACL file of the embedded server(s): :func:`streamrl.ops.redis_acl.acl_file`, plus the launcher."""
    # multi/exec: a service's count and its lanes' own counts change in one transaction (scaling.request_replicas)
    keyless = ("info", "multi", "exec")
    launcher = rule_line(LAUNCHER, passwords[LAUNCHER], launcher_grants(run_id, lanes), keyless=keyless)
    services = {user: passwords[user] for user in USERS}
    return acl_file(run_id, services, lanes) + launcher + "\n"


def user_url(url: str, user: str, password: str) -> str:
    """``url`` (``redis://host:port/db``) logged in as ``user``."""
    parts = urlsplit(url)
    host = f"{parts.hostname}:{parts.port}" if parts.port else str(parts.hostname)
    return urlunsplit(parts._replace(netloc=f"{user}:{password}@{host}"))


def write_private(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` readable by this account alone (0600 from the first byte: never a moment
    where another user could open it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    tmp.replace(path)
    return path


def write_files(data_dir: Path, run_id: str, passwords: Mapping[str, str], url: str, lanes: int = 1) -> Path:
    """Write the ACL file and the launcher's URL into ``data_dir`` (both mode 0600); the ACL file's path."""
    data_dir.mkdir(parents=True, exist_ok=True)
    write_private(data_dir / LAUNCHER_URL_FILE, user_url(url, LAUNCHER, passwords[LAUNCHER]) + "\n")
    return write_private(data_dir / ACL_FILE, acl_text(run_id, passwords, lanes))


def read_launcher_url(path: str | Path) -> str:
    """The launcher's URL from its file (:data:`LAUNCHER_URL_FILE`)."""
    return Path(path).read_text().strip()
