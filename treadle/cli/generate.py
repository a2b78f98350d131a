"""`treadle generate` and `treadle chat`: one prompt's completion, or a conversation in
the terminal, on an in-process engine whose flags are the engine's configs.

This module parses arguments and calls the public API (LLM, treadle.chat); it holds no
engine logic.
"""

from __future__ import annotations

import argparse
import sys

from treadle.cli.options import add_config_file_argument
from treadle.cli.preflight import check_engine_options
from treadle.config import add_config_arguments, options_from_args


def _cmd_generate(args: argparse.Namespace) -> int:
    check_engine_options(options_from_args(args))  # before torch is imported
    from treadle import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed,
                            ignore_eos=args.ignore_eos)
    llm = LLM(**options_from_args(args))
    (output,) = llm.generate([args.prompt], params, use_tqdm=False)
    if output.error:
        print(f"error: {output.error}", file=sys.stderr)
        return 1
    completion = output.outputs[0]
    print(args.prompt + completion.text)
    print(f"[{len(output.prompt_token_ids)} prompt tokens, {len(completion.token_ids)} "
          f"generated, finish_reason={completion.finish_reason}]", file=sys.stderr)
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    check_engine_options(options_from_args(args))
    from treadle import SamplingParams
    from treadle.chat import run_chat

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.sampling_seed)
    return run_chat(options_from_args(args), params, system=args.system)


def add_parser(sub) -> None:
    """Register `generate` and `chat` on the top-level subparsers."""
    gen = sub.add_parser("generate", help="print a completion of one prompt")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    add_config_file_argument(gen)
    add_config_arguments(gen)
    gen.set_defaults(func=_cmd_generate)

    chat = sub.add_parser("chat", help="chat with a model in the terminal (streamed; /reset, "
                                       "/exit; Ctrl-C stops an answer)")
    chat.add_argument("--system", default=None, help="system prompt (the template's own "
                                                     "default when not given)")
    chat.add_argument("--max-tokens", type=int, default=512)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--top-p", type=float, default=1.0)
    chat.add_argument("--sampling-seed", type=int, default=None)
    add_config_file_argument(chat)
    add_config_arguments(chat)
    chat.set_defaults(func=_cmd_chat)
