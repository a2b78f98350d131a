"""`treadle bench quality`: what each quantized path costs in output quality, against a
float32 reference, teacher-forced on real text.

Every configuration scores the same tokens of a real text (benchmarks/data's two essays,
over 2,000 tokens) in windows, each token once with at least half a window of context,
and returns every position's log-probabilities over the whole vocabulary
(`SamplingParams(prompt_logprobs=-1)`). Against the float32 reference (dense weights
dequantized from the model's file, float32 KV) each configuration gets: top-1 agreement
(the fraction of positions whose most likely next token is the reference's) and the mean
KL divergence KL(reference || configuration) in nats. Rows: bf16 (the baseline: dense
weights and KV in bf16), the GGUF kernels on the file's own blocks (also against bf16's
dequantized weights), int8 KV, fp8 KV, and H2O eviction at half the window. Quality is
measured on the real SmolLM2-135M-Instruct (the default model), never on random weights.
Public API only; it changes nothing in the engine.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from treadle.bench.quality import windows

DATA = Path(__file__).resolve().parents[2] / "benchmarks" / "data"
DEFAULT_TEXTS = (DATA / "treadle_essay.txt", DATA / "river_essay.txt")
FLOOR = -60.0
"""Log-probabilities are clamped here before comparing (float16 underflows to -inf past
-65504; e^-60 is ~1e-26 of probability, nothing a KL figure can see)."""


def configurations(window: int, is_gguf: bool) -> dict[str, dict[str, Any]]:
    """The engines compared: name -> LLM options (the reference first)."""
    bf16 = {"dtype": "bfloat16", "quantization": "none"}
    configs = {
        "float32 (reference)": {"dtype": "float32", "quantization": "none"},
        "bf16": bf16,
    }
    if is_gguf:
        configs["GGUF kernels, bf16"] = {"dtype": "bfloat16", "quantization": "gguf"}
    configs["int8 KV, bf16"] = {**bf16, "kv_cache_dtype": "int8"}
    configs["fp8 KV, bf16"] = {**bf16, "kv_cache_dtype": "fp8_e4m3"}
    configs["H2O at 50%, bf16"] = {**bf16, "kv_eviction": "h2o",
                                   "kv_budget_tokens": window // 2,
                                   "max_num_batched_tokens": 64}
    return configs


def score(llm, token_ids: list[int], window: int, stride: int) -> np.ndarray:
    """[scored tokens, vocab] float16 log-probabilities of every scored position."""
    from treadle import SamplingParams

    spans = windows(len(token_ids), window, stride)
    outs = llm.generate([{"prompt_token_ids": token_ids[s:e]} for s, e, _ in spans],
                        SamplingParams(max_tokens=0, prompt_logprobs=-1), use_tqdm=False)
    rows = []
    for (start, end, score_from), out in zip(spans, outs):
        if out.error:
            raise RuntimeError(f"window {start}:{end} failed: {out.error}")
        rows.append(out.prompt_logprob_array[score_from - start:end - start])
    return np.concatenate(rows)


def compare(reference: np.ndarray, other: np.ndarray, block: int = 512) -> dict[str, float]:
    """Top-1 agreement and mean KL(reference || other) over rows, in blocks of rows."""
    same, kl = 0, 0.0
    for a in range(0, len(reference), block):
        p = np.maximum(reference[a:a + block].astype(np.float32), FLOOR)
        q = np.maximum(other[a:a + block].astype(np.float32), FLOOR)
        same += int((p.argmax(axis=1) == q.argmax(axis=1)).sum())
        kl += float((np.exp(p) * (p - q)).sum(axis=1, dtype=np.float64).sum())
    return {"top1_agreement": same / len(reference), "mean_kl": kl / len(reference)}


def run_quality(model: str | None = None, texts=DEFAULT_TEXTS, window: int = 512,
                min_tokens: int = 2000) -> dict[str, Any]:
    """Every configuration against the float32 reference (and the GGUF kernels against
    bf16), on the same tokens."""
    from treadle import LLM
    from treadle.bench.quality import gguf_source

    text = "\n\n".join(Path(t).read_text() for t in texts)
    stride = window // 2
    configs = configurations(window, gguf_source(model) is not None)
    result: dict[str, Any] = {"model": model or "default", "window": window, "stride": stride,
                              "rows": {}}
    scored: dict[str, np.ndarray] = {}
    token_ids: list[int] = []
    for name, options in configs.items():
        t0 = time.perf_counter()
        llm = LLM(model=model, **options)
        try:
            if not token_ids:
                token_ids = llm.tokenizer.encode(text, add_special_tokens=False)
                if len(token_ids) - 1 < min_tokens:
                    raise ValueError(f"the texts have {len(token_ids) - 1} tokens to score, "
                                     f"fewer than {min_tokens}")
                result["num_scored"] = len(token_ids) - 1
            scored[name] = score(llm, token_ids, window, stride)
        finally:
            llm.engine.shutdown()
        row: dict[str, Any] = {"options": options,
                               "seconds": round(time.perf_counter() - t0, 1)}
        reference = next(iter(scored.values()))
        if scored[name] is not reference:
            row.update(compare(reference, scored[name]))
        if name.startswith("GGUF"):
            row["vs_bf16"] = compare(scored["bf16"], scored[name])
        result["rows"][name] = row
        if name not in ("float32 (reference)", "bf16"):
            del scored[name]  # only the reference and bf16 are compared against
    return result
