"""Write the tensor-parallel variant of the benchmark checkpoint.

The benchmark model (the demo checkpoint, SmolLM2-135M's shape) has 9 query heads and 3 KV
heads, which two ranks cannot split (vLLM refuses the same split). This variant keeps its
hidden size 576, 30 layers, MLP 1536, head_dim 64 and vocabulary, and takes 8 query heads
and 2 KV heads instead (query width 512, KV width 128: about 4% fewer FLOPs per token
than the 9/3 model), so TP=1, TP=2 and PP=2 run the same weights:

    python benchmarks/write_tp_model.py /tmp/treadle-demo-tp
    treadle bench compare benchmarks/compare_parallel.yaml   # its model: that folder
"""

from __future__ import annotations

import argparse

from treadle.models.demo import write_demo_model

TP_OVERRIDES = {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="folder to write (must not exist or be empty)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_demo_model(args.out_dir, seed=args.seed, config_overrides=TP_OVERRIDES))


if __name__ == "__main__":
    main()
