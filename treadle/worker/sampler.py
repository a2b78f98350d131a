"""Batched sampling of the next token from each request's logits.

One vectorized pass over the batch, each row with its own temperature, top-k and top-p;
an all-greedy batch takes an argmax fast path. Randomness comes from per-request
generators for seeded requests (reproducible whatever else is in the batch) and from the
engine's generator otherwise. The sampler holds no request state beyond those generators.
"""

from __future__ import annotations

import torch

from treadle.sampling_params import SamplingParams


class Sampler:
    """Chooses one token per row of logits."""

    def __init__(self, seed: int) -> None:
        self._generator = torch.Generator().manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}

    def drop(self, request_ids: set[str]) -> None:
        """Forget the generators of requests that have ended."""
        for request_id in request_ids:
            self._request_generators.pop(request_id, None)

    def _generator_for(self, request_id: str, seed: int) -> torch.Generator:
        generator = self._request_generators.get(request_id)
        if generator is None:
            generator = torch.Generator().manual_seed(seed)
            self._request_generators[request_id] = generator
        return generator

    def sample(self, logits: torch.Tensor, request_ids: list[str],
               params: list[SamplingParams]) -> list[int]:
        """logits: [num_requests, vocab] float32. Returns one token id per row."""
        greedy = [p.is_greedy for p in params]
        if all(greedy):
            return logits.argmax(dim=-1).tolist()

        temperatures = torch.tensor([1.0 if g else p.temperature for g, p in zip(greedy, params)],
                                    dtype=logits.dtype)
        scaled = logits / temperatures.unsqueeze(1)
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            scaled = _apply_top_k_top_p(scaled, params)
        probs = torch.softmax(scaled, dim=-1)

        # Exponential race: argmax(p / E) with E ~ Exp(1) draws a token with probability p.
        noise = torch.empty_like(probs)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            rows = torch.empty(len(unseeded), probs.shape[1], dtype=probs.dtype)
            rows.exponential_(generator=self._generator)
            noise[unseeded] = rows
        for i, p in enumerate(params):
            if p.seed is not None:
                noise[i].exponential_(generator=self._generator_for(request_ids[i], p.seed))
        sampled = (probs / noise).argmax(dim=-1)
        if any(greedy):
            sampled = torch.where(torch.tensor(greedy), logits.argmax(dim=-1), sampled)
        return sampled.tolist()


def _apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask to -inf every token outside each row's top-k and top-p nucleus."""
    vocab = logits.shape[1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params])
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab).unsqueeze(0)
    remove = ranks >= top_k.unsqueeze(1)
    probs = torch.softmax(sorted_logits, dim=-1)
    # Remove a token when the tokens ranked above it already reach top_p (keeps >= 1).
    mass_before = probs.cumsum(dim=-1) - probs
    remove |= mass_before >= top_p.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
