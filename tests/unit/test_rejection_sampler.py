"""Verification of proposed tokens (worker/spec/rejection.py) keeps the target's
distribution exactly: chi-square tests of the tokens kept at each position against the
sampler's processed distribution p, under temperature, top-k, top-p, min-p and
penalties, for sampled proposals (q a draft's distribution: Leviathan/Chen acceptance)
and for deterministic ones (q one-hot: the coupled path); plus `Sampler.probs` against
the reference filter, greedy and seeded behaviour, and target logprobs. Both sampler
paths (torch and the C kernel)."""

from __future__ import annotations

import math

import pytest
import torch

from treadle.sampling_params import SamplingParams
from treadle.worker.cpu.native import load_kernels
from treadle.worker.cpu.native_sampling import NativeSampling
from treadle.worker.sampler import Sampler
from treadle.worker.spec.rejection import RejectionSampler, SampleRow

VOCAB = 40


@pytest.fixture(params=["torch", "native"])
def kernels(request):
    if request.param == "torch":
        return None
    k = load_kernels()
    assert k is not None, "the C kernels must build on the test machine (gcc is required)"
    return NativeSampling(k)


def chi_square_bound(dof: int, z: float = 3.72) -> float:
    """Upper 0.01% point of chi-square with `dof` degrees of freedom (Wilson-Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def chi_square(tokens: list[int], expected: torch.Tensor) -> tuple[float, int]:
    """Statistic and degrees of freedom; bins expected under 5 are pooled."""
    n = len(tokens)
    counts = torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=VOCAB).double()
    expected = expected.double()
    assert (counts[expected == 0] == 0).all(), "a token outside the target's support"
    big = expected * n >= 5
    observed = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)]) * n
    keep = exp > 0
    stat = float(((observed[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=8),
    SamplingParams(temperature=1.2, top_p=0.8),
    SamplingParams(temperature=0.9, top_k=12, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=1.0, frequency_penalty=1.5, presence_penalty=0.5,
                   repetition_penalty=1.3),
]
IDS = ["t1", "t0.7-topk", "topp", "topk-topp-minp", "penalties"]


def target_logits(seed: int, positions: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(positions, VOCAB, generator=gen) * 1.7


def draft_probs(seed: int, positions: int) -> torch.Tensor:
    """A draft distribution unlike the target's (and zero on some tokens)."""
    gen = torch.Generator().manual_seed(seed + 100)
    q = torch.softmax(torch.randn(positions, VOCAB, generator=gen) * 2.0, dim=-1)
    q[:, :3] = 0.0
    return q / q.sum(dim=-1, keepdim=True)


def run_batch(kernels, params, prompt, num_requests, k, sampled: bool, seed=0):
    """num_requests requests with the same logits at k + 1 positions; proposals drawn
    from q (sampled) or fixed (deterministic). Returns kept tokens per request and the
    target distributions the kept tokens should follow."""
    logits = target_logits(seed, k + 1)
    q = draft_probs(seed, k)
    gen = torch.Generator().manual_seed(seed + 7)
    rows, stacked, props = [], [], {}
    for n in range(num_requests):
        rid = f"r{n}"
        if sampled:
            spec = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(k)]
        else:
            spec = [5 + j for j in range(k)]
        props[rid] = spec
        for j in range(k + 1):
            rows.append(SampleRow(rid, params, prompt, list(spec[:j]), j, spec))
            stacked.append(logits[j])
    sampler = Sampler(seed + 11, kernels)
    verify = RejectionSampler(sampler, eos_token_id=None)
    tokens, _ = verify(torch.stack(stacked), rows, lambda rid: q if sampled else None)
    return tokens, logits, props, sampler


@pytest.mark.parametrize("params", PARAMS, ids=IDS)
@pytest.mark.parametrize("sampled", [True, False], ids=["draft-q", "one-hot-q"])
def test_first_kept_token_follows_the_target(params, sampled, kernels):
    prompt = [1, 2, 5]
    tokens, logits, _, sampler = run_batch(kernels, params, prompt, 3000, 2, sampled)
    p0 = sampler.probs(logits[:1].clone(), [params], [prompt], [[]])[0]
    stat, dof = chi_square([t[0] for t in tokens.values()], p0)
    assert stat < chi_square_bound(dof), (stat, dof)


@pytest.mark.parametrize("params", PARAMS[:4], ids=IDS[:4])
def test_second_token_after_an_accepted_proposal_follows_the_target(params, kernels):
    # Given that the first proposal was kept, the second token is p_1's (position 1 sees
    # the first proposal as generated: the penalty-free params make p_1 not depend on it).
    prompt = [1, 2, 5]
    tokens, logits, props, sampler = run_batch(kernels, params, prompt, 5000, 2, True, seed=3)
    seconds = [t[1] for rid, t in tokens.items() if len(t) >= 2]
    assert all(t[0] == props[rid][0] for rid, t in tokens.items() if len(t) >= 2)
    assert len(seconds) > 200
    p1 = sampler.probs(logits[1:2].clone(), [params], [prompt], [[0]])[0]
    stat, dof = chi_square(seconds, p1)
    assert stat < chi_square_bound(dof), (stat, dof)


def test_acceptance_is_sum_of_min_p_q(kernels):
    """P(first proposal accepted) = sum_x min(p(x), q(x)) (Leviathan et al., eq. 1)."""
    params = SamplingParams(temperature=1.0, top_k=10)
    tokens, logits, props, sampler = run_batch(kernels, params, [1], 5000, 1, True, seed=5)
    p0 = sampler.probs(logits[:1].clone(), [params], [[1]], [[]])[0]
    q0 = draft_probs(5, 1)[0]
    expected = float(torch.minimum(p0, q0).sum())
    observed = sum(len(t) == 2 for t in tokens.values()) / len(tokens)
    sd = math.sqrt(expected * (1 - expected) / len(tokens))
    assert abs(observed - expected) < 5 * sd, (observed, expected)


@pytest.mark.parametrize("params", PARAMS, ids=IDS)
def test_probs_is_the_distribution_sample_draws_from(params, kernels):
    logits = target_logits(9, 4)
    outputs = [[], [3], [3, 3], [7, 1]]
    probs = Sampler(0, kernels).probs(logits.clone(), [params] * 4, [[1, 2]] * 4, outputs)
    ref = Sampler(0).processed_logits(logits.clone(), [params] * 4, [[1, 2]] * 4,
                                      outputs).softmax(-1)
    assert torch.allclose(probs, ref, atol=2e-6), (probs - ref).abs().max()


def test_greedy_verification_keeps_the_argmax_prefix(kernels):
    logits = target_logits(2, 4)
    best = logits.argmax(dim=-1).tolist()
    params = SamplingParams(temperature=0.0)
    spec = [best[0], best[1], (best[2] + 1) % VOCAB]
    rows = [SampleRow("g", params, [1], list(spec[:j]), j, spec) for j in range(4)]
    verify = RejectionSampler(Sampler(0, kernels), None)
    tokens, _ = verify(logits.clone(), rows, lambda rid: draft_probs(2, 3))
    assert tokens == {"g": [best[0], best[1], best[2]]}


def test_greedy_from_argmaxes_is_what_verification_keeps(kernels):
    """RejectionSampler.greedy (a step whose LM head gave argmaxes, no logits) keeps what
    verifying the logits keeps: requests with and without proposals, in any order, a
    proposal refused at the first, a middle or no position."""
    logits = target_logits(9, 9)
    best = logits.argmax(dim=-1).tolist()
    params = SamplingParams(temperature=0.0)
    wrong = lambda t: (t + 1) % VOCAB  # noqa: E731
    requests = {"none": [], "first": [wrong(best[1])],
                "middle": [best[3], wrong(best[4])], "all": [best[6], best[7]]}
    rows, start = [], {"none": 0, "first": 1, "middle": 3, "all": 6}
    for rid in ("middle", "none", "all", "first"):
        spec = requests[rid]
        rows += [SampleRow(rid, params, [1], list(spec[:j]), j, spec)
                 for j in range(len(spec) + 1)]
    order = [start[r.request_id] + r.position for r in rows]
    tokens, _ = RejectionSampler(Sampler(0, kernels), None)(
        logits[order].clone(), rows, lambda rid: None)
    assert RejectionSampler.greedy(rows, [best[i] for i in order]) == tokens
    assert tokens == {"none": [best[0]], "first": [best[1]], "middle": best[3:5],
                      "all": best[6:9]}


def test_plain_argmax_covers_only_what_leaves_logits_alone():
    from treadle.worker.sampler import takes_plain_argmax

    assert takes_plain_argmax(SamplingParams(temperature=0.0), 0)
    assert takes_plain_argmax(SamplingParams(temperature=0.0, seed=3, top_k=5, top_p=0.5,
                                             stop_token_ids=[2], ignore_eos=True), 0)
    assert takes_plain_argmax(SamplingParams(temperature=0.0, min_tokens=2), 2)
    for params, outputs in [
            (SamplingParams(temperature=1.0), 0),
            (SamplingParams(temperature=0.0, logprobs=0), 0),
            (SamplingParams(temperature=0.0, logit_bias={3: 1.0}), 0),
            (SamplingParams(temperature=0.0, min_tokens=2), 1),
            (SamplingParams(temperature=0.0, repetition_penalty=1.1), 0),
            (SamplingParams(temperature=0.0, presence_penalty=0.5), 0),
            (SamplingParams(temperature=0.0, frequency_penalty=0.5), 0)]:
        assert not takes_plain_argmax(params, outputs), params


def test_seeded_request_draws_what_it_would_without_proposals():
    """The coupled path puts a seeded request's generator back: after the tokens kept,
    the next draw is the one sampling without speculation would make."""
    built = load_kernels()
    kernels = None if built is None else NativeSampling(built)
    params = SamplingParams(temperature=1.0, seed=42)
    logits = target_logits(4, 3)
    plain = Sampler(0, kernels)
    first = plain.sample(logits[:1].clone(), ["s"], [params]).token_ids[0]
    spec = [first, (first + 1) % VOCAB]  # the first is kept, the second is not
    sampler = Sampler(0, kernels)
    rows = [SampleRow("s", params, [], list(spec[:j]), j, spec) for j in range(3)]
    tokens, _ = RejectionSampler(sampler, None)(logits.clone(), rows, lambda rid: None)
    kept = tokens["s"]
    assert kept[0] == first
    second = plain.sample(logits[1:2].clone(), ["s"], [params]).token_ids[0]
    assert kept[1] == second
    # Both generators are now at the same place.
    assert (sampler.sample(logits[2:].clone(), ["s"], [params]).token_ids
            == plain.sample(logits[2:].clone(), ["s"], [params]).token_ids)


@pytest.mark.parametrize("sampled", [True, False])
def test_logprobs_are_the_target_s(sampled, kernels):
    params = SamplingParams(temperature=1.0, logprobs=3)
    logits = target_logits(8, 3)
    q = draft_probs(8, 2)
    spec = [6, 9]
    rows = [SampleRow("a", params, [1], list(spec[:j]), j, spec) for j in range(3)]
    verify = RejectionSampler(Sampler(3, kernels), None)
    tokens, logprobs = verify(logits.clone(), rows, lambda rid: q if sampled else None)
    assert len(logprobs["a"]) == len(tokens["a"])
    raw = torch.log_softmax(logits.double(), dim=-1)
    for j, (token, entry) in enumerate(zip(tokens["a"], logprobs["a"])):
        assert entry.token_ids[0] == token
        assert entry.logprobs[0] == pytest.approx(float(raw[j, token]), abs=1e-5)
        assert entry.token_ids[1] == int(logits[j].argmax())
