"""`treadle demo-model`: write the built-in random-weight benchmark checkpoint
(treadle/models/demo.py) to a folder."""

from __future__ import annotations

import argparse


def _cmd_demo_model(args: argparse.Namespace) -> int:
    from treadle.models.demo import write_demo_model

    path = write_demo_model(args.out, seed=args.seed)
    print(path)
    return 0


def add_parser(sub) -> None:
    """Register `demo-model` on the top-level subparsers."""
    demo = sub.add_parser("demo-model", help="write the built-in demo checkpoint to a folder")
    demo.add_argument("--out", required=True)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_cmd_demo_model)
