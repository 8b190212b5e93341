"""Every image recipe under docker/ is well formed and builds from what the repo holds.

No Docker engine is needed: the checks read the Dockerfiles as text (continuation lines joined,
comments dropped) and look at instructions, COPY/ADD sources and the .dockerignore file, matched
the way the Docker builder matches it.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, published as tomli
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((REPO / "docker").glob("*.Dockerfile"))
SERVICES = ("coordinator", "rollout", "reward", "learner")
GPU_SERVICES = ("rollout", "reward", "learner")
NEEDS_EXAMPLES = ("reward", "learner")
"""Images that load files of examples/ by path: reward functions; the prepare job runs in the learner's."""
EXTRAS = {"rollout.gpu": {"vllm"}, "reward": {"model"}, "reward.gpu": {"model"}}
"""Extras each image installs with its service package (none where not listed)."""
INSTRUCTIONS = {
    "ADD",
    "ARG",
    "CMD",
    "COPY",
    "ENTRYPOINT",
    "ENV",
    "EXPOSE",
    "FROM",
    "HEALTHCHECK",
    "LABEL",
    "ONBUILD",
    "RUN",
    "SHELL",
    "STOPSIGNAL",
    "USER",
    "VOLUME",
    "WORKDIR",
}


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


def copy_sources_and_destination(args: str) -> tuple[list[str], str]:
    """The sources and the destination of a COPY/ADD (flags dropped; shell or JSON-array form)."""
    words = json.loads(args) if args.startswith("[") else shlex.split(args)
    paths = [word for word in words if not word.startswith("--")]
    return paths[:-1], paths[-1]


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regex: ``**`` crosses folders, ``*`` and ``?`` do not."""
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def dockerignore_patterns(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def is_ignored(path: str, patterns: list[str]) -> bool:
    """Whether the builder leaves ``path`` (relative to the context) out.

    Patterns apply in order and the last one that matches the path or one of its parent folders
    decides (``!pattern`` lets it back in): a folder left out leaves out everything in it.
    """
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    ignored = False
    for raw in patterns:
        negated = raw.startswith("!")
        regex = _pattern_regex(raw.removeprefix("!").strip("/"))
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            ignored = not negated
    return ignored


def arg_defaults(instructions: list[tuple[str, str]]) -> dict[str, str]:
    """``ARG name=default`` values (quotes removed)."""
    defaults = {}
    for keyword, args in instructions:
        if keyword == "ARG" and "=" in args:
            name, _, value = args.partition("=")
            defaults[name] = value.strip("\"'")
    return defaults


def base_image(instructions: list[tuple[str, str]]) -> str:
    """The first FROM image with its ARG defaults substituted."""
    defaults = arg_defaults(instructions)
    image = next(args for keyword, args in instructions if keyword == "FROM").split()[0]
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: defaults[m.group(1) or m.group(2)], image)


def pip_installs(instructions: list[tuple[str, str]]) -> list[list[str]]:
    """The argument lists of every ``pip install`` in RUN instructions."""
    commands = []
    for keyword, args in instructions:
        if keyword != "RUN":
            continue
        for command in re.split(r"&&|;", args):
            words = shlex.split(command)
            while words and re.fullmatch(r"\w+=\S*", words[0]):  # VAR=value before the command
                words = words[1:]
            if words[:2] == ["pip", "install"]:
                commands.append(words[2:])
    return commands


def _name(dockerfile: Path) -> str:
    return dockerfile.name.removesuffix(".Dockerfile")


def _service(dockerfile: Path) -> str:
    return _name(dockerfile).split(".")[0]


def _dockerfile(path: Path) -> list[tuple[str, str]]:
    return parse_dockerfile(path.read_text())


def _ignore_patterns() -> list[str]:
    return dockerignore_patterns((REPO / ".dockerignore").read_text())


def test_parse_dockerfile_joins_continuations_and_drops_comments() -> None:
    text = "# c\nFROM x AS y\nRUN a \\\n    # inside\n    && b\nUSER u\n"
    assert parse_dockerfile(text) == [("FROM", "x AS y"), ("RUN", "a && b"), ("USER", "u")]


def test_is_ignored_follows_the_builder_rules() -> None:
    patterns = ["*", "!libs", "**/__pycache__", "docs", "!docs/keep.md", "*.log"]
    assert is_ignored("README.md", patterns)
    assert not is_ignored("libs/common/pyproject.toml", patterns)
    assert is_ignored("libs/common/src/__pycache__/a.pyc", patterns)
    assert is_ignored("docs/gpu.md", patterns)
    assert not is_ignored("docs/keep.md", patterns)
    assert is_ignored("x.log", patterns)
    assert is_ignored("libs/x.log", ["libs/*.log"]) and not is_ignored("libs/a/x.log", ["libs/*.log"])


def test_the_images_are_the_services_cpu_and_gpu() -> None:
    assert {_name(path) for path in DOCKERFILES} == {*SERVICES, *(f"{s}.gpu" for s in GPU_SERVICES)}


@pytest.mark.parametrize("path", DOCKERFILES, ids=_name)
def test_instructions_are_known_and_start_with_a_base_image(path: Path) -> None:
    instructions = _dockerfile(path)
    unknown = [keyword for keyword, _ in instructions if keyword not in INSTRUCTIONS]
    assert not unknown, f"unknown instructions: {unknown}"
    keywords = [keyword for keyword, _ in instructions]
    assert set(keywords[: keywords.index("FROM")]) <= {"ARG"}, "only ARG may come before the first FROM"


@pytest.mark.parametrize("path", DOCKERFILES, ids=_name)
def test_copy_sources_exist_and_are_not_ignored(path: Path) -> None:
    patterns = _ignore_patterns()
    sources = [
        source
        for keyword, args in _dockerfile(path)
        if keyword in ("COPY", "ADD") and "--from=" not in args
        for source in copy_sources_and_destination(args)[0]
    ]
    assert sources, "no COPY: the image would not hold the project"
    for source in sources:
        assert list(REPO.glob(source)), f"COPY source {source} is missing from the repo"
        assert not is_ignored(source, patterns), f"COPY source {source} is left out by .dockerignore"


@pytest.mark.parametrize("path", DOCKERFILES, ids=_name)
def test_image_runs_the_service_as_a_non_root_user(path: Path) -> None:
    instructions = _dockerfile(path)
    users = [args for keyword, args in instructions if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), f"final USER is {users[-1:] or 'unset'}"
    entrypoints = [args for keyword, args in instructions if keyword == "ENTRYPOINT"]
    assert json.loads(entrypoints[-1]) == ["streamrl", _service(path)]


@pytest.mark.parametrize("path", DOCKERFILES, ids=_name)
def test_image_installs_the_service_with_its_declared_dependencies(path: Path) -> None:
    service = _service(path)
    installs = pip_installs(_dockerfile(path))
    with_deps = [args for args in installs if "--no-deps" not in args]
    targets = {word for args in with_deps for word in args if word.startswith("./")}
    pattern = re.compile(rf"\./services/{service}(?:\[([\w,-]+)\])?")
    service_targets = [m for t in targets if (m := pattern.fullmatch(t))]
    assert "./libs/common" in targets and service_targets, f"no pip install of the packages in {with_deps}"
    extras = {e for m in service_targets if m.group(1) for e in m.group(1).split(",")}
    assert extras == EXTRAS.get(_name(path), set())
    declared = tomllib.loads((REPO / "services" / service / "pyproject.toml").read_text())["project"]
    assert extras <= set(declared.get("optional-dependencies", {})), f"extras not in {service}'s pyproject.toml"
    code = [args for args in installs if "--no-deps" in args]
    assert code and {"./libs/common", f"./services/{service}"} <= set(code[-1]), "the code is never installed"


@pytest.mark.parametrize("path", DOCKERFILES, ids=_name)
def test_image_installs_the_local_packages_its_service_depends_on(path: Path) -> None:
    """A service's streamrl-* dependencies (streamrl-torchkit for the rollout and the learner) are not on
    any package index: the image installs each from its folder, dependencies first, then the code."""
    service = _service(path)
    declared = tomllib.loads((REPO / "services" / service / "pyproject.toml").read_text())["project"]
    local = {
        f"./libs/{name.removeprefix('streamrl-')}"
        for name in (re.split(r"[\s\[;<>=]", dep, maxsplit=1)[0] for dep in declared["dependencies"])
        if name.startswith("streamrl-")
    }
    assert local, f"{service} declares no streamrl package"
    installs = pip_installs(_dockerfile(path))
    with_deps = {word for args in installs if "--no-deps" not in args for word in args}
    code = [args for args in installs if "--no-deps" in args]
    assert local <= with_deps, f"{sorted(local - with_deps)} not installed with their dependencies"
    assert code and local <= set(code[-1]), f"{sorted(local - set(code[-1]))} code never installed"


@pytest.mark.parametrize("path", DOCKERFILES, ids=_name)
def test_image_installs_the_streamrl_command_it_runs(path: Path) -> None:
    """The entry point is ``streamrl <service>``: the command is streamrl-ops' console script
    (libs/ops), so every image installs that package too, with its dependencies, then its code."""
    installs = pip_installs(_dockerfile(path))
    with_deps = {word for args in installs if "--no-deps" not in args for word in args}
    code = [args for args in installs if "--no-deps" in args]
    assert "./libs/ops" in with_deps, "libs/ops (the streamrl command) is not installed with its dependencies"
    assert code and "./libs/ops" in code[-1], "the code of libs/ops (the streamrl command) is never installed"


@pytest.mark.parametrize("path", DOCKERFILES, ids=_name)
def test_cpu_images_stay_cpu_and_gpu_images_use_cuda_with_python_3_12(path: Path) -> None:
    instructions = _dockerfile(path)
    image = base_image(instructions)
    runs = " ".join(args for keyword, args in instructions if keyword == "RUN")
    if _name(path).endswith(".gpu"):
        assert image.startswith("nvidia/cuda:") and image.endswith("-ubuntu24.04"), image
        assert "python3.12 -m venv" in runs, "the GPU image's venv is not Python 3.12"
    else:
        assert image == "python:3.12-slim", image


@pytest.mark.parametrize("path", DOCKERFILES, ids=_name)
def test_torch_versions_agree(path: Path) -> None:
    version = arg_defaults(_dockerfile(path)).get("TORCH_VERSION")
    if _name(path).endswith(".gpu"):
        # The rollout GPU image takes the torch its vLLM pins; the others name that version.
        assert _service(path) == "rollout" or version == "2.14.0"
    elif _service(path) != "coordinator":
        tested = re.search(r"^torch==(\S+)$", (REPO / "requirements-dev.txt").read_text(), re.M)
        assert tested and version == tested.group(1), "CPU images should run the torch the tests run"


@pytest.mark.parametrize("path", DOCKERFILES, ids=_name)
def test_learner_images_install_deepspeed(path: Path) -> None:
    installs = pip_installs(_dockerfile(path))
    assert any("deepspeed" in args for args in installs) == (_service(path) == "learner")


@pytest.mark.parametrize("path", DOCKERFILES, ids=_name)
def test_images_that_load_examples_by_path_hold_them_under_app(path: Path) -> None:
    copies = [
        copy_sources_and_destination(args)
        for keyword, args in _dockerfile(path)
        if keyword in ("COPY", "ADD") and "--from=" not in args
    ]
    has_examples = (["examples"], "/app/examples") in copies
    assert has_examples == (_service(path) in NEEDS_EXAMPLES)


def test_dockerignore_keeps_local_state_out_of_the_build_context() -> None:
    patterns = _ignore_patterns()
    for path in (
        ".venv/bin/python",
        "runs/demo/x",
        ".git/HEAD",
        "tests/unit/x.py",
        "docs/gpu.md",
        "libs/common/src/streamrl/common/__pycache__/x.pyc",
        "services/rollout/.venv/x",
        "examples/arithmetic/__pycache__/task.cpython-312.pyc",
    ):
        assert is_ignored(path, patterns), f"{path} would be sent to the builder"
    for path in (
        "constraints.txt",
        "libs/common/pyproject.toml",
        "services/learner/src",
        "examples/arithmetic/task.py",
    ):
        assert not is_ignored(path, patterns), f"{path} would be missing from the build context"
