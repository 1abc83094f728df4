"""CLI flags generated from settings fields, and read back as `Settings.load` overrides.

`add_flags(parser, "sidecar", SidecarSettings, "host", "grpc_port")` adds `--host` and `--grpc-port`
with the field's doc, environment name and default as help; a field's `flag` metadata renames its
flag (`--threads` for model.intra_op_threads). `Settings.load(overrides=flag_overrides(args))` then
builds the settings: a flag left out keeps the environment's value (or the default). Flag values are
read like environment values (inference.settings.parse_value); a tuple's flag is repeatable and
takes comma-separated values too.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from inference.settings import env_name, parse_value

# The namespace attribute listing the settings flags a parser declared (set_defaults carries it to
# the parsed arguments of whichever subcommand ran).
_DECLARED = "settings_flags"


@dataclass(frozen=True, slots=True)
class Flag:
    option: str  # e.g. "--grpc-port"
    dest: str
    section: str
    name: str
    tp: Any  # the field's type


def add_flags(parser: argparse.ArgumentParser, section: str, cls: type[Any], *names: str) -> None:
    """Flags for the fields `names` of the section class `cls` (named `section` in Settings)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    declared: list[Flag] = list(parser.get_default(_DECLARED) or ())
    for name in names:
        f = fields[name]
        option = "--" + (f.metadata.get("flag") or name.replace("_", "-"))
        flag = Flag(option, option[2:].replace("-", "_"), section, name, hints[name])
        doc = f"{f.metadata['doc']} [{env_name(section, name)}, default {_shown(f.default)}]"
        kw: dict[str, Any] = {"dest": flag.dest, "default": None, "help": doc.replace("%", "%%")}
        if typing.get_origin(flag.tp) is tuple:
            kw |= {"action": "append", "metavar": "VALUE[,VALUE...]", "help": "(repeatable) " + kw["help"]}
        if f.metadata.get("choices"):
            kw["choices"] = f.metadata["choices"]
        parser.add_argument(option, **kw)
        declared.append(flag)
    parser.set_defaults(**{_DECLARED: tuple(declared)})


def flag_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The settings flags given on the command line, as `Settings.load(overrides=...)` takes them."""
    overrides: dict[str, dict[str, Any]] = {}
    for flag in getattr(args, _DECLARED, ()):
        raw = getattr(args, flag.dest)
        if raw is None:
            continue
        if isinstance(raw, list):  # a repeatable tuple flag
            raw = ",".join(raw)
        overrides.setdefault(flag.section, {})[flag.name] = parse_value(flag.tp, raw, flag.option)
    return overrides


def _shown(default: Any) -> str:
    if isinstance(default, tuple):
        return ",".join(map(str, default)) or "none"
    return "none" if default is None else str(default)
