"""Config users can see: ``--help`` lists every field, docs/configuration.md is current, every field documented."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Literal

import pytest
from pydantic import Field

from streamrl.common.config import BaseConfig
from streamrl.common.config_docs import FieldDoc, config_help, field_docs, service_field_docs, undocumented

ROOT = Path(__file__).resolve().parents[2]


def _generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Http(BaseConfig):
    """An HTTP thing."""

    type: Literal["http"] = "http"
    """Kind."""
    urls: list[str]
    """Where."""


class _Local(BaseConfig):
    """A local thing."""

    type: Literal["local"] = "local"
    """Kind."""
    path: str = "x.py"
    """What."""


class _Inner(BaseConfig):
    """Inner section."""

    coef: float = Field(0.01, ge=0)
    """Beta."""
    mode: Literal["a", "b"] = "a"
    """Which."""


class _Outer(BaseConfig):
    run_id: str = "default"
    """Run id."""
    inner: _Inner = _Inner()
    critic: _Inner | None = None
    """Optional section."""
    items: list[_Http | _Local] = []
    """Things."""
    bare: int = 3


def test_rows_are_dotted_as_overrides_write_them_with_type_default_and_docstring() -> None:
    rows = {row.path: row for row in field_docs(_Outer)}
    assert rows["inner.coef"] == FieldDoc("inner.coef", "float", "0.01", "Beta.")
    assert rows["inner.mode"].type == '"a" | "b"' and rows["inner.mode"].default == '"a"'
    assert "inner" not in rows  # a section without a docstring of its own gets no row, its fields do
    assert rows["critic"].type == "section | None" and rows["critic"].default == "None"
    assert rows["critic.coef"].doc == "Beta."
    assert rows["items"].type == "list[section]"
    http = [row for row in field_docs(_Outer) if row.path == "items.N.urls"]
    assert http and http[0].variant == 'type = "http"' and http[0].default == "required"
    assert undocumented(field_docs(_Outer)) == ["bare"]


def test_service_rows_put_shared_fields_at_the_top_level_and_own_fields_under_the_section() -> None:
    paths = [row.path for row in service_field_docs(_Outer, "svc", shared={"run_id"})]
    assert paths[0] == "svc.inner.coef" and "run_id" in paths and "svc.run_id" not in paths
    text = config_help(service_field_docs(_Outer, "svc", shared={"run_id"}))
    assert '  svc.inner.mode  ("a" | "b") = "a"\n      Which.' in text
    assert "svc.bare  (int) = 3\n      (undocumented)" in text


@pytest.mark.parametrize("service", ["coordinator", "rollout", "reward", "learner"])
def test_service_help_lists_every_field_with_its_type_default_and_docstring(
    service: str, capsys: pytest.CaptureFixture[str]
) -> None:
    module = importlib.import_module(f"streamrl.{service}.__main__")
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    model = dict(_generator().SERVICES)[service]
    rows = service_field_docs(model, service, _generator().SHARED)
    missing = [row.path for row in rows if f"  {row.path}  ({row.type})" not in out]
    assert not missing, f"streamrl {service} --help does not list {missing}"
    assert "redis.url  (str | None) = None" in out
    if service == "coordinator":
        assert "  coordinator.group_size  (int) = 8\n      Samples per prompt (n)." in out
    if service == "learner":
        assert '  learner.algo.kl.estimator  ("k1" | "k2" | "k3" | "k3+") = "k1"' in out


def test_the_configuration_page_is_current() -> None:
    generator = _generator()
    page = ROOT / "docs" / "configuration.md"
    assert page.exists() and page.read_text() == generator.render(), (
        f"docs/configuration.md is stale (a config field or docstring changed): run `{generator.COMMAND}`"
    )


def test_every_config_field_has_a_docstring() -> None:
    rows = [row for _, _, section_rows in _generator().sections() for row in section_rows]
    missing = sorted(set(undocumented(rows)))
    assert not missing, "fields without a docstring (add one under the field): " + ", ".join(missing)


def test_the_generator_check_mode_reports_a_stale_page(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    generator = _generator()
    generator.PAGE = tmp_path / "configuration.md"
    generator.PAGE.write_text("old\n")
    assert generator.main(["--check"]) == 1
    assert "python scripts/gen_config_docs.py" in capsys.readouterr().err
    assert generator.main([]) == 0 and generator.main(["--check"]) == 0


@pytest.mark.parametrize(
    ("entry", "model"),
    [
        ("streamrl.learner.offline.cli:sft_main", "SFTConfig"),
        ("streamrl.learner.offline.cli:rm_main", "RMConfig"),
        ("streamrl.learner.offline.cli:dpo_main", "DPOConfig"),
        ("streamrl.reward.serve_rm:serve_rm_main", "ServeRmConfig"),
    ],
)
def test_offline_and_serve_rm_help_list_every_field(entry: str, model: str, capsys: pytest.CaptureFixture[str]) -> None:
    module, _, func = entry.partition(":")
    assert getattr(importlib.import_module(module), func)(["--help"]) == 0
    out = capsys.readouterr().out
    missing = [row.path for row in field_docs(getattr(_generator(), model)) if f"  {row.path}  ({row.type})" not in out]
    assert not missing, f"{entry} --help does not list {missing}"


def test_up_help_lists_every_up_and_autoscale_field(capsys: pytest.CaptureFixture[str]) -> None:
    from streamrl.ops.launcher import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    rows = [row for row in field_docs(_generator().LaunchRecipe) if row.path.split(".", 1)[0] in ("up", "autoscale")]
    missing = [row.path for row in rows if f"  {row.path}  ({row.type})" not in out]
    assert rows and not missing, f"streamrl up --help does not list {missing}"
