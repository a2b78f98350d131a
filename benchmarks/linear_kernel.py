"""The small-batch bf16 C kernels against oneDNN's packed kernel and torch: per linear shape,
and in whole decode steps; per kernel ISA level, side by side.

Owns two measurements, reported as they come (nothing here is a target):

- kernels (default): for each weight shape of the demo model (SmolLM2-135M: qkv 960x576,
  o 576x576, gate_up 3072x576, down 576x1536, LM head 49152x576) and M in {1, 4, 8, 16}
  rows, the best-of-`repeats` ms per call and the weight bytes read per second, of
  oneDNN's packed kernel (`torch.ops.mkldnn._linear_pointwise`, what the engine used
  before; where it does not exist, as without AVX-512, bf16 F.linear: `torch_bf16`), of
  `NativeLayerOps.linear` of each ISA level in --isa as the engine calls it (with the
  weight's packed copy where the level has the packed vdpbf16ps GEMM; where it routes
  rows between kernels, each alone: `dot_*`, the dot-product kernel, `vnni_*`, the packed
  GEMM, and `amx_*`, the AMX tile kernel where the CPU has AMX-BF16 and the shape fits it,
  or `gemm_*`, the widening GEMM at the levels without bf16 arithmetic), and with --fp32 of
  F.linear on float32 copies of the weights (what a CPU on the float32 fallback of
  dtype=auto ran). Each call reads another of `copies` copies of the weight (30 per layer
  shape, as the model's 30 layers; 3 of the LM head), so the weights come from memory, or
  from a last-level cache as large as a model's layers, as in a real step. The variants
  alternate within each repeat, so background load hits all alike. `model_ms` sums a
  whole step's linears (30 of each layer shape + one LM head) per variant and M. The
  machine's read rate (`read_bandwidth`: kernels/read_probe.c, at the size of the bf16
  weights the step streams and at 2 GiB, same thread count) is measured in the same run,
  and each native run's `read_fraction` is its GB/s over the step-sized figure.
- steps (`--steps N`): an EngineCore on the demo model in bf16 with R requests of
  600-token prompts decoding together (R in --requests, default 4 and 16); after prefill,
  N decode steps per variant, alternating in blocks: each ISA level's kernels (layers,
  decode attention and sampling of that build; with the decode stack, worker/
  decode_stack.py, where it applies), the same kernels called layer by layer
  (`*_layer_by_layer`: no decode stack), torch's layers (`Worker.use_native_kernels(k, None)`,
  attention of the first level) and, with --fp32, a float32 engine on the first level's
  attention; the median step ms of each.

Every time is also given as process CPU time (`*_cpu_ms`: all threads' CPU seconds): on a
loaded machine with --num-threads 1 it leaves out the time spent descheduled.

Run: `python benchmarks/linear_kernel.py [--repeats N] [--rows 1,4,8,16] [--steps N]
[--requests 4,16] [--isa auto|all|LEVEL,...] [--fp32] [--num-threads N]` (prints JSON). To see what torch
would do on a CPU without AVX-512 BF16, restrict it in the environment, e.g.
ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 (the C
kernels' level is --isa's).
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


def load_levels(isa: str = "auto") -> dict:
    """level -> (NativeKernels, NativeLayerOps) for --isa: auto, all, or a comma list."""
    from treadle.worker.cpu.cpu_isa import executable_levels
    from treadle.worker.cpu.native import load_kernels
    from treadle.worker.cpu.native_linear import NativeLayerOps

    names = (executable_levels() or ["native"]) if isa == "all" else isa.split(",")
    levels = {}
    for name in names:
        kernels = load_kernels(name)
        ops = NativeLayerOps.load(kernels.lib if kernels is not None else None)
        if ops is None:
            raise SystemExit(f"the C layer kernels are unavailable for {name} (no compiler, "
                             f"or neither AVX-512 nor AVX2)")
        levels[kernels.isa] = (kernels, ops)
    return levels


def read_bandwidth(kernels, num_bytes: int, repeats: int = 7,
                   prefetch: tuple[int, ...] = (0, 1024, 4096),
                   huge_pages: bool = False) -> dict:
    """GB/s that kernels/read_probe.c reads from a buffer of num_bytes on torch's thread
    count: per software-prefetch distance in bytes (0: none), the best and the median of
    `repeats` passes, distances alternating; `best_gb_s` is the best of all. huge_pages:
    the buffer from a HugePageArena (worker/cpu/huge_pages.py), as the packed weights are."""
    import ctypes

    import torch

    from treadle.worker.cpu.huge_pages import HugePageArena

    fn = kernels.lib.read_probe_sum
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int64]
    fn.restype = ctypes.c_uint64
    if huge_pages:
        buf = HugePageArena().empty(num_bytes // 8, torch.int64).fill_(1)
    else:
        buf = torch.ones(num_bytes // 8, dtype=torch.int64)
    threads = torch.get_num_threads()
    fn(buf.data_ptr(), buf.numel(), threads, 0)  # page faults, thread pool
    samples: dict[int, list[float]] = {d: [] for d in prefetch}
    for _ in range(repeats):
        for distance in prefetch:
            t0 = time.perf_counter()
            fn(buf.data_ptr(), buf.numel(), threads, distance)
            samples[distance].append(time.perf_counter() - t0)
    size = buf.numel() * 8
    result = {"bytes": size, "threads": threads}
    for distance, times in samples.items():
        result[f"prefetch_{distance}"] = {
            "best_gb_s": round(size / min(times) / 1e9, 2),
            "median_gb_s": round(size / statistics.median(times) / 1e9, 2)}
    result["best_gb_s"] = max(v["best_gb_s"] for k, v in result.items()
                              if k.startswith("prefetch_"))
    return result


def kernel_choices(ops, max_rows: int) -> dict:
    """The kernels one library's layer ops route between, each alone at every row count:
    the dot-product kernel (`dot`), the packed GEMM (`vnni`: called with the packed copy)
    where the ops have it, and the AMX tile kernel (`amx`) where the ops have AMX or the
    widening GEMM (`gemm`) where they have it (levels without bf16 arithmetic)."""
    from treadle.worker.cpu.native_linear import NativeLayerOps

    choices = {"dot": NativeLayerOps(ops.lib, max_rows=max_rows, amx_rows=None)}
    if ops.vnni:
        choices["vnni"] = ops
    if ops.amx_rows is not None:
        choices["amx"] = NativeLayerOps(ops.lib, max_rows=0, amx_rows=(1, 64))
    if ops.gemm_rows is not None:
        choices["gemm"] = NativeLayerOps(ops.lib, max_rows=max(max_rows, ops.max_rows),
                                         gemm_rows=1)
    return choices


def kernels(repeats: int = 15, rows: tuple[int, ...] = (1, 4, 8, 16), isa: str = "auto",
            fp32: bool = False) -> dict:
    import torch
    import torch.nn.functional as F

    from treadle.worker.cpu.linear_kernels import _pack, _packed_linear, packed_kernel_works

    levels = load_levels(isa)
    onednn = packed_kernel_works(torch.bfloat16)  # no: what the engine runs is F.linear
    layer_bytes = sum(n * k * 2 * (1 if name == "lm_head" else LAYERS)
                      for name, (n, k) in SHAPES.items())
    probe = next(iter(levels.values()))[0]
    bandwidth = {"step_sized": read_bandwidth(probe, layer_bytes),
                 "step_sized_huge_pages": read_bandwidth(probe, layer_bytes, huge_pages=True),
                 "2GiB": read_bandwidth(probe, 2 << 30)}
    reference_gb_s = bandwidth["step_sized"]["best_gb_s"]
    gen = torch.Generator().manual_seed(0)
    results, model_ms = [], {}
    for name, (n, k) in SHAPES.items():
        copies = 3 if name == "lm_head" else LAYERS
        weights = [torch.randn(n, k, generator=gen).to(torch.bfloat16) for _ in range(copies)]
        packed = [_pack(w) for w in weights] if onednn else []
        vnni = {level: [ops.pack(w) for w in weights] for level, (_, ops) in levels.items()
                if ops.vnni}
        weights32 = [w.float() for w in weights] if fp32 else []
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            x32 = x.float()
            runs = ({"onednn": (lambda i: _packed_linear(x, packed[i], None), 2)} if onednn
                    else {"torch_bf16": (lambda i: F.linear(x, weights[i]), 2)})
            for level, (_, ops) in levels.items():
                copy = vnni.get(level, [None] * copies)
                runs[f"native_{level}"] = (
                    lambda i, ops=ops, copy=copy: ops.linear(x, weights[i], None,
                                                             packed=copy[i]), 2)
                if ops.amx_rows is not None or ops.gemm_rows is not None or ops.vnni:
                    # each of the kernels it routes between, alone
                    for label, one in kernel_choices(ops, max(rows)).items():
                        runs[f"{label}_{level}"] = (
                            lambda i, one=one, copy=copy, label=label: one.linear(
                                x, weights[i], None,
                                packed=copy[i] if label == "vnni" else None), 2)
            if fp32:
                runs["torch_f32"] = (lambda i: F.linear(x32, weights32[i]), 4)
            best = dict.fromkeys(runs, float("inf"))
            best_cpu = dict.fromkeys(runs, float("inf"))
            for _ in range(repeats):
                for label, (fn, _) in runs.items():
                    t0, c0 = time.perf_counter(), time.process_time()
                    for i in range(copies):
                        fn(i)
                    best[label] = min(best[label], (time.perf_counter() - t0) / copies)
                    best_cpu[label] = min(best_cpu[label], (time.process_time() - c0) / copies)
            row = {"shape": name, "n": n, "k": k, "m": m}
            for label, seconds in best.items():
                gb_s = n * k * runs[label][1] / seconds / 1e9
                row[f"{label}_ms"] = round(seconds * 1e3, 4)
                row[f"{label}_cpu_ms"] = round(best_cpu[label] * 1e3, 4)
                row[f"{label}_gb_s"] = round(gb_s, 1)
                if label.startswith(("native_", "dot_", "vnni_", "amx_", "gemm_")):
                    row[f"{label}_read_fraction"] = round(gb_s / reference_gb_s, 2)
                per_step = LAYERS if name != "lm_head" else 1
                key = f"{label}_m{m}"
                model_ms[key] = round(model_ms.get(key, 0.0) + seconds * 1e3 * per_step, 3)
                model_ms[f"{key}_cpu"] = round(model_ms.get(f"{key}_cpu", 0.0)
                                               + best_cpu[label] * 1e3 * per_step, 3)
            results.append(row)
    return {"torch_threads": torch.get_num_threads(), "repeats": repeats,
            "levels": {level: k.march for level, (k, _) in levels.items()},
            "read_bandwidth": bandwidth, "shapes": results, "model_ms": model_ms}


def _engine(dtype: str, num_requests: int, prompt_len: int, max_tokens: int, kernels, ops):
    """An EngineCore on the demo model whose requests have all finished their prompts,
    prefilled on `kernels` and `ops` (see `_use`)."""
    from treadle.config import EngineConfig
    from treadle.engine.core import EngineCore
    from treadle.request import Request
    from treadle.sampling_params import SamplingParams

    kv_bytes = num_requests * (prompt_len + max_tokens + 16) * 30 * 2 * 3 * 64 * 4
    config = EngineConfig.from_options(model="demo", dtype=dtype, max_num_seqs=num_requests,
                                       max_num_batched_tokens=2048,
                                       kv_cache_memory=max(kv_bytes, 256 << 20),
                                       distributed_executor_backend="uni")
    core = EngineCore(config)
    _use(core, ops if dtype == "bfloat16" else None, kernels)
    vocab = core.vocab_size
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    for i in range(num_requests):
        prompt = [3 + (7919 * (i * prompt_len + j)) % (vocab - 3) for j in range(prompt_len)]
        core.add_request(Request(str(i), prompt, params))
    while any(r.num_uncomputed_tokens > 1 or not r.output_token_ids
              for r in core.scheduler.requests.values()):
        core.step()
    return core


def _use(core, ops, kernels) -> None:
    """Run the engine's layers on `ops` (None: torch) and its decode attention and
    sampling on `kernels` (a benchmark reaching into the runner: the engine picks one
    build at start-up). Through the executor's collective_rpc: the `uni` executor hands
    the kernel objects to its in-process worker as they are."""
    core.executor.collective_rpc("use_native_kernels", kernels, ops)


def steps(num_requests: int, num_steps: int, prompt_len: int = 600, block: int = 5,
          isa: str = "auto", fp32: bool = False) -> dict:
    """Median decode-step seconds per variant: each level's kernels, torch's layers, and
    (fp32) a float32 engine."""
    import torch

    levels = load_levels(isa)
    first = next(iter(levels.values()))[0]
    variants = {level: (ops, k) for level, (k, ops) in levels.items()}
    for level, (k, ops) in levels.items():  # the same kernels called layer by layer
        variants[f"{level}_layer_by_layer"] = (ops, k)
    variants["torch_layers"] = (None, first)
    max_tokens = (len(variants) + 1) * (num_steps + block) + 8
    first_ops = next(iter(levels.values()))[1]
    cores = {"bf16": _engine("bfloat16", num_requests, prompt_len, max_tokens, first, first_ops)}
    if fp32:
        cores["fp32"] = _engine("float32", num_requests, prompt_len, max_tokens, first, None)
        variants["fp32"] = (None, first)
    times: dict[str, list[float]] = {name: [] for name in variants}
    cpu_times: dict[str, list[float]] = {name: [] for name in variants}
    while min(len(t) for t in times.values()) < num_steps:
        for name, (ops, k) in variants.items():
            core = cores["fp32" if name == "fp32" else "bf16"]
            _use(core, ops, k)
            if name.endswith("_layer_by_layer"):
                core.executor.collective_rpc("disable_decode_stack")
            for _ in range(block):
                t0, c0 = time.perf_counter(), time.process_time()
                out = core.step()
                times[name].append(time.perf_counter() - t0)
                cpu_times[name].append(time.process_time() - c0)
                assert len(out) == num_requests, "every request should decode in every step"
    medians = {name: statistics.median(t[:num_steps]) for name, t in times.items()}
    result = {"num_requests": num_requests, "prompt_len": prompt_len, "steps": num_steps,
              "torch_threads": torch.get_num_threads(),
              "attention_of_torch_layers_and_fp32": first.isa}
    for name, seconds in medians.items():
        result[f"median_step_ms_{name}"] = round(seconds * 1e3, 2)
        result[f"median_step_cpu_ms_{name}"] = round(
            statistics.median(cpu_times[name][:num_steps]) * 1e3, 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=0,
                        help="also time this many decode steps per request count")
    parser.add_argument("--requests", default="4,16")
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch's (and so OpenMP's) thread count; default: torch's")
    parser.add_argument("--isa", default="auto", help="kernel ISA levels: auto, all, or a "
                        "comma list such as avx512bf16,avx2 (default: %(default)s)")
    parser.add_argument("--fp32", action="store_true",
                        help="also float32 (F.linear on fp32 weights; a float32 engine)")
    parser.add_argument("--prompt-len", type=int, default=600)
    parser.add_argument("--rows", default="1,4,8,16", help="kernels: row counts M")
    args = parser.parse_args()
    if args.num_threads:
        import torch
        torch.set_num_threads(args.num_threads)
    report = {}
    if not args.skip_kernels:
        report["kernels"] = kernels(args.repeats, tuple(int(m) for m in args.rows.split(",")),
                                    isa=args.isa, fp32=args.fp32)
    if args.steps:
        report["steps"] = [steps(int(r), args.steps, args.prompt_len, isa=args.isa,
                                 fp32=args.fp32) for r in args.requests.split(",")]
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
