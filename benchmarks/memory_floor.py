"""One stream's decode step against its memory floor (issue 51, item 2).

`python benchmarks/memory_floor.py --gguf FILE --config DIR/config.json --latency
LATENCY.json [--kv-bytes 2]`

The floor of a decode step at one stream is the bytes it must read over the rate this
machine reads memory: the weights (the GGUF file's size: with tied embeddings the LM head
reads the whole embedding matrix, so the file is what a step reads, give or take the
norms) plus the request's K/V at its mean context during decode (prompt + half the
output; layers x 2 x KV heads x head dim x --kv-bytes each token). The read rate is
kernels/read_probe.c's best over a buffer the size of the weights, on torch's thread
count (benchmarks/linear_kernel.py `read_bandwidth`). The step is treadle's (and
llama.cpp's, where the file has it) TPOT at concurrency 1 from a `treadle bench latency`
result. Prints one JSON line; target: treadle's TPOT within 1.25x of the floor.
"""

from __future__ import annotations

import argparse
import json
import os

from linear_kernel import load_levels, read_bandwidth


def kv_bytes_per_token(config: dict, kv_bytes: int) -> int:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return (config["num_hidden_layers"] * 2 * config.get("num_key_value_heads", heads)
            * head_dim * kv_bytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", required=True, help="the weights file the step reads")
    parser.add_argument("--config", required=True, help="the checkpoint's config.json")
    parser.add_argument("--latency", required=True, help="a `treadle bench latency` JSON")
    parser.add_argument("--kv-bytes", type=int, default=2, help="bytes per K/V element")
    args = parser.parse_args()
    with open(args.config) as f:
        config = json.load(f)
    with open(args.latency) as f:
        latency = json.load(f)
    weights = os.path.getsize(args.gguf)
    context = latency["prompt_len"] + latency["output_len"] // 2
    kv = kv_bytes_per_token(config, args.kv_bytes) * context
    kernels = next(iter(load_levels("auto").values()))[0]
    gb_s = read_bandwidth(kernels, weights)["best_gb_s"]
    floor_ms = (weights + kv) / (gb_s * 1e9) * 1e3
    out = {"weights_bytes": weights, "kv_bytes": kv, "mean_context": context,
           "read_gb_s": gb_s, "floor_ms": round(floor_ms, 3)}
    for row in latency["table"]:
        if row["concurrency"] == 1:
            out[f"{row['system']}_tpot_ms"] = round(row["tpot_ms"], 3)
            out[f"{row['system']}_x_floor"] = round(row["tpot_ms"] / floor_ms, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
