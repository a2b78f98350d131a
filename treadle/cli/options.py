"""What every `treadle` command shares in its options: the parser class (its `--help`
shows each option's default), and `--config FILE.yaml`.

`--config` works as vLLM's does: the file is a YAML mapping whose keys are the command's
option names (`max-num-seqs` or `max_num_seqs`, without the dashes in front) and whose
values are what would follow the flag; options given on the command line win over the
file, and the file wins over `TREADLE_<OPTION>` environment variables and the defaults.
The file's entries become command-line tokens parsed by the command's own parser, so they
are checked and converted exactly as flags are; a key the command does not have is an
error naming it. This module parses options only; it knows nothing of the engine.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

CONFIG_DEST = "config_file"
"""Where `--config` lands in the namespace (`config` is taken: bench compare's positional
CONFIG.yaml)."""
_PARSER_DEST = "_config_parser"


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends `(default: X)` to an option's help where the parser has a default to show
    and the help text does not state one already. Options generated from the config
    dataclasses (argparse default None, so that an unset flag can be told from a given
    one) carry their default in their help text (treadle/config.py)."""

    @staticmethod
    def _shows_default(action: argparse.Action) -> bool:
        default, text = action.default, action.help or ""
        return not (default is argparse.SUPPRESS or "(default" in text or action.required
                    or "%(default)" in text or not action.option_strings
                    or action.nargs == 0 and default is False)

    @staticmethod
    def _default_text(action: argparse.Action) -> str:
        return "(default: not set)" if action.default is None else "(default: %(default)s)"

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and self._shows_default(action):  # argparse skips no-help
            action = copy.copy(action)
            action.help = self._default_text(action)
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not self._shows_default(action):
            return text
        return f"{text} {self._default_text(action)}"


class TreadleParser(argparse.ArgumentParser):
    """An ArgumentParser whose help shows defaults; its subparsers are made of this class
    too (add_subparsers' default `parser_class`), so every command's help does."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)


def add_config_file_argument(parser: argparse.ArgumentParser) -> None:
    """Give a command `--config FILE.yaml` (see the module docstring)."""
    parser.add_argument("--config", dest=CONFIG_DEST, default=None, metavar="FILE.yaml",
                        help="YAML file of this command's options (keys: option names "
                             "without the leading dashes; options given on the command "
                             "line win); docs/config_file.md")
    parser.set_defaults(**{_PARSER_DEST: parser})


def config_file_of(args: argparse.Namespace) -> tuple[str, argparse.ArgumentParser] | None:
    """(the --config path, the parser of the command that took it), or None."""
    path = getattr(args, CONFIG_DEST, None)
    return None if path is None else (path, getattr(args, _PARSER_DEST))


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The YAML mapping in `path`; ValueError naming the file when it is not one."""
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--config {path}: cannot read it ({exc.strerror or exc})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"--config {path}: not valid YAML ({exc})") from None
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise ValueError(f"--config {path}: must be a mapping of option names to values, "
                         f"got {type(data).__name__}")
    return data


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Option name (dashes, no leading `--`) -> its action, for every long option but
    --help, --config and the `--no-` halves of boolean flags."""
    names = {}
    for action in parser._actions:  # argparse has no public list of a parser's actions
        if action.dest in ("help", CONFIG_DEST) or not action.option_strings:
            continue
        for flag in action.option_strings:
            if flag.startswith("--") and not (
                    isinstance(action, argparse.BooleanOptionalAction)
                    and flag.startswith("--no-")):
                names[flag[2:]] = action
    return names


def _given_flags(argv: list[str]) -> set[str]:
    """The long options present in argv, by name (`--x=1` and `--no-x` count as x)."""
    given = set()
    for token in argv:
        if token == "--":
            break
        if token.startswith("--"):
            name = token[2:].split("=", 1)[0]
            given.add(name)
            if name.startswith("no-"):
                given.add(name[3:])
    return given


def _tokens(name: str, action: argparse.Action, value: Any, path: str) -> list[str]:
    """The command-line tokens that give option `name` this value."""
    flag = "--" + name
    if value is None:
        return []
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ValueError(f"--config {path}: {name} must be true or false, got {value!r}")
        return [flag if value else "--no-" + name]
    if action.nargs == 0:  # store_true / store_false / store_const
        if not isinstance(value, bool):
            raise ValueError(f"--config {path}: {name} must be true or false, got {value!r}")
        return [flag] if value == (action.const is not False) else []
    if action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [value]
        text = [_text(item) for item in items]
        if isinstance(action, argparse._AppendAction) and action.nargs is None:
            return [token for item in text for token in (flag, item)]
        return [flag, *text] if text else []
    return [f"{flag}={_text(value)}"]


def _text(value: Any) -> str:
    """A YAML value as a flag takes it: mappings and lists as JSON (e.g.
    speculative-config), booleans as true/false, the rest as written."""
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def expand_config_file(argv: list[str], parser: argparse.ArgumentParser,
                       path: str) -> list[str]:
    """argv with the file's options that argv does not give appended as flags; a
    ValueError naming every key the command does not know."""
    data = read_config_file(path)
    options = _options(parser)
    keys = {key: key.strip().replace("_", "-") for key in data}
    unknown = sorted(key for key, name in keys.items() if name not in options)
    if unknown:
        raise ValueError(f"--config {path}: unknown option{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(unknown)} for `{parser.prog}` (its --help lists them)")
    given = _given_flags(argv)
    extra: list[str] = []
    for key, value in data.items():
        name = keys[key]
        if name not in given:
            extra += _tokens(name, options[name], value, path)
    end = argv.index("--") if "--" in argv else len(argv)  # before any `--` positionals
    return [*argv[:end], *extra, *argv[end:]]
