"""What the `treadle bench` commands share: the workload options and the workload they
name (token ids from the model's own vocabulary), the benchmark model's path, and how a
result is written and a failed run reported."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def workload(args: argparse.Namespace, model_path: str):
    """The chosen workload, its token ids drawn from (and checked against) the model's
    own vocabulary (`--vocab-size` overrides what its config.json says), its lengths
    within the model's context (`--max-model-len` where the command has it)."""
    from treadle.measure import workloads

    vocab = getattr(args, "vocab_size", None) or workloads.model_vocab_size(model_path)
    context = getattr(args, "max_model_len", None) or workloads.model_context_len(model_path)
    if getattr(args, "workload_file", None):
        workload = workloads.load_workload(args.workload_file)
        workloads.check_token_ids(workload, vocab)
        return workload
    if args.workload == "synthetic":
        return workloads.synthetic(num_requests=args.num_requests, seed=args.workload_seed,
                                   vocab_size=vocab, max_model_len=context,
                                   num_long=min(4, args.num_requests))
    if args.workload == "azure-conv":
        return workloads.azure_conv(num_requests=args.num_requests, token_scale=args.token_scale,
                                    seed=args.workload_seed, vocab_size=vocab,
                                    max_model_len=min(context or 2048, 2048))
    return workloads.shared_prefix(num_requests=args.num_requests, seed=args.workload_seed,
                                   vocab_size=vocab)


def model_path(args: argparse.Namespace) -> str:
    """The checkpoint directory of a benchmark's --model: the demo model when not given
    (benchmarks measure speed on the fixed demo checkpoint unless told otherwise)."""
    from treadle.cli.preflight import check_model
    from treadle.engine.core import resolve_checkpoint
    check_model({"model": args.model, "revision": getattr(args, "revision", None),
                 "download_dir": getattr(args, "download_dir", None)})
    return str(resolve_checkpoint(args.model or "demo", getattr(args, "revision", None),
                                  getattr(args, "download_dir", None),
                                  getattr(args, "dtype", None) or "auto"))


def failed(what: str, num_failed: int, num_requests: int, errors: list) -> int:
    """Exit status 1 with the reason when a benchmark's requests failed (its figures would
    not measure what they claim), else 0."""
    if not num_failed:
        return 0
    print(f"error: {num_failed} of {num_requests} {what} requests failed; first errors: "
          f"{errors[:3]}", file=sys.stderr)
    return 1


def write_result(result: dict, path: str | None, default_name: str) -> Path:
    from treadle.measure.report import environment, write_json

    result["environment"] = environment()
    return write_json(path or Path("results") / default_name, result)


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=["synthetic", "azure-conv", "shared-prefix"],
                        default="synthetic", help="which workload to run")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--token-scale", type=float, default=1.0,
                        help="azure-conv: multiply the trace's token counts by this")
    parser.add_argument("--workload-file", default=None,
                        help="a workload saved as JSON (measure/workloads.save_workload); "
                             "overrides the options above")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="draw token ids below this (default: the model's config.json)")
    parser.add_argument("--output", default=None, help="where to write the JSON result")
