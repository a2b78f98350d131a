"""The sampler's cost: its time in a decode step of 256 requests with mixed parameters.

Owns one measurement (the closing note of the sampling issue): an EngineCore on the demo
model (bf16, 49152-id vocabulary) runs 256 requests that decode together, each with its
own sampling parameters (greedy, temperature, top-k, top-p, min-p, penalties, seeds,
logprobs); for steps where all 256 only decode, it reports the median whole-step time,
the median time inside the sampler (logits of the model, penalties over real token
histories), and the share. It also times the sampler alone on synthetic [256, 49152]
logits, peaked (typical of a trained model) and flat (the demo's random weights, the worst
case for top-p), through the C kernel (as the engine runs it when the kernels build) and
through the torch fallback (`_torch` keys). It reports what it measured; nothing here is a
target.

Run: `python benchmarks/sampler.py [--steps N] [--repeats N]` (prints JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

MIXED_PARAMS: list[dict[str, Any]] = [
    dict(temperature=0.0),
    dict(temperature=0.0, logprobs=5),
    dict(temperature=0.8),
    dict(temperature=1.0, top_k=50),
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=0.9, top_k=100, top_p=0.95, repetition_penalty=1.1,
         presence_penalty=0.5, frequency_penalty=0.3),
    dict(temperature=1.0, top_p=0.9, logprobs=5),
]
"""Cycled over the requests; every other request also has a seed."""


def mixed_params(num_requests: int, max_tokens: int = 64):
    from treadle.sampling_params import SamplingParams
    return [SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                           seed=i if i % 2 else None, **MIXED_PARAMS[i % len(MIXED_PARAMS)])
            for i in range(num_requests)]


def sampler_alone(num_requests: int = 256, vocab_size: int = 49152, scale: float = 3.0,
                  history: int = 512, repeats: int = 5, seed: int = 0,
                  native: bool = True) -> dict:
    """Median seconds of one Sampler.sample call on [num_requests, vocab] logits, with the
    C kernel (when it builds and `native`) or the torch path."""
    import torch

    from treadle.worker.cpu.native import load_kernels
    from treadle.worker.cpu.native_sampling import NativeSampling
    from treadle.worker.sampler import Sampler

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_requests, vocab_size, generator=gen) * scale
    params = mixed_params(num_requests)
    prompts = [torch.randint(0, vocab_size, (history,), generator=gen).tolist()
               for _ in range(num_requests)]
    outputs = [p[:history // 8] for p in prompts]
    ids = [str(i) for i in range(num_requests)]
    kernels = load_kernels() if native else None
    sampler = Sampler(seed, None if kernels is None else NativeSampling(kernels))
    times = []
    for _ in range(repeats + 1):
        x = logits.clone()
        t0 = time.perf_counter()
        sampler.sample(x, ids, params, prompts, outputs, eos_token_id=2)
        times.append(time.perf_counter() - t0)
    return {"logit_scale": scale, "history_tokens": history,
            "path": "native" if kernels is not None else "torch",
            "median_s": statistics.median(times[1:])}


def sampler_in_step(num_requests: int = 256, prompt_len: int = 8, steps: int = 5,
                    num_threads: int | None = None) -> dict:
    """Whole decode steps of the demo model with num_requests mixed-parameter requests."""
    from treadle.engine.core import EngineCore
    from treadle.config import EngineConfig
    from treadle.request import Request

    config = EngineConfig.from_options(model="demo", dtype="bfloat16", max_num_seqs=num_requests,
                                       max_num_batched_tokens=max(2048, num_requests),
                                       kv_cache_memory="2GiB", num_threads=num_threads)
    core = EngineCore(config)
    vocab = core.vocab_size
    for i, params in enumerate(mixed_params(num_requests, max_tokens=steps + 8)):
        prompt = [3 + (7919 * (i * prompt_len + j)) % (vocab - 3) for j in range(prompt_len)]
        core.add_request(Request(str(i), prompt, params))
    while any(r.num_uncomputed_tokens > 1 or not r.output_token_ids
              for r in core.scheduler.requests.values()):
        core.step()  # prefill, until every request decodes
    step_s, sample_s, forward_s = [], [], []
    for _ in range(steps):
        sample0, forward0 = core.timings.sample_s, core.timings.forward_s
        t0 = time.perf_counter()
        out = core.step()
        step_s.append(time.perf_counter() - t0)
        sample_s.append(core.timings.sample_s - sample0)
        forward_s.append(core.timings.forward_s - forward0)
        assert len(out) == num_requests, "every request should decode in every timed step"
    step, sample = statistics.median(step_s), statistics.median(sample_s)
    return {"num_requests": num_requests, "vocab_size": vocab, "dtype": core.info.dtype,
            "steps": steps, "median_step_s": step, "median_sampler_s": sample,
            "median_forward_s": statistics.median(forward_s),
            "sampler_share_of_step": sample / step}


def run(steps: int = 5, repeats: int = 5, num_threads: int | None = None) -> dict:
    import torch

    in_step = sampler_in_step(steps=steps, num_threads=num_threads)
    step_s = in_step["median_step_s"]
    out = {"torch_threads": torch.get_num_threads(), "in_step": in_step}
    for native in (True, False):
        for name, scale in (("peaked", 3.0), ("flat", 0.05)):
            alone = sampler_alone(scale=scale, repeats=repeats, native=native)
            key = f"alone_{name}" + ("" if alone["path"] == "native" else "_torch")
            out[key] = dict(alone, share_of_step=alone["median_s"] / step_s)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args()
    print(json.dumps(run(args.steps, args.repeats, args.num_threads), indent=2))


if __name__ == "__main__":
    main()
