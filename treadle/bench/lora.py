"""Multi-LoRA offline throughput: the same workload with 0, 1, 4 and 16 distinct adapters,
against the base model alone, side by side in one run.

Owns the measurement of the multi-LoRA issue. Two engines on one model live in the
process for the whole run: the base model (`enable_lora=False`), and one with LoRA on
(`max_loras` >= the most adapters used, so every adapter stays resident). Each repeat
runs every configuration once, in turn (base, 0 adapters, 1, 4, 16): 0 adapters is the
LoRA engine with no request using one (what wrapping the layers costs); with k adapters,
request i runs adapter i % k. Every request ignores EOS and runs to its max_tokens, so
each configuration computes the same tokens. Adapters are random (rank `--rank` on all
seven modules, PEFT format, written once into the cache folder): fine for speed, never
for quality. Every adapter is read and made resident in a warm-up before the clock
starts. The result is the median over repeats of each configuration's output tokens/s
and its ratio to the base model's median, with the machine's load average before and
after (machines here are shared).

Run: `python -m treadle.bench.lora [--repeats 3] [--adapters 0,1,4,16] [--num-requests N]`
or `treadle bench lora -- ...` (prints a table, writes JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from treadle.measure.report import environment, format_table, write_json
from treadle.measure.workloads import synthetic

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(path: Path, model_dir: Path, rank: int, seed: int,
                         modules: tuple[str, ...] = MODULES, alpha: float | None = None) -> Path:
    """A PEFT-format adapter with random weights for the checkpoint at `model_dir`
    (adapter_config.json + adapter_model.safetensors); kept if already complete."""
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    if (path / "adapter_model.safetensors").exists() and (path / "adapter_config.json").exists():
        return path
    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = (config.get("num_key_value_heads") or heads) * head_dim
    shapes = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv),
              "v_proj": (hidden, kv), "o_proj": (heads * head_dim, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in modules:
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            fan_in, fan_out = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (
                torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5).to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = (
                torch.randn(fan_out, rank, generator=gen) * 0.02).to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    partial = path / "adapter_model.safetensors.partial"
    save_file(tensors, str(partial))
    os.replace(partial, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha if alpha is not None else 2 * rank,
        "target_modules": list(modules), "bias": "none", "use_rslora": False,
        "base_model_name_or_path": str(model_dir)}, indent=2))
    return path


def _load_average() -> list[float]:
    try:
        return list(os.getloadavg())
    except OSError:
        return []


def run(model: str | None = None, adapter_counts: tuple[int, ...] = (0, 1, 4, 16),
        repeats: int = 3, num_requests: int = 48, rank: int = 16, dtype: str = "bfloat16",
        kv_cache_memory: str = "1GiB", prompt_len: tuple[int, int] = (32, 384),
        output_len: tuple[int, int] = (16, 160), num_threads: int | None = None,
        progress: bool = False) -> dict:
    from treadle import LLM, LoRARequest, SamplingParams
    from treadle.models.demo import demo_model_path
    from treadle.paths import cache_dir

    model_dir = Path(model) if model else demo_model_path()
    num_adapters = max(adapter_counts)
    adapter_root = cache_dir() / "lora-bench" / f"{model_dir.name}-r{rank}"
    adapters = [write_random_adapter(adapter_root / f"adapter{i}", model_dir, rank, seed=i)
                for i in range(num_adapters)]
    loras = [LoRARequest(f"bench{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    workload = synthetic(num_requests=num_requests, prompt_len=prompt_len,
                         output_len=output_len, num_long=0, seed=0)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload.requests]
    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0.0)
              for r in workload.requests]
    options = dict(model=str(model_dir), dtype=dtype, kv_cache_memory=kv_cache_memory)
    if num_threads is not None:
        options["num_threads"] = num_threads
    engines = {"base": LLM(**options)}
    if num_adapters or 0 in adapter_counts:
        engines["lora"] = LLM(**options, enable_lora=True, max_loras=max(num_adapters, 1),
                              max_cpu_loras=max(num_adapters, 1), max_lora_rank=rank)
    warm = [{"prompt_token_ids": list(range(3, 40))}]
    short = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)
    engines["base"].generate(warm * 2, short, use_tqdm=False)
    if "lora" in engines:
        engines["lora"].generate(warm * max(len(loras), 1), short, use_tqdm=False,
                                 lora_request=loras or None)  # every adapter read, resident
    configs = [("base", "base", 0)] + [(f"{k} adapters", "lora", k) for k in adapter_counts]
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in configs}
    load_before = _load_average()
    for repeat in range(repeats):
        for label, engine_name, k in configs:
            llm = engines[engine_name]
            per_prompt = [loras[i % k] for i in range(len(prompts))] if k else None
            steps_before = llm.get_stats()["num_steps"]
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=progress, lora_request=per_prompt)
            wall = time.perf_counter() - start
            errors = [o.error for o in outputs if o.error]
            if errors:
                raise RuntimeError(f"{label}: {len(errors)} requests failed: {errors[0]}")
            out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            runs[label].append({"repeat": repeat, "wall_s": wall,
                                "output_tokens": out_tokens,
                                "output_tokens_per_s": out_tokens / wall,
                                "num_steps": llm.get_stats()["num_steps"] - steps_before})
            print(f"repeat {repeat} {label:>12}: {out_tokens / wall:7.1f} output tok/s "
                  f"({wall:.1f} s)", file=sys.stderr, flush=True)
    load_after = _load_average()
    base_median = statistics.median(r["output_tokens_per_s"] for r in runs["base"])
    summary = []
    for label, engine_name, k in configs:
        rates = [r["output_tokens_per_s"] for r in runs[label]]
        median = statistics.median(rates)
        summary.append({"config": label, "adapters": k if engine_name == "lora" else None,
                        "median_output_tok_s": median, "min": min(rates), "max": max(rates),
                        "vs_base": median / base_median})
    lora_engine = engines.get("lora")
    lora_stats = (lora_engine.engine.executor.collective_rpc("lora_stats")[0]
                  if lora_engine is not None else None)  # rank 0's manager
    for llm in engines.values():
        llm.engine.shutdown()
    return {
        "model": str(model_dir), "dtype": dtype, "rank": rank, "modules": list(MODULES),
        "repeats": repeats, "workload": workload.description,
        "prompt_tokens": workload.total_prompt_tokens,
        "output_tokens": workload.total_output_tokens,
        "max_loras": max(num_adapters, 1), "load_average_before": load_before,
        "load_average_after": load_after, "summary": summary, "runs": runs,
        "lora_manager": lora_stats,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="treadle bench lora", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: demo model)")
    parser.add_argument("--adapters", default="0,1,4,16",
                        help="comma-separated counts of distinct adapters")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--prompt-len", default="32,384",
                        help="prompt lengths drawn between these two (tokens)")
    parser.add_argument("--output-len", default="16,160",
                        help="output lengths drawn between these two (tokens)")
    parser.add_argument("--output", default=None, help="JSON result (default results/lora.json)")
    args = parser.parse_args(argv)
    counts = tuple(int(c) for c in args.adapters.split(",") if c.strip())
    if not counts or min(counts) < 0:
        parser.error("--adapters must be counts >= 0, e.g. 0,1,4,16")
    def pair(text: str, name: str) -> tuple[int, int]:
        try:
            lo, hi = (int(v) for v in text.split(","))
        except ValueError:
            parser.error(f"--{name} must be two integers, e.g. 32,384")
        if not 1 <= lo <= hi:
            parser.error(f"--{name} must be 1 <= low <= high")
        return lo, hi

    result = run(args.model, counts, args.repeats, args.num_requests, args.rank, args.dtype,
                 args.kv_cache_memory, pair(args.prompt_len, "prompt-len"),
                 pair(args.output_len, "output-len"), num_threads=args.num_threads)
    print(format_table(result["summary"], ["config", "median_output_tok_s", "min", "max",
                                           "vs_base"]))
    print(f"load average before {result['load_average_before']}, after "
          f"{result['load_average_after']}; LoRA manager: {result['lora_manager']}")
    result["environment"] = environment()
    print("wrote", write_json(args.output or Path("results") / "lora.json", result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
