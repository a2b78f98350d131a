"""`treadle run-batch -i FILE -o FILE`: a Batch API file answered offline (vLLM's
`run-batch`), on an in-process engine whose flags are the engine's configs.

This module parses arguments and calls treadle/server/batch_offline.py; it holds no
engine or server logic.
"""

from __future__ import annotations

import argparse
import sys

from treadle.config import add_config_arguments, options_from_args


def _cmd_run_batch(args: argparse.Namespace) -> int:
    from treadle.config import EngineConfig
    from treadle.engine.llm import OFFLINE_MAX_NUM_BATCHED_TOKENS
    from treadle.server.batch_offline import run_batch
    from treadle.server.config import ServerConfig
    from treadle.server.serve import parse_lora_modules

    options = options_from_args(args)
    options.setdefault("max_num_batched_tokens", OFFLINE_MAX_NUM_BATCHED_TOKENS)  # as LLM
    server_config = ServerConfig(
        served_model_name=args.served_model_name, tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice)
    done = run_batch(EngineConfig.from_options(**options), server_config, args.input,
                     args.output, parse_lora_modules(args.lora_modules),
                     progress=not args.no_progress)
    answered = sum(done["statuses"].values())
    failed = answered - done["statuses"].get(200, 0)
    seconds = done["seconds"]
    print(f"{answered} lines answered ({failed} with an error) in {seconds:.2f} s, "
          f"{done['output_tokens'] / max(seconds, 1e-9):.1f} output tokens/s; wrote "
          f"{'stdout' if args.output == '-' else args.output}", file=sys.stderr)
    return 0


def add_parser(sub) -> None:
    """Register `run-batch` on the top-level subparsers."""
    run = sub.add_parser("run-batch", help="answer an OpenAI batch file (JSONL) offline, "
                                           "each line as `treadle serve` would (docs/batch.md)")
    run.add_argument("-i", "--input", required=True,
                     help="the batch file: one {custom_id, method, url, body} per line "
                          "('-': stdin)")
    run.add_argument("-o", "--output", required=True,
                     help="where the answers go, one per input line, in input order "
                          "('-': stdout)")
    run.add_argument("--served-model-name", default=None,
                     help="the model name lines may give (default: as `treadle serve`)")
    run.add_argument("--tool-call-parser", default=None,
                     help="as `treadle serve`: hermes, llama3_json, mistral or qwen")
    run.add_argument("--enable-auto-tool-choice", action="store_true",
                     help="as `treadle serve`: allow tool_choice 'auto'")
    run.add_argument("--lora-modules", action="extend", nargs="+", default=None,
                     help="as `treadle serve`: adapters as name=path (needs --enable-lora)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_config_arguments(run)
    run.set_defaults(func=_cmd_run_batch)
