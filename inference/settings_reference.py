"""The settings reference page (docs/settings.md), written from the settings classes themselves.

Each field's type, default and `setting(..., doc)` text are read from its dataclass, so the page
cannot drift from the code. The caller passes the top layer's `Settings` (every section); this
module names no layer above its own.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from pathlib import Path
from typing import Any

from inference.settings import env_name, range_text

HEADER = """\
# Settings

Every setting, one table per section, generated from the settings classes by
`embedcar docs reference` (do not edit by hand; a test fails when this page and the code disagree).

A setting is read from its environment variable, `EMBEDCAR_<SECTION>_<FIELD>`; a command's flag
(`embedcar <command> --help`) overrides it. Lists are comma-separated; booleans take
`1/true/yes/on` or `0/false/no/off`; an empty value leaves an optional path unset.
"""


def settings_page(settings_cls: type[Any]) -> str:
    """Markdown: the header, then one table per section of `settings_cls`, in declaration order."""
    parts = [HEADER]
    hints = typing.get_type_hints(settings_cls)
    for sec in dataclasses.fields(settings_cls):
        parts.append(section_table(sec.name, hints[sec.name]))
    return "\n".join(parts)


def section_table(section: str, cls: type[Any]) -> str:
    source = Path(inspect.getfile(cls))
    lines = [f"## {section}", "",
             f"`{cls.__name__}` in `{source.parent.name}/{source.name}`.", "",
             "| Variable | Type | Default | Description |", "|---|---|---|---|"]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        doc = field_doc(f)
        choices = f.metadata.get("choices")
        if choices:
            doc += f" One of: {', '.join(choices)}."
        if bounds := range_text(f):
            doc += f" Range: {bounds}."
        cells = (f"`{env_name(section, f.name)}`", type_name(hints[f.name]), default_text(f), doc)
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


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
