"""The embedded Redis's users without a server: every user gets a password, the ACL file holds hashes only,
the launcher's grants, the login URLs, and files private from their first byte."""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path

from streamrl.ops.embedded_auth import (
    ACL_FILE,
    LAUNCHER,
    LAUNCHER_URL_FILE,
    acl_text,
    launcher_grants,
    new_passwords,
    user_url,
    write_files,
)
from streamrl.ops.redis_acl import USERS


def test_every_user_gets_its_own_new_password() -> None:
    first, second = new_passwords(), new_passwords()
    assert set(first) == {*USERS, LAUNCHER}
    assert len(set(first.values())) == len(first) and all(len(p) == 48 for p in first.values())
    assert not set(first.values()) & set(second.values())


def test_the_acl_file_turns_default_off_and_holds_hashes_not_passwords() -> None:
    passwords = new_passwords()
    text = acl_text("demo", passwords)
    lines = text.splitlines()
    assert lines[0] == "user default off resetkeys resetchannels -@all"
    assert [line.split()[1] for line in lines] == ["default", *USERS, LAUNCHER]
    for user, password in passwords.items():
        assert password not in text
        assert f"#{hashlib.sha256(password.encode()).hexdigest()}" in text, user


def test_the_launcher_reads_the_run_and_writes_only_the_replica_counts() -> None:
    writes = [g for g in launcher_grants("demo") if g.access != "R"]
    assert [(g.keys, set(g.commands)) for g in writes] == [
        (
            ("streamrl:{demo}:state:replicas", "streamrl:{demo}:state:incarnations"),
            {"hset", "hgetall", "hkeys", "hdel", "hincrby", "del"},  # a service's and its lanes' counts
        )
    ]
    launcher_line = acl_text("demo", new_passwords()).splitlines()[-1]
    assert "+info" in launcher_line and "+xadd" not in launcher_line
    assert "+multi" in launcher_line and "+exec" in launcher_line  # the counts change in one transaction


def test_a_login_url_keeps_host_port_and_db() -> None:
    assert user_url("redis://127.0.0.1:6390/0", "rollout", "pw") == "redis://rollout:pw@127.0.0.1:6390/0"


def test_the_files_are_private(tmp_path: Path) -> None:
    passwords = new_passwords()
    acl = write_files(tmp_path / "redis", "demo", passwords, "redis://127.0.0.1:6390/0")
    assert acl.name == ACL_FILE
    login = tmp_path / "redis" / LAUNCHER_URL_FILE
    assert login.read_text().strip() == f"redis://launcher:{passwords[LAUNCHER]}@127.0.0.1:6390/0"
    assert {stat.S_IMODE(p.stat().st_mode) for p in (acl, login)} == {0o600}
