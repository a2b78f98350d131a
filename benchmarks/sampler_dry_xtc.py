"""What DRY and XTC cost the sampler: one `Sampler.sample` call on [256, 49152] logits
with temperature 0.8, plain against the same with DRY (llama.cpp's defaults, multiplier
0.8, over 512-token histories that repeat) and with XTC (probability 0.5, threshold 0.1),
on the C kernel path (when it builds) and the torch path. The three run in turn, each
repeat in a rotating order; it prints each one's median seconds and its ratio to plain
(ratios of systems measured side by side survive a busy machine better than the
seconds). It reports what it measured; nothing here is a target.

Run: `python benchmarks/sampler_dry_xtc.py [--rows 256] [--history 512] [--repeats 7]`
(prints JSON).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def _histories(rows: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Token histories with repeats (random tokens and copies of earlier stretches)."""
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        h = [rng.randrange(vocab) for _ in range(8)]
        while len(h) < length:
            if rng.random() < 0.3:
                start = rng.randrange(len(h))
                h += h[start:start + rng.randrange(2, 12)]
            else:
                h.append(rng.randrange(vocab))
        out.append(h[:length])
    return out


def measure(rows: int = 256, vocab: int = 49152, history: int = 512, repeats: int = 7,
            native: bool = True, seed: int = 0) -> dict:
    import torch
    from transformers import PreTrainedTokenizerFast

    from treadle.engine.token_words import TokenWords
    from treadle.models.demo import build_demo_tokenizer
    from treadle.sampling_params import SamplingParams
    from treadle.worker.cpu.native import load_kernels
    from treadle.worker.cpu.native_sampling import NativeSampling
    from treadle.worker.sampler import Sampler

    kernels = load_kernels("auto") if native else None
    sampler = Sampler(seed, NativeSampling(kernels) if kernels is not None else None)
    words = TokenWords(PreTrainedTokenizerFast(tokenizer_object=build_demo_tokenizer()))
    systems = {
        "plain": SamplingParams(temperature=0.8),
        "dry": words.resolve(SamplingParams(temperature=0.8, dry_multiplier=0.8)),
        "xtc": SamplingParams(temperature=0.8, xtc_probability=0.5, xtc_threshold=0.1),
    }
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3.0
    histories = _histories(rows, history, vocab, seed)
    prompts = [h[:history // 2] for h in histories]
    outputs = [h[history // 2:] for h in histories]
    ids = [str(i) for i in range(rows)]
    times: dict[str, list[float]] = {name: [] for name in systems}
    names = list(systems)
    for r in range(repeats + 1):  # the first round warms up
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            batch = logits.clone()
            t0 = time.perf_counter()
            sampler.sample(batch, ids, [systems[name]] * rows, prompts, outputs)
            if r:
                times[name].append(time.perf_counter() - t0)
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {"path": "C kernel" if sampler.kernels is not None else "torch",
            "rows": rows, "vocab": vocab, "history": history, "repeats": repeats,
            "median_s": medians,
            "ratio_to_plain": {name: medians[name] / medians["plain"] for name in medians}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--history", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    results = [measure(args.rows, history=args.history, repeats=args.repeats, native=native)
               for native in (True, False)]
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
