"""The C sampling kernel against exact references: given a row's uniform number it picks the
token of the inverse CDF (in token-id order) of the filtered distribution, on peaked, flat,
tied and masked logits, small and benchmark-sized vocabularies; its logprob statistics
match torch's on the raw logits; it leaves the logits as they were."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from treadle.worker.cpu.cpu_isa import executable_levels
from treadle.worker.cpu.native import load_kernels

LEVELS = executable_levels() or ["native"]  # every kernel ISA level this CPU executes

# (temperature, top_k, top_p, min_p)
CONFIGS = [(1.0, 0, 1.0, 0.0), (0.7, 50, 1.0, 0.0), (0.8, 0, 0.9, 0.0), (1.0, 0, 1.0, 0.05),
           (0.9, 100, 0.95, 0.0), (1.3, 300, 0.8, 0.02), (2.0, 0, 0.5, 0.0), (1.0, 1, 1.0, 0.0),
           (1.0, 7000, 0.99, 0.0), (0.5, 0, 0.3, 0.1), (1.0, 20000, 0.9, 0.0)]


@pytest.fixture(scope="module", params=LEVELS)
def kernels(request):
    k = load_kernels(request.param)
    assert k is not None, "the C kernels must build on the test machine (gcc is required)"
    return k


def reference_weights(x: torch.Tensor, temperature: float, top_k: int, top_p: float,
                      min_p: float) -> torch.Tensor:
    """Unnormalized kept weights (float64; 0 = filtered), by sorting: top-k keeps every
    logit >= the k-th largest; top-p keeps a logit while the strictly larger ones (within
    top-k) weigh less than top_p of the top-k set; min-p keeps weights >= min_p x the best."""
    w = ((x - x.max()) * torch.tensor(1.0 / temperature, dtype=torch.float32)).exp().double()
    keep = torch.ones_like(x, dtype=torch.bool)
    if 0 < top_k < x.numel():
        keep &= x >= x.topk(top_k).values[-1]
    if top_p < 1.0:
        xs, order = x[keep].sort(descending=True, stable=True)
        ws = w[keep][order]
        first = torch.ones_like(xs, dtype=torch.bool)
        first[1:] = xs[1:] != xs[:-1]
        above = ws.cumsum(0) - ws  # at a value's first position: the weight strictly above
        keep &= x >= xs[first & (above < top_p * ws.sum())].min()
    if min_p > 0:
        keep &= w >= min_p
    return torch.where(keep, w, 0.0)


def inverse_cdf(w: torch.Tensor, u: float) -> int:
    cdf = w.cumsum(0)
    return int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64),
                                  right=True)[0])


def sample(kernels, x: torch.Tensor, configs, u: torch.Tensor) -> list[int]:
    """Temperature 0: greedy."""
    return kernels.sample(
        x, torch.tensor([1.0 / c[0] if c[0] else 0.0 for c in configs], dtype=torch.float32),
        torch.tensor([c[1] for c in configs], dtype=torch.int64),
        torch.tensor([c[2] for c in configs], dtype=torch.float64),
        torch.tensor([c[3] for c in configs], dtype=torch.float32), u).tolist()


def test_reference_is_transformers_warpers_without_ties():
    torch.manual_seed(0)
    for temperature, top_k, top_p, min_p in CONFIGS:
        x = torch.randn(3000) * 2
        scores = TemperatureLogitsWarper(temperature)(None, x[None].clone())
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1.0:
            scores = TopPLogitsWarper(top_p)(None, scores)
        if min_p > 0:
            scores = MinPLogitsWarper(min_p)(None, scores)
        ref = reference_weights(x, temperature, top_k, top_p, min_p)
        assert torch.equal(torch.isfinite(scores[0]), ref > 0)
        torch.testing.assert_close(scores[0].softmax(-1).double(), ref / ref.sum(),
                                   atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("vocab, scale, tie_step, masked", [
    (5000, 3.0, None, False), (49152, 3.0, None, False), (49152, 0.05, None, False),
    (49152, 2.0, 0.125, False), (3000, 1.0, 0.5, True), (49152, 1.0, None, True),
], ids=["small-peaked", "peaked", "flat", "tied", "small-tied-masked", "masked"])
def test_kernel_draws_the_inverse_cdf_of_the_filtered_distribution(kernels, vocab, scale,
                                                                  tie_step, masked):
    gen = torch.Generator().manual_seed(vocab + int(scale * 100))
    configs = CONFIGS * 2
    x = torch.randn(len(configs), vocab, generator=gen) * scale
    if tie_step:  # many equal logits, as bf16 models give: cuts fall inside ties
        x = (x / tie_step).round() * tie_step
    if masked:  # min_tokens-style -inf entries
        x[torch.rand(x.shape, generator=gen) < 0.1] = float("-inf")
    u = torch.rand(len(configs), generator=gen, dtype=torch.float64)
    u[0], u[1] = 0.0, 1.0 - 2 ** -53  # the first and the last kept token
    before = x.clone()
    tokens = sample(kernels, x, configs, u)
    assert torch.equal(x, before)
    for row, config in enumerate(configs):
        w = reference_weights(x[row], *config)
        assert tokens[row] == inverse_cdf(w, float(u[row])), f"row {row}: {config}"


def test_greedy_rows_and_the_first_maximum(kernels):
    x = torch.tensor([[0.0, 3.0, 1.0, 3.0], [float("-inf")] * 4, [2.0, 2.0, 2.0, 2.0]])
    tokens = sample(kernels, x, [(0.0, 0, 1.0, 0.0)] * 3, torch.zeros(3, dtype=torch.float64))
    assert tokens == [1, 0, 0]


def test_logprob_statistics_match_torch(kernels):
    torch.manual_seed(7)
    x = torch.randn(6, 49152) * 3
    x[2] = (x[2] * 2).round() / 2  # ties: rank counts every token at least as likely
    x[3, :100] = float("-inf")
    rows = torch.tensor([0, 2, 3, 5])
    tokens = torch.tensor([5, 17, 40000, int(x[5].argmax())])
    stats = kernels.logprobs(x, rows, tokens, 7)
    for j, r in enumerate(rows.tolist()):
        row = x[r]
        assert float(stats.lse[j]) == pytest.approx(float(row.double().logsumexp(0)), abs=1e-5)
        assert int(stats.ranks[j]) == int((row >= row[tokens[j]]).sum())
        # Descending, ties broken by the lower id: a stable sort of the negated row.
        order = (-row).sort(stable=True).indices[:7]
        assert stats.top_ids[j].tolist() == order.tolist()
        assert torch.equal(stats.top_values[j], row[order])
