"""Every service image recipe under docker/ is well formed and builds from what the repo holds.

No Docker engine is needed: the checks read the Dockerfiles as text (continuation lines joined,
comments dropped) and look at instructions, COPY sources and the .dockerignore file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SERVICES = ("coordinator", "rollout", "reward", "learner")
INSTRUCTIONS = {
    "ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK", "LABEL",
    "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR",
}  # fmt: skip


def parse_dockerfile(text: str) -> list[tuple[str, str]]:
    """Return (INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1].rstrip() + " "
            continue
        keyword, _, args = (pending + stripped).partition(" ")
        instructions.append((keyword.upper(), args.strip()))
        pending = ""
    assert not pending, "the Dockerfile ends inside a continuation line"
    return instructions


def _dockerfile(service: str) -> list[tuple[str, str]]:
    return parse_dockerfile((REPO / "docker" / f"{service}.Dockerfile").read_text())


def test_parse_dockerfile_joins_continuations_and_drops_comments() -> None:
    text = "# c\nFROM x AS y\nRUN a \\\n    # inside\n    && b\nUSER u\n"
    assert parse_dockerfile(text) == [("FROM", "x AS y"), ("RUN", "a && b"), ("USER", "u")]


@pytest.mark.parametrize("service", SERVICES)
def test_instructions_are_known_and_start_with_a_base_image(service: str) -> None:
    instructions = _dockerfile(service)
    unknown = [keyword for keyword, _ in instructions if keyword not in INSTRUCTIONS]
    assert not unknown, f"unknown instructions: {unknown}"
    keywords = [keyword for keyword, _ in instructions]
    assert set(keywords[: keywords.index("FROM")]) <= {"ARG"}, "only ARG may come before the first FROM"


@pytest.mark.parametrize("service", SERVICES)
def test_copy_sources_exist_and_are_not_ignored(service: str) -> None:
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines() if not line.startswith("#")}
    for keyword, args in _dockerfile(service):
        if keyword != "COPY" or "--from=" in args:
            continue
        sources = [part for part in args.split() if not part.startswith("--")][:-1]
        for source in sources:
            assert (REPO / source).exists(), f"COPY source {source} is missing from the repo"
            assert source.split("/")[0] not in ignored, f"COPY source {source} is excluded by .dockerignore"


@pytest.mark.parametrize("service", SERVICES)
def test_image_runs_the_service_as_a_non_root_user(service: str) -> None:
    instructions = _dockerfile(service)
    users = [args for keyword, args in instructions if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), f"final USER is {users[-1:] or 'unset'}"
    entrypoints = [args for keyword, args in instructions if keyword == "ENTRYPOINT"]
    assert json.loads(entrypoints[-1]) == ["streamrl", service]


def test_dockerignore_keeps_local_state_out_of_the_build_context() -> None:
    ignored = set((REPO / ".dockerignore").read_text().splitlines())
    assert {".venv", "runs", ".git", "**/__pycache__"} <= ignored
