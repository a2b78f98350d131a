"""The batched sampler: filters and penalties match transformers' logits processors,
sampling follows the filtered distribution (chi-square), seeds are independent of the
batch, and logprobs come from the raw logits. Sampling tests run on both paths: the torch
fallback and the C kernel (which must build where gcc is available)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from treadle.sampling_params import SamplingParams
from treadle.worker.cpu.cpu_isa import executable_levels
from treadle.worker.cpu.native import load_kernels
from treadle.worker.cpu.native_sampling import NativeSampling
from treadle.worker.sampler import Sampler, prompt_logprobs


@pytest.fixture(params=["torch", *(executable_levels() or ["native"])])
def kernels(request):
    """None (the torch path) or the C kernels of one ISA level this CPU executes (the
    sampler's kernel path)."""
    if request.param == "torch":
        return None
    k = load_kernels(request.param)
    assert k is not None, "the C kernels must build on the test machine (gcc is required)"
    return NativeSampling(k)


def reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """transformers' warpers, in vLLM's order: temperature, top-k, top-p, min-p."""
    scores = logits.unsqueeze(0).clone()
    ids = torch.zeros((1, 1), dtype=torch.long)
    scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
    if p.top_k:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    if p.min_p > 0:
        scores = MinPLogitsWarper(p.min_p)(ids, scores)
    return scores[0]


MIXED = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=7),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, top_p=0.95, top_k=300),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.5, top_k=50, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=2.0, top_p=0.5),
    SamplingParams(temperature=1.0, top_k=1),
]


@pytest.mark.parametrize("scale", [4.0, 0.3], ids=["peaked", "flat"])
def test_filters_match_transformers_warpers(scale):
    # "flat" makes the top-p nucleus far wider than the first candidate set: the sampler
    # must widen it (up to the whole vocabulary) and still agree.
    torch.manual_seed(0)
    logits = torch.randn(len(MIXED), 5000) * scale
    ours = Sampler(0).processed_logits(logits, MIXED)
    for row, p in enumerate(MIXED):
        ref = reference(logits[row], p)
        assert torch.equal(torch.isfinite(ours[row]), torch.isfinite(ref)), f"row {row}: {p}"
        torch.testing.assert_close(ours[row].softmax(-1), ref.softmax(-1), atol=1e-6, rtol=1e-5)
    if scale < 1:
        assert torch.isfinite(ours[6]).sum() > 128  # the nucleus did not fit the first 128


def test_repetition_penalty_matches_transformers():
    torch.manual_seed(1)
    logits = torch.randn(3, 300) * 3
    prompts = [[5, 6, 7, 7, 250], [1, 2, 3], [9]]
    outputs = [[6, 8, 8, 299], [], [9, 10]]
    params = [SamplingParams(temperature=0, repetition_penalty=1.3),
              SamplingParams(temperature=0, repetition_penalty=0.7),
              SamplingParams(temperature=0)]
    ours = Sampler(0).processed_logits(logits, params, prompts, outputs)
    for row, p in enumerate(params):
        ids = torch.tensor([prompts[row] + outputs[row]])
        ref = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, logits[row:row + 1])
        torch.testing.assert_close(ours[row], ref[0])


def test_presence_and_frequency_penalties_follow_openai():
    logits = torch.zeros(2, 20)
    outputs = [[3, 3, 3, 4], [5]]
    prompts = [[6, 6], [7]]  # the prompt does not count for these two
    params = [SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams(temperature=0, presence_penalty=-1.0)]
    ours = Sampler(0).processed_logits(logits, params, prompts, outputs)
    expected = torch.zeros(2, 20)
    expected[0, 3] = -(0.5 + 3 * 0.25)
    expected[0, 4] = -(0.5 + 0.25)
    expected[1, 5] = 1.0
    torch.testing.assert_close(ours, expected)


def test_logit_bias_and_min_tokens(kernels):
    logits = torch.zeros(3, 10)
    params = [SamplingParams(temperature=0, logit_bias={4: 5.0, 9: -100}),
              SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[7]),
              SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[7])]
    outputs = [[], [1, 1], [1, 1, 1]]
    ours = Sampler(0).processed_logits(logits, params, None, outputs, eos_token_id=2)
    assert ours[0, 4] == 5.0 and ours[0, 9] == -100.0
    assert ours[1, 2] == -math.inf and ours[1, 7] == -math.inf  # 2 tokens < min_tokens
    assert torch.isfinite(ours[2]).all()                       # 3 tokens: free to stop
    out = Sampler(0, kernels).sample(logits.clone(), ["a", "b", "c"], params, None, outputs, 2)
    assert out.token_ids[0] == 4
    assert out.token_ids[1] not in (2, 7)


def test_greedy_rows_take_the_argmax_of_adjusted_logits(kernels):
    torch.manual_seed(2)
    logits = torch.randn(4, 100)
    top = logits.argmax(-1)
    params = [SamplingParams(temperature=0),
              SamplingParams(temperature=0, logit_bias={int(top[1]): -100.0}),
              SamplingParams(temperature=1.0, seed=3),
              SamplingParams(temperature=0, top_k=3)]
    out = Sampler(0, kernels).sample(logits.clone(), list("abcd"), params)
    assert out.token_ids[0] == top[0] and out.token_ids[3] == top[3]
    assert out.token_ids[1] == logits[1].topk(2).indices[1]
    assert Sampler(0, kernels).sample(logits.clone(), list("abcd"),
                                      [SamplingParams(temperature=0)] * 4
                                      ).token_ids == top.tolist()


def _chi_square_bound(dof: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square with `dof` degrees of freedom (Wilson-Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.0, top_k=6),
    SamplingParams(temperature=1.2, top_p=0.7),
    SamplingParams(temperature=1.0, min_p=0.1),
], ids=["t1", "t0.6", "topk6", "topp0.7", "minp0.1"])
def test_empirical_frequencies_match_the_distribution(params, kernels):
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(40, generator=gen) * 1.5
    expected = Sampler(0).processed_logits(logits[None], [params])[0].softmax(-1)
    num_draws = 20000
    out = Sampler(1234, kernels).sample(logits.expand(num_draws, -1).clone(),
                               [str(i) for i in range(num_draws)], [params] * num_draws)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=40).double()
    assert (counts[expected == 0] == 0).all()  # nothing outside the filtered set
    support = expected > 0
    exp_counts = expected[support].double() * num_draws
    chi2 = float(((counts[support] - exp_counts) ** 2 / exp_counts).sum())
    assert chi2 < _chi_square_bound(int(support.sum()) - 1), chi2


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_p=0.8),
    SamplingParams(temperature=1.0, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=1.0, top_k=300, top_p=0.95),
], ids=["t1", "topp0.8", "topp-minp", "topk-topp"])
def test_frequencies_over_a_large_vocabulary(params, kernels):
    # 5000 ids: the two-level inverse CDF (block sums) and top-p rejection rounds. Tokens
    # expected fewer than 5 times are pooled into one bin.
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(5000, generator=gen) * 2.5
    expected = Sampler(0).processed_logits(logits[None], [params])[0].softmax(-1).double()
    num_draws, sampler, tokens = 12000, Sampler(77, kernels), []
    for _ in range(6):
        tokens += sampler.sample(logits.expand(2000, -1).clone(), ["x"] * 2000,
                                 [params] * 2000).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=5000).double()
    assert (counts[expected == 0] == 0).all()
    big = expected * num_draws >= 5
    observed = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp_counts = torch.cat([expected[big], expected[~big].sum().view(1)]) * num_draws
    keep = exp_counts > 0
    chi2 = float(((observed[keep] - exp_counts[keep]) ** 2 / exp_counts[keep]).sum())
    assert chi2 < _chi_square_bound(int(keep.sum()) - 1), chi2


def test_seeded_rows_do_not_depend_on_the_batch(kernels):
    torch.manual_seed(3)
    steps = [torch.randn(1, 500) * 2 for _ in range(12)]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=77)
    alone, crowded = Sampler(0, kernels), Sampler(99, kernels)
    a, b = [], []
    for i, row in enumerate(steps):
        a += alone.sample(row.clone(), ["r"], [seeded]).token_ids
        # Other rows before and after it, with their own (unseeded, seeded) parameters.
        pos, num_others = i % 3, 2 + i % 4
        others = torch.randn(num_others, 500)
        batch = torch.cat([others[:pos], row, others[pos:]])
        params = [SamplingParams(temperature=0.8, top_k=5 * (j + 1), seed=j if j % 2 else None)
                  for j in range(num_others + 1)]
        params[pos] = seeded
        ids = [f"other{j}" for j in range(num_others + 1)]
        ids[pos] = "r"
        b.append(crowded.sample(batch, ids, params).token_ids[pos])
    assert a == b
    other_seed = Sampler(0, kernels)
    c = [other_seed.sample(r.clone(), ["r"], [SamplingParams(temperature=1.0, top_p=0.9,
                                                             seed=78)]).token_ids[0]
         for r in steps]
    assert c != a


def test_logprobs_come_from_the_raw_logits(kernels):
    torch.manual_seed(4)
    logits = torch.randn(3, 200) * 2
    raw = logits.log_softmax(-1)
    params = [SamplingParams(temperature=0.5, top_k=3, logprobs=5, presence_penalty=2.0),
              SamplingParams(temperature=0, logprobs=0),
              SamplingParams(temperature=1.0)]
    out = Sampler(0, kernels).sample(logits.clone(), list("abc"), params, None,
                                     [[7, 8], [], []])
    first, second, third = out.logprobs
    assert third is None
    assert first.token_ids[0] == out.token_ids[0]
    assert first.logprobs[0] == pytest.approx(float(raw[0, out.token_ids[0]]), abs=1e-6)
    assert first.ranks[0] == int((raw[0] >= raw[0, out.token_ids[0]]).sum())
    top = raw[0].topk(5)
    assert first.token_ids[1:] == top.indices.tolist() and first.ranks[1:] == [1, 2, 3, 4, 5]
    torch.testing.assert_close(torch.tensor(first.logprobs[1:]), top.values)
    assert second.token_ids == [int(raw[1].argmax())] and second.ranks == [1]


def test_prompt_logprobs_score_each_next_token():
    torch.manual_seed(5)
    logits = torch.randn(600, 50)
    targets = torch.randint(0, 50, (600,)).tolist()
    raw = logits.log_softmax(-1)
    entries = prompt_logprobs(logits.clone(), targets, 2, max_rows=256)
    assert len(entries) == 600
    for j in (0, 255, 256, 599):
        assert entries[j].token_ids[0] == targets[j]
        assert entries[j].logprobs[0] == pytest.approx(float(raw[j, targets[j]]), abs=1e-6)
        assert entries[j].token_ids[1:] == raw[j].topk(2).indices.tolist()


def test_inverse_cdf_never_picks_a_zero_weight_entry_when_rounding_reaches_the_end():
    from treadle.worker.sampler import _block_inverse_cdf, _inverse_cdf

    w = torch.zeros(3, 4000)
    w[0, 10], w[0, 20] = 1.0, 2.0  # the last 3979 entries weigh nothing
    w[1, 3999] = 1.0
    w[2, 1500:1600] = 1.0  # a kept run inside one block of the two-level walk
    u = torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64)  # u * total == total
    pick, total = _block_inverse_cdf(w, u)
    assert pick.tolist() == [20, 3999, 1599] and total.tolist() == [3.0, 1.0, 100.0]
    assert _inverse_cdf(w[:1, :30], u[:1])[0].tolist() == [20]
    # u = 0 takes the first kept entry, never a zero-weight one before it
    assert _block_inverse_cdf(w, torch.zeros(3, dtype=torch.float64))[0].tolist() == \
        [10, 3999, 1500]


# ----- no sampling parameter can take the engine down --------------------------------------

VOCAB_FUZZ = 97


def _params(draw, st):
    max_tokens = draw(st.integers(1, 64))
    bias = draw(st.one_of(st.none(), st.dictionaries(
        st.integers(0, VOCAB_FUZZ - 1), st.floats(-100, 100), max_size=8)))
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=draw(st.one_of(st.just(0.0), st.floats(0.0, 100.0))),
        top_p=draw(st.floats(1e-9, 1.0)), top_k=draw(st.integers(0, 10**6)),
        min_p=draw(st.floats(0.0, 1.0)),
        repetition_penalty=draw(st.floats(1e-6, 100.0)),
        presence_penalty=draw(st.floats(-2.0, 2.0)),
        frequency_penalty=draw(st.floats(-2.0, 2.0)),
        seed=draw(st.one_of(st.none(), st.integers(0, 2**63 - 1))),
        min_tokens=draw(st.integers(0, max_tokens)),
        logprobs=draw(st.one_of(st.none(), st.integers(0, 20))),
        logit_bias=bias)


def test_every_valid_sampling_parameter_samples_a_token_in_the_vocabulary(kernels):
    """Whatever SamplingParams' validation lets through (the one check every door uses),
    the sampler draws a token of the vocabulary for every row and never raises: a request
    cannot take the engine down through its sampling parameters."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @st.composite
    def rows(draw):
        num = draw(st.integers(1, 6))
        params = [_params(draw, st) for _ in range(num)]
        scale = draw(st.sampled_from([1e-3, 1.0, 30.0, 1e4]))
        prompts = [draw(st.lists(st.integers(0, VOCAB_FUZZ - 1), min_size=1, max_size=8))
                   for _ in range(num)]
        outputs = [draw(st.lists(st.integers(0, VOCAB_FUZZ - 1), max_size=8))
                   for _ in range(num)]
        return params, scale, prompts, outputs, draw(st.integers(0, 2**31))

    @settings(max_examples=60, deadline=None)
    @given(rows())
    def check(case):
        params, scale, prompts, outputs, seed = case
        logits = torch.randn(len(params), VOCAB_FUZZ,
                             generator=torch.Generator().manual_seed(seed)) * scale
        sampler = Sampler(seed, kernels=kernels)
        ids = [f"r{i}" for i in range(len(params))]
        out = sampler.sample(logits, ids, params, prompts, outputs, eos_token_id=1)
        assert len(out.token_ids) == len(params)
        assert all(0 <= t < VOCAB_FUZZ for t in out.token_ids)
        for p, lp in zip(params, out.logprobs):
            assert (lp is None) == (p.logprobs is None)

    check()
