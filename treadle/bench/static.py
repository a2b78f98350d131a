"""Static-batching baseline (the pre-Orca way): Hugging Face `generate` in fixed batches.

Owns `run_static`: requests are cut IN ORDER into batches of `batch_size`, prompts are
left-padded, and every sequence of a batch runs to the batch's longest output (EOS is
suppressed with min_new_tokens == max_new_tokens) — the padding cost continuous batching
removes. Counts useful vs generated tokens, wall time and throughput.
Must not: import treadle's engine, sample (greedy only), or stop a sequence early.
"""

from __future__ import annotations

import math
import time

import torch

from treadle.measure.peak import torch_dtype
from treadle.measure.workloads import Workload, WorkloadRequest, check_token_ids


def _dtype_kwarg() -> str:
    """transformers >= 4.56 takes `dtype=`; older versions only `torch_dtype=`."""
    import transformers

    parts = transformers.__version__.split(".")
    major, minor = int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def load_model(model_path: str, dtype: str = "bfloat16", device: str = "cpu"):
    """The checkpoint as a transformers AutoModelForCausalLM in eval mode, on `device`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, **{_dtype_kwarg(): torch_dtype(dtype)})
    return model.to(device).eval()


def pad_token_id(model) -> int:
    """The model's EOS id (first, if several) used as padding, else 0."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return int(eos) if eos is not None else 0


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), prompts right-aligned with `pad_id` on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


@torch.inference_mode()
def generate_batch(model, prompts: list[list[int]], max_new_tokens: int,
                   pad_id: int | None = None) -> torch.Tensor:
    """Greedy-generate exactly `max_new_tokens` for every prompt (EOS ignored);
    returns the new tokens, shape (len(prompts), max_new_tokens)."""
    pad_id = pad_token_id(model) if pad_id is None else pad_id
    ids, mask = left_pad(prompts, pad_id)
    ids, mask = ids.to(model.device), mask.to(model.device)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                         max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                         pad_token_id=pad_id)
    new = out[:, ids.shape[1]:]
    if tuple(new.shape) != (len(prompts), max_new_tokens):
        raise RuntimeError(f"generate returned {tuple(new.shape)} new tokens, expected "
                           f"{(len(prompts), max_new_tokens)}: EOS was not ignored")
    return new.cpu()  # on a GPU, waits for the batch to finish


def batches_in_order(requests: list[WorkloadRequest], batch_size: int) -> list[list[WorkloadRequest]]:
    """Consecutive fixed batches (the last one may be smaller)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]


def _rate(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else math.nan


def run_static(model_path: str, workload: Workload, batch_size: int = 16, dtype: str = "bfloat16",
               num_threads: int | None = None, progress: bool = True, warmup: bool = True,
               device: str = "cpu") -> dict:
    """Run `workload` through transformers `generate` in fixed, padded batches.

    Arrival times are ignored (all requests are available at once: an offline run). A
    token id outside the model's vocabulary is a ValueError before anything runs.
    Returns configuration, counts, wall time, throughputs (output tokens/s counts only the
    tokens requests asked for) and per-batch figures, including the gain continuous
    batching predicts for each batch (its longest output over its mean output).
    """
    if not workload.requests:
        raise ValueError("workload has no requests")
    from tqdm.auto import tqdm

    old_threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        start = time.perf_counter()
        model = load_model(model_path, dtype, device)
        load_s = time.perf_counter() - start
        check_token_ids(workload, model.get_input_embeddings().num_embeddings)
        pad_id = pad_token_id(model)
        num_params = sum(p.numel() for p in model.parameters())
        if warmup:  # first-call overheads (allocator, kernels) are not part of the baseline
            generate_batch(model, [workload.requests[0].prompt_token_ids[:8]], 2, pad_id)
        batches = batches_in_order(workload.requests, batch_size)
        per_batch = []
        run_start = time.perf_counter()
        for index, batch in enumerate(tqdm(batches, desc="static batches", unit="batch",
                                           disable=not progress)):
            lengths = [r.max_tokens for r in batch]
            max_new = max(lengths)
            t0 = time.perf_counter()
            generate_batch(model, [r.prompt_token_ids for r in batch], max_new, pad_id)
            wall = time.perf_counter() - t0
            prompt_lens = [len(r.prompt_token_ids) for r in batch]
            per_batch.append({
                "index": index, "num_requests": len(batch), "max_new_tokens": max_new,
                "mean_output_len": sum(lengths) / len(batch),
                "predicted_continuous_gain": max_new / (sum(lengths) / len(batch)),
                "useful_output_tokens": sum(lengths), "generated_tokens": len(batch) * max_new,
                "prompt_tokens": sum(prompt_lens), "padded_prompt_tokens": len(batch) * max(prompt_lens),
                "wall_s": wall, "useful_output_tokens_per_s": _rate(sum(lengths), wall),
            })
        wall_s = time.perf_counter() - run_start
        threads_used = torch.get_num_threads()
    finally:
        torch.set_num_threads(old_threads)

    useful = sum(b["useful_output_tokens"] for b in per_batch)
    generated = sum(b["generated_tokens"] for b in per_batch)
    prompt = sum(b["prompt_tokens"] for b in per_batch)
    padded_prompt = sum(b["padded_prompt_tokens"] for b in per_batch)
    return {
        "system": "transformers-static",
        "model_path": str(model_path), "dtype": dtype, "batch_size": batch_size, "device": device,
        "num_threads": threads_used, "num_params": num_params, "pad_token_id": pad_id,
        "workload": workload.name, "workload_description": workload.description,
        "num_requests": len(workload.requests), "num_batches": len(per_batch),
        "load_s": load_s, "wall_s": wall_s,
        "prompt_tokens": prompt, "padded_prompt_tokens": padded_prompt,
        "useful_output_tokens": useful, "generated_tokens": generated,
        "wasted_output_tokens": generated - useful,
        "output_efficiency": useful / generated,
        "output_tokens_per_s": _rate(useful, wall_s),
        "generated_tokens_per_s": _rate(generated, wall_s),
        "total_tokens_per_s": _rate(prompt + useful, wall_s),
        "requests_per_s": _rate(len(workload.requests), wall_s),
        "predicted_continuous_gain": generated / useful,
        "mean_batch_predicted_gain": sum(b["predicted_continuous_gain"] for b in per_batch) / len(per_batch),
        "per_batch": per_batch,
    }
