"""The command line's shared options (treadle/cli/options.py): every command listed in
`treadle --help`, every default shown in `--help`, and `--config FILE.yaml`."""

from __future__ import annotations

import argparse
import json

import pytest

from treadle.cli import COMMANDS, build_parser, main, parse_args
from treadle.cli.options import expand_config_file


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_top_level_help_lists_every_command(capsys):
    parser = build_parser()
    commands = _subparsers(parser)
    assert len(commands) >= len(COMMANDS) and "build-kernels" in commands
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = capsys.readouterr().out
    for name in commands:
        assert name in text.split("positional arguments:")[1], name
    assert text.rstrip().endswith(parser.format_help().rstrip().splitlines()[-1])


@pytest.mark.parametrize("argv", [["serve"], ["generate"], ["chat"], ["bench", "throughput"],
                                  ["bench", "serve"], ["build-kernels"]])
def test_help_shows_every_default(argv):
    parser = build_parser()
    for name in argv:
        parser = _subparsers(parser)[name]
    text = parser.format_help()
    for action in parser._actions:
        if (not action.option_strings or action.required
                or action.dest in ("help", "config_file")):
            continue
        if action.nargs == 0 and action.default is False:  # a plain switch: off unless given
            continue
        entry = " ".join(parser._get_formatter()._format_action(action).split())
        assert "(default: " in entry, f"{' '.join(argv)}: {entry!r}"  # its lines in --help
        assert action.option_strings[0] in text
    if argv == ["serve"]:
        assert "(default: 8000)" in text and "(default: auto)" in text


def test_config_file_gives_options_and_the_command_line_wins(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("model: demo\nmax-num-seqs: 4\nmax_num_batched_tokens: 64\n"
                    "enable-prefix-caching: false\nport: 9000\napi-key: [a, b]\n"
                    "speculative-config: {method: ngram, num_speculative_tokens: 2}\n")
    args = parse_args(["serve", "--config", str(path), "--port", "9100", "--max-num-seqs=8"])
    assert (args.model, args.max_num_seqs, args.max_num_batched_tokens) == ("demo", 8, 64)
    assert args.enable_prefix_caching is False and args.port == 9100
    assert args.api_key == ["a", "b"]
    assert json.loads(args.speculative_config) == {"method": "ngram",
                                                   "num_speculative_tokens": 2}
    flipped = parse_args(["serve", "--config", str(path), "--enable-prefix-caching"])
    assert flipped.enable_prefix_caching is True


def test_config_file_for_generate_chat_and_bench(tmp_path):
    path = tmp_path / "opts.yaml"
    path.write_text("max-tokens: 7\ndtype: float32\n")
    assert parse_args(["generate", "--prompt", "x", "--config", str(path)]).max_tokens == 7
    assert parse_args(["chat", "--config", str(path)]).dtype == "float32"
    bench = tmp_path / "bench.yaml"
    bench.write_text("num-requests: 3\nworkload: shared-prefix\n")
    args = parse_args(["bench", "throughput", "--config", str(bench)])
    assert (args.num_requests, args.workload) == (3, "shared-prefix")


def test_unknown_keys_are_an_error_naming_them(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("max-num-seqs: 4\nmax-num-seq: 4\nbogus_option: 1\n")
    with pytest.raises(ValueError, match="unknown options bogus_option, max-num-seq"):
        parse_args(["serve", "--config", str(path)])
    assert main(["serve", "--config", str(path)]) == 2
    assert "bogus_option" in capsys.readouterr().err


@pytest.mark.parametrize("text, match", [("- a\n- b\n", "must be a mapping"),
                                         ("a: [\n", "not valid YAML"),
                                         ("enable-prefix-caching: maybe\n", "true or false")])
def test_bad_config_files_are_named(tmp_path, text, match):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        parse_args(["serve", "--config", str(path)])
    with pytest.raises(ValueError, match="cannot read"):
        parse_args(["serve", "--config", str(tmp_path / "missing.yaml")])


def test_config_values_go_before_a_double_dash():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int)
    parser.add_argument("rest", nargs="*")
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write("n: 3\n")
    assert expand_config_file(["--", "x"], parser, f.name) == ["--n=3", "--", "x"]


def test_the_example_config_in_docs_parses():
    from pathlib import Path
    example = Path(__file__).resolve().parents[2] / "docs" / "serve.example.yaml"
    args = parse_args(["serve", "--config", str(example)])
    assert args.config_file == str(example)
