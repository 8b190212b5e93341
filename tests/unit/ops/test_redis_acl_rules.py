"""The ACL users' rules as data: who may append to, consume, and write what; the file and its inputs.

tests/integration/test_redis_acl.py checks the same rules on a real redis-server.
"""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path

import pytest

from streamrl.common.lanes import lane_names
from streamrl.common.streams import StreamNames
from streamrl.ops.redis_acl import (
    CONSUME,
    PASSWORD_ENV,
    SERVICES,
    USERS,
    acl_file,
    grants,
    main,
    new_passwords,
    user_rule,
)

NAMES = StreamNames("r1")


def allowed(command: str, key: str) -> set[str]:
    """Users with a grant of ``command`` on exactly the key ``key``."""
    return {user for user in USERS for g in grants(user, "r1") if command in g.commands and key in g.keys}


def test_only_the_producer_of_a_stream_may_append_to_it() -> None:
    producers = {
        NAMES.prompts: {"coordinator"},
        NAMES.trajectories: {"rollout"},
        NAMES.scored: {"reward"},
        NAMES.batches: {"coordinator"},
        NAMES.weights: {"learner"},
        NAMES.dead: set(SERVICES),  # every consumer dead-letters what it cannot handle
    }
    assert {stream: allowed("xadd", stream) for stream in producers} == producers


def test_each_service_consumes_its_own_input_only() -> None:
    consumers = {
        NAMES.prompts: "rollout",
        NAMES.trajectories: "reward",
        NAMES.scored: "coordinator",
        NAMES.batches: "learner",
    }
    for stream, user in consumers.items():
        assert all(allowed(command, stream) == {user} for command in CONSUME), stream
    assert not allowed("xreadgroup", NAMES.weights) and not allowed("xreadgroup", NAMES.dead)


def test_categories_of_commands_are_granted_on_a_service_own_state_only() -> None:
    streams = {NAMES.prompts, NAMES.trajectories, NAMES.scored, NAMES.batches, NAMES.weights, NAMES.dead}
    for user in SERVICES:
        for g in grants(user, "r1"):
            if any("@" in c for c in g.commands):
                assert not streams & set(g.keys) and all(
                    ":state:" in k or ":groups" in k or ":batched:" in k for k in g.keys
                ), g
                assert "-@dangerous" in g.commands and "-scan" in g.commands


def test_the_observer_reads_and_runs_nothing_else() -> None:
    assert all(g.access == "R" for g in grants("observer", "r1"))
    rule = user_rule("observer", "r1", "p" * 16)
    assert "+eval" not in rule and "+multi" not in rule and "~streamrl:r1:*" not in rule.replace("%R~", "")


def test_the_file_disables_default_and_holds_hashes_not_passwords() -> None:
    passwords = new_passwords()
    text = acl_file("r1", passwords)
    lines = text.splitlines()
    assert lines[0].startswith("user default off") and [line.split()[1] for line in lines[1:]] == list(USERS)
    for user, password in passwords.items():
        assert password not in text
        assert f"user {user} on #{hashlib.sha256(password.encode()).hexdigest()} " in text


@pytest.mark.parametrize(
    ("password", "error"),
    [("short", "at least 16 characters"), ("has@an/at-and-slash-x", "letters, digits")],
)
def test_a_weak_or_url_breaking_password_is_refused_naming_the_variable(password: str, error: str) -> None:
    passwords = {**new_passwords(), "reward": password}
    with pytest.raises(ValueError, match=f"STREAMRL_REDIS_PASSWORD_REWARD.*{error}"):
        acl_file("r1", passwords)


def test_a_missing_password_or_a_glob_in_the_run_id_is_refused() -> None:
    passwords = new_passwords()
    del passwords["observer"]
    with pytest.raises(ValueError, match="no password for STREAMRL_REDIS_PASSWORD_OBSERVER"):
        acl_file("r1", passwords)
    with pytest.raises(ValueError, match="run_id 'r\\*'"):
        acl_file("r*", new_passwords())


def test_cli_prints_new_passwords_and_writes_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["passwords"]) == 0
    lines = capsys.readouterr().out.splitlines()
    env = dict(line.split("=", 1) for line in lines)
    assert list(env) == [PASSWORD_ENV.format(user=u.upper()) for u in USERS] and len(set(env.values())) == len(USERS)
    out = tmp_path / "users.acl"
    for name in env:
        monkeypatch.delenv(name, raising=False)
    assert main(["acl", "--run-id", "r1", "--out", str(out)]) == 2
    assert "no password for STREAMRL_REDIS_PASSWORD_COORDINATOR" in capsys.readouterr().err
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["acl", "--run-id", "r1", "--out", str(out)]) == 0
    assert out.read_text() == acl_file("r1", {u: env[PASSWORD_ENV.format(user=u.upper())] for u in USERS})
    assert stat.S_IMODE(out.stat().st_mode) == 0o644


def test_with_lanes_each_lane_service_is_granted_on_the_lanes_keys_the_joiner_and_learner_on_home_and_lanes() -> None:
    lanes = [lane_names("r1", k) for k in range(2)]

    def users(command: str, key: str) -> set[str]:
        return {user for user in USERS for g in grants(user, "r1", lanes=2) if command in g.commands and key in g.keys}

    for lane in lanes:
        assert users("xadd", lane.trajectories) == {"rollout"} and users("xreadgroup", lane.prompts) == {"rollout"}
        assert users("xadd", lane.scored) == {"reward"} and users("xreadgroup", lane.trajectories) == {"reward"}
        assert users("xadd", lane.prompts) == {"coordinator"} and users("xreadgroup", lane.scored) == {"coordinator"}
        assert users("xadd", lane.weights) == {"coordinator"}  # the joiner mirrors the home's weights
        assert users("xreadgroup", lane.batches) == {"coordinator"}  # and joins the lane batches
        assert users("unlink", lane.batched_samples("*", "*")) == {"coordinator", "learner"}
        assert users("get", lane.batched_samples("*", "*")) == {"learner"}
    assert users("xadd", NAMES.batches) == {"coordinator"} and users("xreadgroup", NAMES.batches) == {"learner"}
    assert users("xadd", NAMES.weights) == {"learner"}
    assert users("set", NAMES.lease("singleton", "joiner")) == {"coordinator"}
    # rollout and reward touch no key of the home
    home = [k for user in ("rollout", "reward") for g in grants(user, "r1", lanes=2) for k in g.keys]
    assert home and all("{r1/lane" in k for k in home)
    observer = grants("observer", "r1", lanes=2)[0].keys
    assert set(observer) == {NAMES.all_keys, lanes[0].all_keys, lanes[1].all_keys}
    assert grants("rollout", "r1", lanes=1) == grants("rollout", "r1")  # no lanes: as before
    assert "{r1/lane1}" in acl_file("r1", new_passwords(), lanes=2)
