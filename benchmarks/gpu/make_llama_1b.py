"""A 1B-parameter Llama-shaped checkpoint with random weights, the same files for a seed.

The Llama-3.2-1B layer shapes (hidden 2048, 16 layers, 32 query / 8 KV heads of 64, MLP
8192, rope theta 500000, tied embeddings) over the demo model's 49152-id tokenizer (every
id decodes), so the vocabulary is 49152 and the model has 1.07 B parameters. Weights come
from treadle's demo-model writer (models/demo.py: Normal(0, 0.02) drawn in float32 by a
CPU generator seeded with --seed, stored in bf16), so every machine writes identical
files. Used by benchmarks/gpu/engine_check.py; any other shape for a smoke run with
--num-layers / --hidden-size.

    python benchmarks/gpu/make_llama_1b.py OUT_DIR [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from treadle.models.demo import write_demo_model  # noqa: E402

LLAMA_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}


def make_llama_1b(out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """Write the checkpoint to out_dir (absent or empty); return its path."""
    return write_demo_model(out_dir, seed=seed, config_overrides={**LLAMA_1B, **overrides})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-layers", type=int, help="fewer layers (smoke runs)")
    parser.add_argument("--hidden-size", type=int, help="a smaller hidden size (smoke runs)")
    args = parser.parse_args()
    overrides = {}
    if args.num_layers:
        overrides["num_hidden_layers"] = args.num_layers
    if args.hidden_size:
        overrides.update(hidden_size=args.hidden_size, intermediate_size=4 * args.hidden_size)
    start = time.perf_counter()
    path = make_llama_1b(args.out_dir, args.seed, **overrides)
    print(f"wrote {path} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
