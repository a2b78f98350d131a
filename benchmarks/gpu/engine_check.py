"""The engine-level GPU checks: treadle's `LLM(model=..., device="cuda")` end to end.

Steps, each printing what it measured (and all of it as JSON with --json):
 1. token equality with transformers' greedy generate on the same GPU, float32 and
    bfloat16, on tiny random Llama and Qwen3 models made here;
 2. the engine-core workload (bench/workloads.synthetic, 64 requests) on the 1B-parameter
    Llama-shaped checkpoint (make_llama_1b.py, bf16) against transformers' static
    batching (bench/static.py, batches of 16) on the same GPU: output tokens/s, ratio;
 3. the decode-step time at batch 1, 64 and 256, from the engine's per-step trace (steps
    that decode exactly that many requests and nothing else), against the HBM floor:
    weights + the KV bytes the step reads, over 4.8 TB/s;
 4. prefill MFU: 2 x parameters x prompt tokens of prefill-only steps over their time,
    against the bf16 matmul rate measured in this run and against 790 TFLOP/s.

They need treadle's CUDA platform (the `device` engine option, worker/platform.py); the
attention backend is the platform's first (`triton`). Where the option or a GPU is
missing this prints why every step is skipped and exits 0: nothing here fakes a figure. --smoke runs
all four steps on CPU (no device option, tiny models and workloads) to check the script.

    python benchmarks/gpu/engine_check.py --work-dir /tmp/treadle-gpu --json engine.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from treadle import LLM, SamplingParams  # noqa: E402
from treadle.bench.static import generate_batch, load_model, run_static  # noqa: E402
from treadle.measure.workloads import synthetic  # noqa: E402
from treadle.config import EngineConfig  # noqa: E402
from treadle.engine.trace import read_trace  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_llama_1b import make_llama_1b  # noqa: E402

HBM_BYTES_PER_S = 4.8e12
BF16_FLOPS = 790e12
FULL = dict(workload=dict(num_requests=64), decode_batches=(1, 64, 256), decode_prompt=512,
            decode_tokens=32, prefill=(16, 2048), budget=8192, max_num_seqs=256,
            checkpoint={}, matmul=8192)
SMOKE = dict(workload=dict(num_requests=8, prompt_len=(16, 64), output_len=(4, 16),
                           num_long=1, long_output_len=32),
             decode_batches=(1, 4, 8), decode_prompt=32, decode_tokens=6, prefill=(4, 64),
             budget=128, max_num_seqs=8, checkpoint=dict(num_hidden_layers=2,
                                                         hidden_size=256,
                                                         intermediate_size=512),
             matmul=256)


def config_fields() -> set[str]:
    return {f.name for section in EngineConfig.section_types().values()
            for f in dataclasses.fields(section)}


def platform_options(smoke: bool) -> tuple[dict, str | None]:
    """The engine options that put treadle on the GPU, or why they cannot yet."""
    if smoke:
        return {}, None
    if "device" not in config_fields():
        return {}, "treadle has no `device` engine option (worker/platform.py)"
    try:
        EngineConfig.from_options(device="cuda")
    except (TypeError, ValueError) as exc:
        return {}, f"device='cuda' is refused: {exc}"
    if not torch.cuda.is_available():
        return {}, "no CUDA GPU"
    options = {"device": "cuda"}
    # the static baseline runs after the engine is deleted; 24 GiB of KV hold every step
    # here (256 requests x 544 tokens x 32 KiB is 4.3 GiB) with room to spare
    if "gpu_memory_utilization" in config_fields():
        options["gpu_memory_utilization"] = 0.5
    elif "kv_cache_memory" in config_fields():
        options["kv_cache_memory"] = "24GiB"
    return options, None


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def tiny_checkpoint(path: Path, family: str) -> str:
    import transformers

    cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[family]
    config = cls(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                 initializer_range=0.2, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).to(torch.float32).save_pretrained(path)
    return str(path)


def step_token_equality(work: Path, device_options: dict, device: str) -> list[dict]:
    rng = random.Random(1)
    lengths = [1, 5, 16, 17, 63, 200]
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]
    max_tokens = 24
    rows = []
    for family in ("llama", "qwen3"):
        model_dir = tiny_checkpoint(work / f"tiny-{family}", family)
        for dtype in ("float32", "bfloat16"):
            model = load_model(model_dir, dtype, device)
            model.generation_config.eos_token_id = None
            expected = [generate_batch(model, [p], max_tokens, pad_id=0)[0].tolist()
                        for p in prompts]
            del model
            free_memory()
            llm = LLM(model=model_dir, dtype=dtype, num_kv_blocks=512, block_size=16,
                      max_num_batched_tokens=64, **device_options)
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                   use_tqdm=False)
            del llm
            free_memory()
            got = [list(o.outputs[0].token_ids) for o in outputs]
            prefix = [next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), len(e))
                      for g, e in zip(got, expected)]
            rows.append({"family": family, "dtype": dtype,
                         "requests_equal": sum(g == e for g, e in zip(got, expected)),
                         "requests": len(prompts),
                         "mean_matching_prefix": statistics.mean(prefix),
                         "tokens_per_request": max_tokens})
            print(f"  {family} {dtype}: {rows[-1]['requests_equal']}/{len(prompts)} requests "
                  f"token-equal, mean matching prefix {rows[-1]['mean_matching_prefix']:.1f}"
                  f"/{max_tokens}")
    return rows


def trace_steps(path: Path, after_step: int):
    return [s for s in read_trace(path).steps if s.step > after_step]


def last_step(path: Path) -> int:
    steps = read_trace(path).steps
    return steps[-1].step if steps else -1


def matmul_rate(device: str, size: int) -> float:
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ a
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ a
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * size**3 * 10 / (time.perf_counter() - t0)


def step_engine(work: Path, plan: dict, device_options: dict, device: str) -> dict:
    ckpt = work / "llama-1b"
    if not ckpt.exists():
        t0 = time.perf_counter()
        make_llama_1b(ckpt, seed=0, **plan["checkpoint"])
        print(f"  checkpoint written in {time.perf_counter() - t0:.1f} s")
    config = json.loads((ckpt / "config.json").read_text())
    workload = synthetic(vocab_size=config["vocab_size"], **plan["workload"])
    trace = work / "trace.jsonl"
    t0 = time.perf_counter()
    llm = LLM(model=str(ckpt), dtype="bfloat16", trace=str(trace),
              max_num_seqs=plan["max_num_seqs"], max_num_batched_tokens=plan["budget"],
              **device_options)
    load_s = time.perf_counter() - t0
    num_params = llm.engine.info.num_parameters
    greedy = dict(temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(3, 67))}] * 2,
                 SamplingParams(max_tokens=4, **greedy), use_tqdm=False)  # warm-up

    # 2. the engine-core workload
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload.requests]
    params = [SamplingParams(max_tokens=r.max_tokens, **greedy) for r in workload.requests]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {"num_params": num_params, "load_s": load_s,
              "treadle": {"wall_s": wall, "output_tokens": out_tokens,
                          "output_tokens_per_s": out_tokens / wall}}

    # 3. decode steps at fixed batch sizes
    kv_per_token = (2 * config["num_hidden_layers"] * config["num_key_value_heads"]
                    * config["hidden_size"] // config["num_attention_heads"] * 2)
    rng = random.Random(2)
    result["decode"] = []
    for batch in plan["decode_batches"]:
        before = last_step(trace)
        llm.generate([{"prompt_token_ids": [rng.randrange(3, config["vocab_size"])
                                            for _ in range(plan["decode_prompt"])]}] * batch,
                     SamplingParams(max_tokens=plan["decode_tokens"], **greedy),
                     use_tqdm=False)
        steps = [s for s in trace_steps(trace, before) if len(s.scheduled) == batch
                 and all(kind == "decode" for _, _, kind in s.scheduled)]
        step_s = statistics.median(s.t_end - s.t_start for s in steps)
        context = plan["decode_prompt"] + plan["decode_tokens"] // 2
        floor_s = (2 * num_params + batch * context * kv_per_token) / HBM_BYTES_PER_S
        result["decode"].append({"batch": batch, "steps": len(steps), "step_ms": step_s * 1e3,
                                 "floor_ms": floor_s * 1e3, "over_floor": step_s / floor_s})

    # 4. prefill MFU
    peak = matmul_rate(device, plan["matmul"])
    num_prompts, length = plan["prefill"]
    before = last_step(trace)
    llm.generate([{"prompt_token_ids": [rng.randrange(3, config["vocab_size"])
                                        for _ in range(length)]} for _ in range(num_prompts)],
                 SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
    steps = [s for s in trace_steps(trace, before)
             if all(kind == "prefill" for _, _, kind in s.scheduled)]
    rates = [sum(n for _, n, _ in s.scheduled) / (s.t_end - s.t_start) for s in steps]
    tokens_per_s = statistics.median(rates)
    result["prefill"] = {"steps": len(steps), "tokens_per_s": tokens_per_s,
                         "matmul_peak_flops": peak,
                         "mfu_measured_peak": 2 * num_params * tokens_per_s / peak,
                         "mfu_790": 2 * num_params * tokens_per_s / BF16_FLOPS}
    del llm
    free_memory()

    # 2 (baseline): static batching on the same device
    static = run_static(str(ckpt), workload, batch_size=16, dtype="bfloat16", progress=False,
                        device=device)
    result["static"] = {k: static[k] for k in ("wall_s", "useful_output_tokens",
                                               "generated_tokens", "output_tokens_per_s")}
    result["speedup_output_tokens_per_s"] = (result["treadle"]["output_tokens_per_s"]
                                             / static["output_tokens_per_s"])
    print(f"  engine-core workload: treadle {out_tokens / wall:.0f} output tok/s, static "
          f"batching {static['output_tokens_per_s']:.0f} -> "
          f"{result['speedup_output_tokens_per_s']:.1f}x (target >= 10x)")
    for d in result["decode"]:
        print(f"  decode batch {d['batch']:>3}: {d['step_ms']:.3f} ms/step over {d['steps']} "
              f"steps, HBM floor {d['floor_ms']:.3f} ms -> {d['over_floor']:.2f}x "
              f"(target at 64: <= 1.5x)")
    p = result["prefill"]
    print(f"  prefill: {p['tokens_per_s']:.0f} tok/s over {p['steps']} steps, MFU "
          f"{p['mfu_measured_peak']:.1%} of the measured {peak / 1e12:.0f} TFLOP/s, "
          f"{p['mfu_790']:.1%} of 790")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work-dir", help="checkpoints and the trace (default: a temp dir)")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run of every step")
    parser.add_argument("--steps", default="tokens,engine", help="comma-separated subset")
    args = parser.parse_args()
    device_options, why_not = platform_options(args.smoke)
    result: dict = {"smoke": args.smoke}
    if why_not:
        print(f"engine steps skipped: {why_not}")
        result["skipped"] = why_not
    else:
        device = "cpu" if args.smoke else "cuda"
        work = Path(args.work_dir or tempfile.mkdtemp(prefix="treadle-gpu-"))
        work.mkdir(parents=True, exist_ok=True)
        plan = SMOKE if args.smoke else FULL
        steps = args.steps.split(",")
        if "tokens" in steps:
            print("1. token equality with transformers")
            result["token_equality"] = step_token_equality(work, device_options, device)
        if "engine" in steps:
            print("2-4. engine-core workload, decode steps, prefill MFU")
            result["engine"] = step_engine(work, plan, device_options, device)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
