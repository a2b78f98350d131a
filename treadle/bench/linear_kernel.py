"""The small-batch bf16 C kernels against oneDNN's packed kernel and torch: per linear shape,
and in whole decode steps.

Owns two measurements, reported as they come (nothing here is a target):

- kernels (default): for each weight shape of the demo model (SmolLM2-135M: qkv 960x576,
  o 576x576, gate_up 3072x576, down 576x1536, LM head 49152x576) and M in {1, 4, 8, 16}
  rows, the best-of-`repeats` ms per call and the weight bytes read per second, of
  oneDNN's packed kernel (`torch.ops.mkldnn._linear_pointwise`, what the engine used
  before) and of `NativeLayerOps.linear`. Each call reads another of `copies` copies of
  the weight (30 per layer shape, as the model's 30 layers; 3 of the LM head), so the
  weights come from memory, not cache, as in a real step. The two kernels alternate
  within each repeat, so background load hits both alike. `model_ms` sums a whole step's
  linears (30 of each layer shape + one LM head) per kernel and M.
- steps (`--steps N`): an EngineCore on the demo model in bf16 with R requests of
  600-token prompts decoding together (R in --requests, default 4 and 16); after prefill,
  N decode steps with the C layer kernels and N without (torch/oneDNN: the model's
  `Worker.set_layer_kernels(False)`), alternating in blocks, and the median step ms of each.

Run: `python -m treadle.bench.linear_kernel [--repeats N] [--steps N] [--requests 4,16]
[--num-threads N]` (prints JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}
"""name -> (N, K) of the demo model's weights."""
LAYERS = 30


def _ops():
    from treadle.worker.native import load_kernels
    from treadle.worker.native_linear import NativeLayerOps

    kernels = load_kernels()
    ops = NativeLayerOps.load(kernels.lib if kernels is not None else None)
    if ops is None:
        raise SystemExit("the C layer kernels are unavailable here (no compiler or no "
                         "AVX512-BF16)")
    return ops


def kernels(repeats: int = 15, rows: tuple[int, ...] = (1, 4, 8, 16)) -> dict:
    import torch

    from treadle.worker.linear_kernels import _pack, _packed_linear

    ops = _ops()
    gen = torch.Generator().manual_seed(0)
    results, model_ms = [], {}
    for name, (n, k) in SHAPES.items():
        copies = 3 if name == "lm_head" else LAYERS
        weights = [torch.randn(n, k, generator=gen).to(torch.bfloat16) for _ in range(copies)]
        packed = [_pack(w) for w in weights]
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            runs = {"onednn": lambda i: _packed_linear(x, packed[i], None),
                    "native": lambda i: ops.linear(x, weights[i], None)}
            best = dict.fromkeys(runs, float("inf"))
            for _ in range(repeats):
                for label, fn in runs.items():
                    t0 = time.perf_counter()
                    for i in range(copies):
                        fn(i)
                    best[label] = min(best[label], (time.perf_counter() - t0) / copies)
            row = {"shape": name, "n": n, "k": k, "m": m}
            for label, seconds in best.items():
                row[f"{label}_ms"] = round(seconds * 1e3, 4)
                row[f"{label}_gb_s"] = round(n * k * 2 / seconds / 1e9, 1)
                per_step = LAYERS if name != "lm_head" else 1
                key = f"{label}_m{m}"
                model_ms[key] = round(model_ms.get(key, 0.0) + seconds * 1e3 * per_step, 3)
            results.append(row)
    return {"torch_threads": torch.get_num_threads(), "repeats": repeats, "shapes": results,
            "model_ms": model_ms}


def steps(num_requests: int, num_steps: int, prompt_len: int = 600, block: int = 5) -> dict:
    """Median decode-step seconds with and without the C layer kernels."""
    import torch

    from treadle.config import EngineConfig
    from treadle.engine.core import EngineCore
    from treadle.request import Request
    from treadle.sampling_params import SamplingParams

    config = EngineConfig.from_options(model="demo", dtype="bfloat16", max_num_seqs=num_requests,
                                       max_num_batched_tokens=2048, kv_cache_memory="1GiB")
    core = EngineCore(config)
    worker = core.executor.worker
    if worker.layer_ops is None:
        raise SystemExit("the engine did not attach the C layer kernels")
    vocab = core.vocab_size
    params = SamplingParams(max_tokens=2 * num_steps + 4 * block + 8, ignore_eos=True,
                            temperature=0.0)
    for i in range(num_requests):
        prompt = [3 + (7919 * (i * prompt_len + j)) % (vocab - 3) for j in range(prompt_len)]
        core.add_request(Request(str(i), prompt, params))
    while any(r.num_uncomputed_tokens > 1 or not r.output_token_ids
              for r in core.scheduler.requests.values()):
        core.step()
    times: dict[str, list[float]] = {"native": [], "torch": []}
    while min(len(t) for t in times.values()) < num_steps:
        for label in times:
            worker.set_layer_kernels(label == "native")
            for _ in range(block):
                t0 = time.perf_counter()
                out = core.step()
                times[label].append(time.perf_counter() - t0)
                assert len(out) == num_requests, "every request should decode in every step"
    worker.set_layer_kernels(True)
    native, plain = (statistics.median(times[k][:num_steps]) for k in ("native", "torch"))
    return {"num_requests": num_requests, "prompt_len": prompt_len, "steps": num_steps,
            "torch_threads": torch.get_num_threads(),
            "median_step_ms_native": round(native * 1e3, 2),
            "median_step_ms_torch": round(plain * 1e3, 2),
            "speedup": round(plain / native, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=0,
                        help="also time this many decode steps per request count")
    parser.add_argument("--requests", default="4,16")
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch's (and so OpenMP's) thread count; default: torch's")
    args = parser.parse_args()
    if args.num_threads:
        import torch
        torch.set_num_threads(args.num_threads)
    report = {}
    if not args.skip_kernels:
        report["kernels"] = kernels(args.repeats)
    if args.steps:
        report["steps"] = [steps(int(r), args.steps) for r in args.requests.split(",")]
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
