"""The settings reference page (docs/settings.md), written from the settings classes themselves.

Each field's type, default and `setting(..., doc)` text are read from its dataclass, so the page
cannot drift from the code. The caller passes the top layer's `Settings` (every section); this
module names no layer above its own.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

from inference.settings import env_name, range_text

HEADER = """\
# Settings

Every setting, one table per section, generated from the settings classes by
`embedcar docs reference` (do not edit by hand; a test fails when this page and the code disagree).

{count}

A setting is read from its environment variable, `EMBEDCAR_<SECTION>_<FIELD>`; a command's flag
(`embedcar <command> --help`) overrides it. Lists are comma-separated; booleans take
`1/true/yes/on` or `0/false/no/off`; an empty value leaves an optional path unset.
"""

_COLUMNS = ["| Variable | Type | Default | Description |", "|---|---|---|---|"]


def settings_page(settings_cls: type[Any]) -> str:
    """Markdown: the header, then one table per section of `settings_cls`, in declaration order."""
    hints = typing.get_type_hints(settings_cls)
    sections = [(sec.name, hints[sec.name]) for sec in dataclasses.fields(settings_cls)]
    fields = [f for _, cls in sections for f in dataclasses.fields(cls)]
    operator = sum(not is_advanced(f) for f in fields)
    count = (f"{len(fields)} settings. An operator reads the {operator} in each section's first table: where "
             "the models, the index and the Triton pool are, ports, TLS and keys. The other "
             f"{len(fields) - operator}, in each section's *advanced* table, are limits and tuning whose defaults "
             "were measured (docs/benchmarks.md): a deployment needs no change there.")
    return "\n".join([HEADER.format(count=count), *(section_table(name, cls) for name, cls in sections)])


def is_advanced(f: dataclasses.Field[Any]) -> bool:
    return bool(f.metadata.get("advanced"))


def section_table(section: str, cls: type[Any]) -> str:
    """The section's operator settings, then its advanced ones in a table of their own."""
    # The module's path from the checkout's root (a package's, or a top-level module's).
    source = Path(*cls.__module__.split(".")).with_suffix(".py")
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    lines = [f"## {section}", "", f"`{cls.__name__}` in `{source.as_posix()}`.", ""]
    operator = [f for f in fields if not is_advanced(f)]
    advanced = [f for f in fields if is_advanced(f)]
    if operator:
        lines += [*_COLUMNS, *(_row(section, f, hints[f.name]) for f in operator)]
    if advanced:
        if operator:
            lines.append("")
        lines += [f"### {section}: advanced", "", *_COLUMNS, *(_row(section, f, hints[f.name]) for f in advanced)]
    return "\n".join(lines) + "\n"


def _row(section: str, f: dataclasses.Field[Any], tp: Any) -> str:
    doc = field_doc(f)
    if choices := f.metadata.get("choices"):
        doc += f" One of: {', '.join(choices)}."
    if bounds := range_text(f):
        doc += f" Range: {bounds}."
    cells = (f"`{env_name(section, f.name)}`", type_name(tp), default_text(f), doc)
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def field_doc(f: dataclasses.Field[Any]) -> str:
    """The field's `setting(..., doc)` text; empty where it has none (the reference test fails then)."""
    return " ".join(str(f.metadata.get("doc") or "").split())


def type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is tuple:
        return f"list of {type_name(args[0])}"
    if args and type(None) in args:  # X | None
        inner = next(a for a in args if a is not type(None))
        return f"{type_name(inner)}, optional"
    return {Path: "path", str: "string", int: "int", float: "float", bool: "bool"}.get(tp, str(tp))


def default_text(f: dataclasses.Field[Any]) -> str:
    """The default as its environment value would be written; a secret's is never shown."""
    if f.default is dataclasses.MISSING:
        value = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
    else:
        value = f.default
    if f.metadata.get("secret"):
        return "(secret, empty)" if not value else "(secret, set)"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, tuple):
        value = ",".join(str(v) for v in value)
    text = str(value)
    return f"`{text}`" if text else "empty"


def _cell(text: str) -> str:
    # A pipe inside a cell would end it; a newline would end the row.
    return text.replace("|", "\\|").replace("\n", " ")
