"""Every field of a config model as users write it: dotted path, type, default, docstring (pure).

Feeds ``streamrl <service> --help`` (:func:`config_help`) and ``docs/configuration.md``
(:func:`markdown_table`, written by ``scripts/gen_config_docs.py``). A field's path is the one an
override uses: a service's own fields under its recipe table (``coordinator.group_size``), the
fields every service shares (``run_id``, ``redis``, ``consumer``, ...) at the top level
(``redis.url``), nested sections dotted (``learner.algo.kl.coef``), list items by number
(``reward.scorers.0.path``) and mapping entries by key (``up.resources.<name>.gpus``).

A section field (a nested model) gets a row of its own only when it is optional (``None`` turns it
off) or has a docstring of its own; its fields follow it. A field with no docstring falls back to
its section class's docstring when it is a section, else shows ``(undocumented)``; the docs test
(``tests/unit/test_docs_configuration.py``) fails on any such field.
"""

from __future__ import annotations

import json
import textwrap
import types
import typing
from collections.abc import Collection
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

UNDOCUMENTED = "(undocumented)"
"""Description shown for a field without a docstring."""


@dataclass(frozen=True)
class FieldDoc:
    """One documented field.

    Example:
        FieldDoc(path="coordinator.group_size", type="int", default="8", doc="Samples per prompt (n).")
    """

    path: str
    """Dotted path as an override writes it."""
    type: str
    """The annotation, readably: ``int``, ``str | None``, ``"drop" | "keep"``, ``section``."""
    default: str
    """The default as a recipe would write it (JSON), ``required``, or ``-`` for a section."""
    doc: str
    """The field's docstring, whitespace collapsed to one paragraph."""
    variant: str = ""
    """For a field of one kind of list item: which kind (``type = "http"``)."""

    @property
    def text(self) -> str:
        """What the reader sees: the variant, then the docstring (or that there is none)."""
        doc = self.doc or UNDOCUMENTED
        return f"[{self.variant}] {doc}" if self.variant else doc


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The config models an annotation holds directly (``X``, ``X | None``, a discriminated union)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _models_in(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]
    return []


def type_name(annotation: Any) -> str:
    """A readable name of a type annotation (``str | None``, ``list[int]``, ``"a" | "b"``)."""
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return " | ".join(json.dumps(member.value) for member in annotation)
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(dict.fromkeys(type_name(a) for a in args))
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join('...' if a is Ellipsis else type_name(a) for a in args)}]"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def default_text(info: FieldInfo) -> str:
    """The default of a field as a recipe would write it, or ``required``."""
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    if value is None:
        return "None"
    if isinstance(value, BaseModel):
        return "-"
    if isinstance(value, Enum):
        value = value.value
    try:
        return json.dumps(value)
    except TypeError:
        return repr(value)


def _doc(info: FieldInfo, sections: list[type[BaseModel]]) -> str:
    text = info.description or ""
    if not text and sections:
        text = " / ".join(dict.fromkeys(textwrap.dedent(s.__doc__ or "").strip() for s in sections if s.__doc__))
    return " ".join(text.split())


def _variant(model: type[BaseModel], item: Any, info: FieldInfo) -> str:
    """``type = "http"`` for a variant of a union told apart by a literal field (a discriminator); else empty."""
    names = [info.discriminator]
    if typing.get_origin(item) is typing.Annotated:
        names += [getattr(meta, "discriminator", None) for meta in typing.get_args(item)[1:]]
    names += list(model.model_fields)  # no discriminator declared: the first single-valued Literal field
    for name in names:
        if isinstance(name, str) and name in model.model_fields:
            annotation = model.model_fields[name].annotation
            values = typing.get_args(annotation)
            if typing.get_origin(annotation) is typing.Literal and len(values) == 1:
                return f"{name} = {json.dumps(values[0])}"
    return ""


def field_docs(model: type[BaseModel], prefix: str = "") -> list[FieldDoc]:
    """Every field of ``model`` and of its sections, depth first, paths under ``prefix``."""
    rows: list[FieldDoc] = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        annotation = info.annotation
        sections = _models_in(annotation)
        origin = typing.get_origin(annotation)
        if origin in (list, dict) and sections == []:
            item = typing.get_args(annotation)[-1]
            items = _models_in(item)
            if items:
                rows.append(FieldDoc(path, type_name(annotation), default_text(info), _doc(info, [])))
                marker = "N" if origin is list else "<name>"
                for section in items:
                    variant = _variant(section, item, info) if len(items) > 1 else ""
                    rows += [replace(row, variant=variant) for row in field_docs(section, f"{path}.{marker}.")]
                continue
        if sections and len(sections) == 1 and type_name(annotation) == "section":
            if info.description:
                rows.append(FieldDoc(path, "section", default_text(info), _doc(info, sections)))
            rows.extend(field_docs(sections[0], f"{path}."))
            continue
        rows.append(FieldDoc(path, type_name(annotation), default_text(info), _doc(info, sections)))
        for section in sections:
            rows.extend(field_docs(section, f"{path}."))
    return rows


def service_field_docs(model: type[BaseModel], section: str, shared: Collection[str]) -> list[FieldDoc]:
    """Fields of a service config: its own under ``section`` first, then the ``shared`` ones at the top level."""
    rows = field_docs(model)
    own = [replace(row, path=f"{section}.{row.path}") for row in rows if row.path.split(".", 1)[0] not in shared]
    return own + [row for row in rows if row.path.split(".", 1)[0] in shared]


def undocumented(rows: list[FieldDoc]) -> list[str]:
    """Paths of the fields without a description."""
    return [row.path for row in rows if not row.doc]


def config_help(rows: list[FieldDoc], width: int = 100) -> str:
    """The field list of ``--help``: ``path  type = default`` and the docstring indented below."""
    lines = []
    for row in rows:
        default = "" if row.default == "-" else f" = {row.default}"
        lines.append(f"  {row.path}  ({row.type}){default}")
        lines.extend(textwrap.wrap(row.text, width=width, initial_indent="      ", subsequent_indent="      "))
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: list[FieldDoc]) -> str:
    """A Markdown table of ``rows``: field, type, default, description."""
    lines = ["| Field | Type | Default | Description |", "|---|---|---|---|"]
    for row in rows:
        default = "" if row.default == "-" else f"`{_cell(row.default)}`"
        doc = _cell(row.text)
        lines.append(f"| `{_cell(row.path)}` | `{_cell(row.type)}` | {default} | {doc} |")
    return "\n".join(lines)


def service_help(service: str, model: type[BaseModel], shared: Collection[str]) -> str:
    """The epilog of ``streamrl <service> --help``: how fields are written, then every field."""
    head = textwrap.fill(
        f"config fields: set them in the recipe's [{service}] table, or override with --{service}.FIELD=VALUE "
        f"or STREAMRL_{service.upper()}__FIELD=VALUE; the fields every service shares ({', '.join(sorted(shared))}) "
        "sit at the top level (--redis.url=VALUE). Nested sections are dotted, list items numbered. "
        "Every command's fields: docs/configuration.md",
        width=100,
    )
    return f"{head}\n\n{config_help(service_field_docs(model, service, shared))}"
