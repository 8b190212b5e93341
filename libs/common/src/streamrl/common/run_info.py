"""``{run_dir}/up.json``: where a run started by ``streamrl up`` can be reached, for ``streamrl scale``.

Written by the launcher when it starts: the run id, the Redis URL (the embedded server's, or the
recipe's), the backend and the scaling bounds. A password in the URL is never written: the file
then says so, and a reader takes the URL from ``STREAMRL_REDIS__URL``, or, for an embedded Redis, from the
launcher's login file it names (``credentials``, mode 0600).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from streamrl.common.errors import ConfigError

UP_FILE = "up.json"
REDIS_URL_ENV = "STREAMRL_REDIS__URL"
LANE_URLS_ENV = "STREAMRL_LANES__URLS"


@dataclass(frozen=True)
class RunInfo:
    """What ``up.json`` holds."""

    run_id: str
    redis_url: str
    """The URL without its password (if it had one: ``redis_password`` is true)."""
    redis_password: bool = False
    backend: str = "local"
    max_replicas: dict[str, int] = field(default_factory=dict)
    recipe: str = ""
    pid: int = 0
    """Process id of the launcher."""
    lanes: int = 1
    """The run's ``lanes.count``."""
    lane_urls: list[str] = field(default_factory=list)
    """Each lane's Redis URL, without passwords (empty: every lane on ``redis_url``)."""
    credentials: str = ""
    """A file (mode 0600) holding the URL, password included, of the launcher's user of an embedded Redis
    (:mod:`streamrl.ops.embedded_auth`); empty: none."""

    def url(self) -> str:
        """The URL to connect with: ``STREAMRL_REDIS__URL`` if set, else the one in :attr:`credentials`, else the
        stored one (a config error if the stored one lost its password)."""
        if os.environ.get(REDIS_URL_ENV):
            return os.environ[REDIS_URL_ENV]
        if self.credentials:
            try:
                return Path(self.credentials).read_text().strip()
            except OSError as e:
                raise ConfigError(
                    f"cannot read the run's Redis login {self.credentials} ({e}): set {REDIS_URL_ENV}"
                ) from e
        if self.redis_password:
            raise ConfigError(f"the run's Redis URL has a password, which {UP_FILE} does not keep: set {REDIS_URL_ENV}")
        return self.redis_url

    def lane_url_list(self) -> list[str]:
        """The lanes' URLs to connect with: ``STREAMRL_LANES__URLS`` if set, else the stored ones (a config error if
        they lost a password); empty: every lane on :meth:`url`."""
        if os.environ.get(LANE_URLS_ENV):
            return list(json.loads(os.environ[LANE_URLS_ENV]))
        if self.lane_urls and self.redis_password:
            raise ConfigError(
                f"the run's Redis URLs have a password, which {UP_FILE} does not keep: set {LANE_URLS_ENV}"
            )
        return list(self.lane_urls)


def without_password(url: str) -> tuple[str, bool]:
    """``url`` less its password, and whether it had one."""
    parts = urlsplit(url)
    if parts.password is None:
        return url, False
    host = parts.hostname or ""
    netloc = (f"{parts.username}@" if parts.username else "") + host + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc)), True


def write_run_info(run_dir: str | Path, info: RunInfo) -> Path:
    path = Path(run_dir) / UP_FILE
    url, had_password = without_password(info.redis_url)
    lanes = [without_password(u) for u in info.lane_urls]
    had_password = had_password or any(had for _, had in lanes)
    data = asdict(info) | {
        "redis_url": url,
        "redis_password": had_password or info.redis_password,
        "lane_urls": [u for u, _ in lanes],
    }
    path.write_text(json.dumps(data, indent=2))
    return path


def read_run_info(run_dir: str | Path) -> RunInfo:
    path = Path(run_dir) / UP_FILE
    if not path.exists():
        raise ConfigError(f"{path} not found: was this run started with `streamrl up`?")
    return RunInfo(**json.loads(path.read_text()))
