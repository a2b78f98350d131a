"""The command-line flags generated from the config dataclasses (`add_config_arguments`,
`add_dataclass_arguments`) and read back (`options_from_args`, `dataclass_from_args`),
each flag's help showing its default."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from treadle.config.values import _flag_type, SPECULATIVE_OPTION
from treadle.config.lora_spec import SpeculativeConfig
from treadle.config.engine import EngineConfig


def add_config_arguments(parser: argparse.ArgumentParser,
                         skip: tuple[str, ...] = ()) -> None:
    """Add one --flag per engine config field (underscores become dashes)."""
    for section, section_type in EngineConfig.section_types().items():
        add_dataclass_arguments(parser, section_type, f"{section} options", skip)
    if SPECULATIVE_OPTION not in skip:
        parser.add_argument_group("speculative decoding").add_argument(
            "--speculative-config", dest=SPECULATIVE_OPTION, default=None, metavar="JSON",
            help="A JSON object with keys " + SpeculativeConfig().keys_help()
            + " (default: not set: no speculation)")


def options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The config options given on the command line (flags left unset are omitted)."""
    names = {f.name for section_type in EngineConfig.section_types().values()
             for f in dataclasses.fields(section_type)} | {SPECULATIVE_OPTION}
    return {name: value for name, value in vars(args).items()
            if name in names and value is not None}


def add_dataclass_arguments(parser: argparse.ArgumentParser, config_type: type,
                            title: str, skip: tuple[str, ...] = ()) -> None:
    """One --flag per field of a config dataclass (lists become repeatable flags)."""
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(config_type):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.metadata.get('help', '')} (default: {_default_text(f)})"
        annotation = str(f.type)
        if "list" in annotation:  # repeatable, and several values after one flag
            group.add_argument(flag, dest=f.name, action="extend", nargs="+", default=None,
                               help=help_text)
        elif _flag_type(annotation) is None:
            group.add_argument(flag, dest=f.name, default=None,
                               action=argparse.BooleanOptionalAction, help=help_text)
        else:
            group.add_argument(flag, dest=f.name, default=None, type=_flag_type(annotation),
                               help=help_text)


def _default_text(f: dataclasses.Field) -> str:
    """A field's default as `--help` shows it (the flag's own default is None: unset)."""
    if f.default is dataclasses.MISSING:
        return "see above"
    if f.default is None:
        return "not set"
    if isinstance(f.default, bool):
        return "true" if f.default else "false"
    return str(f.default) if f.default != "" else "''"


def dataclass_from_args(config_type: type, args: argparse.Namespace):
    """An instance of a config dataclass from the flags given (unset flags keep defaults)."""
    names = {f.name for f in dataclasses.fields(config_type)}
    return config_type(**{k: v for k, v in vars(args).items() if k in names and v is not None})
