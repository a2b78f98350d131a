"""Output quality: perplexity of a fixed text through treadle and through transformers.

Owns `treadle bench perplexity`: the text (benchmarks/data/treadle_essay.txt by default)
tokenized once, cut into overlapping windows when it is longer than the window (each
token scored once, with at least `window - stride` tokens of context after the first
window), scored by treadle through prompt logprobs (`SamplingParams(prompt_logprobs=0,
max_tokens=1)`) and by transformers from its logits, and the two perplexities side by
side. Also helpers for comparing two runs of a model (greedy-token agreement, mean KL
divergence of two sets of logits) for the quantization and KV-compression work. It
measures; it changes nothing in the engine.
"""

from __future__ import annotations

import hashlib
import math
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

DEFAULT_TEXT = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "treadle_essay.txt"


def windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, score_from) per window: tokens [score_from, end) are scored with the
    context [start, position). Every token but the first is scored exactly once."""
    if window < 2 or not 0 < stride < window:  # stride < window: each window has context
        raise ValueError(f"need window >= 2 and 0 < stride < window, got window={window}, "
                         f"stride={stride}")
    spans, start, scored_to = [], 0, 1
    while scored_to < num_tokens:
        end = min(start + window, num_tokens)
        spans.append((start, end, scored_to))
        scored_to = end
        start += stride
    return spans


def perplexity(logprobs: Sequence[float]) -> float:
    """exp of the mean negative log-likelihood per token."""
    values = np.asarray(logprobs, dtype=np.float64)
    return float(math.exp(-values.mean()))


def treadle_logprobs(llm, token_ids: list[int], window: int, stride: int) -> np.ndarray:
    """The log-probability treadle gives each token (positions 1..N-1), in windows."""
    from treadle import SamplingParams

    spans = windows(len(token_ids), window, stride)
    params = SamplingParams(prompt_logprobs=0, max_tokens=1, temperature=0.0)
    outputs = llm.generate([{"prompt_token_ids": token_ids[s:e]} for s, e, _ in spans],
                           params, use_tqdm=False)
    values = []
    for (start, end, score_from), out in zip(spans, outputs):
        if out.error:
            raise RuntimeError(f"window {start}:{end} failed: {out.error}")
        for position in range(score_from, end):
            entry = out.prompt_logprobs[position - start]
            values.append(entry[token_ids[position]].logprob)
    return np.asarray(values, dtype=np.float64)


def transformers_logprobs(model, token_ids: list[int], window: int,
                          stride: int) -> np.ndarray:
    """The same figures from a transformers causal LM (its logits, log-softmaxed in fp32)."""
    import torch

    values = []
    with torch.inference_mode():
        for start, end, score_from in windows(len(token_ids), window, stride):
            ids = torch.tensor([token_ids[start:end]])
            logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            targets = ids[0, score_from - start:]
            rows = logprobs[score_from - start - 1:end - start - 1]
            values += rows.gather(1, targets[:, None])[:, 0].tolist()
    return np.asarray(values, dtype=np.float64)


def greedy_agreement(a: Sequence[int], b: Sequence[int]) -> dict[str, Any]:
    """How two greedy continuations agree: the first position where they differ (None if
    they are equal over their common length) and the fraction of equal positions."""
    common = min(len(a), len(b))
    first = next((i for i in range(common) if a[i] != b[i]), None)
    equal = sum(x == y for x, y in zip(a, b))
    return {"first_divergence": first, "fraction_equal": equal / common if common else 1.0,
            "length_a": len(a), "length_b": len(b)}


def teacher_forced_agreement(llm, prompt_ids: Sequence[Sequence[int]],
                             reference: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Each prompt followed by its reference continuation, scored by `llm` (prompt
    logprobs): the positions of the continuations where `llm`'s own greedy choice is the
    reference's token. Unlike free-running agreement, a near-tie counts once, not for the
    rest of the request. (The tokens run as prefill rows, so the kernels are the prefill
    paths.)"""
    from treadle import SamplingParams

    outs = llm.generate([{"prompt_token_ids": list(p) + list(r)}
                         for p, r in zip(prompt_ids, reference)],
                        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1),
                        use_tqdm=False)
    same = total = 0
    for out, prompt, ref in zip(outs, prompt_ids, reference):
        for position, token in enumerate(ref, start=len(prompt)):
            entries = out.prompt_logprobs[position]
            top = min(entries.items(), key=lambda item: item[1].rank)[0]
            same += top == token
            total += 1
    return {"agreeing_tokens": same, "tokens": total,
            "fraction": round(same / total, 4) if total else 1.0}


def mean_kl_divergence(p_logits, q_logits) -> float:
    """Mean over rows of KL(P || Q), P and Q the softmaxes of two [rows, vocab] logits
    (e.g. a reference model and a quantized one on the same tokens), in nats."""
    import torch

    p = torch.log_softmax(torch.as_tensor(p_logits).double(), dim=-1)
    q = torch.log_softmax(torch.as_tensor(q_logits).double(), dim=-1)
    return float((p.exp() * (p - q)).sum(dim=-1).mean())


def gguf_source(model: str | None) -> Path | None:
    """The GGUF file behind a model string (the default model's too), else None."""
    if model is None:
        from treadle.models.default_model import default_model_gguf
        return default_model_gguf()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        files = sorted(path.glob("*.gguf"))
        return files[0] if len(files) == 1 else None
    return None


def load_reference(model: str | None, model_dir: Path, dtype: str):
    """The transformers model: from the GGUF file itself when there is one (independent
    of treadle's conversion), else from the checkpoint directory."""
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    source = gguf_source(model)
    if source is not None:
        model_obj = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name,
                                                         dtype=torch_dtype)
        return model_obj.eval(), f"transformers (GGUF {source.name})"
    return (AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype).eval(),
            "transformers")


def run_perplexity(model: str | None, text_path: str | Path | None = None, window: int = 1024,
                   stride: int = 512, dtype: str = "float32",
                   with_transformers: bool = True) -> dict[str, Any]:
    """Perplexity of the text through treadle and (optionally) transformers, same tokens."""
    from treadle import LLM

    text_path = text_path or DEFAULT_TEXT
    text_bytes = Path(text_path).read_bytes()
    start = time.perf_counter()
    llm = LLM(model=model, dtype=dtype)
    token_ids = llm.tokenizer.encode(text_bytes.decode("utf-8"), add_special_tokens=False)
    result: dict[str, Any] = {
        "model": model, "checkpoint": str(llm.engine.model_dir), "dtype": dtype,
        "text": str(text_path), "text_sha256": hashlib.sha256(text_bytes).hexdigest(),
        "num_tokens": len(token_ids), "window": window, "stride": stride,
        "num_windows": len(windows(len(token_ids), window, stride)), "systems": {}}
    ours = treadle_logprobs(llm, token_ids, window, stride)
    result["systems"]["treadle"] = {"perplexity": perplexity(ours), "num_scored": len(ours),
                                    "seconds": time.perf_counter() - start}
    if with_transformers:
        start = time.perf_counter()
        reference, label = load_reference(model, llm.engine.model_dir, dtype)
        theirs = transformers_logprobs(reference, token_ids, window, stride)
        result["systems"]["transformers"] = {
            "perplexity": perplexity(theirs), "num_scored": len(theirs), "loaded": label,
            "seconds": time.perf_counter() - start}
        result["relative_difference"] = (result["systems"]["treadle"]["perplexity"]
                                         / result["systems"]["transformers"]["perplexity"] - 1)
        result["max_abs_logprob_difference"] = float(np.max(np.abs(ours - theirs)))
    return result
