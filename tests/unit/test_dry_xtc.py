"""DRY and XTC (llama.cpp's samplers) against a reference written here in plain Python
over the token history, on both sampler paths (torch and the C kernel): the adjusted
logits, llama.cpp's own test cases (tests/test-sampling.cpp: its expected
probabilities), and the distribution the sampler draws from (chi-square). Also
allowed_token_ids and bad_words, which adjust the same logits."""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers.generation.logits_process import (TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from treadle.sampling_params import SamplingParams, TokenizedWords
from treadle.worker.cpu.cpu_isa import executable_levels
from treadle.worker.cpu.native import load_kernels
from treadle.worker.cpu.native_sampling import NativeSampling
from treadle.worker.sampler import Sampler, takes_plain_argmax
from treadle.worker.xtc import exclude_top_choices


@pytest.fixture(params=["torch", *(executable_levels() or ["native"])])
def kernels(request):
    if request.param == "torch":
        return None
    k = load_kernels(request.param)
    assert k is not None, "the C kernels must build on the test machine (gcc is required)"
    return NativeSampling(k)


# ----- the reference: llama.cpp's DRY, written from its description ---------------------

def reference_dry(history: list[int], p: SamplingParams) -> dict[int, float]:
    """Token -> penalty, by the definitions (quadratic, no cleverness)."""
    breakers = p.tokenized.dry_breakers if p.tokenized is not None else {}
    if p.dry_penalty_last_n is not None:
        history = history[len(history) - min(len(history), p.dry_penalty_last_n):]
    n, allowed = len(history), p.dry_allowed_length
    if p.dry_multiplier == 0 or p.dry_penalty_last_n == 0 or n <= allowed:
        return {}
    cap = n
    for back in range(n):  # the last breaker: its head `back` tokens from the end
        head = history[n - 1 - back]
        matches = [len(t) for t in breakers.get(head, ())
                   if len(t) <= back and history[n - back:n - back + len(t)] == list(t)]
        if matches:
            cap = back - max(matches)
            break
    if cap < allowed:
        return {}
    longest: dict[int, int] = {}
    for end in range(n - 1):  # a run ending at `end` equal to the run ending at the last
        length = 0
        while (length < cap and end - length >= 0
               and history[end - length] == history[n - 1 - length]):
            length += 1
        if length >= allowed:
            following = history[end + 1]
            longest[following] = max(longest.get(following, 0), length)
    out = {}
    for token, length in longest.items():
        if () in breakers.get(token, ()):
            continue
        exponent = length - allowed
        if p.dry_base > 1.000001:
            exponent = min(exponent, int(88.7228391 / math.log(p.dry_base)))
        out[token] = p.dry_multiplier * p.dry_base ** exponent
    return out


def dry(mult=0.8, base=1.75, allowed=2, last_n=None, breakers=None, **kw) -> SamplingParams:
    return SamplingParams(dry_multiplier=mult, dry_base=base, dry_allowed_length=allowed,
                          dry_penalty_last_n=last_n,
                          tokenized=TokenizedWords((), breakers or {}), **kw)


# llama.cpp's tests/test-sampling.cpp test_dry cases: (probabilities, history, expected
# probabilities, multiplier, base, allowed length, last n, single-token breakers).
LLAMA_CPP_DRY = [
    ([0.25] * 4, [0, 1], [0.25] * 4, 1.0, 1.1, 2, 4, []),
    ([0.25] * 4, [0, 1, 2, 0, 1], [0.296923, 0.296923, 0.109232, 0.296923], 1.0, 1.1, 2, 5,
     []),
    ([0.2] * 5, [0, 1, 3, 4, 0, 1], [0.2] * 5, 1.0, 1.1, 2, 6, [3]),
    ([0.2] * 5, [0, 1, 2, 0, 1], [0.241818, 0.241818, 0.032727, 0.241818, 0.241818], 2.0, 1.1,
     2, 5, []),
    ([0.2] * 5, [0, 1, 2, 3, 4, 0, 1], [0.2] * 5, 1.0, 1.1, 4, 7, []),
]


@pytest.mark.parametrize("case", LLAMA_CPP_DRY)
def test_dry_reproduces_llama_cpp_test_cases(case, kernels):
    probs, history, expected, mult, base, allowed, last_n, alone = case
    p = dry(mult, base, allowed, last_n, {t: ((),) for t in alone}, temperature=1.0)
    logits = torch.tensor(probs).log()[None]
    got = Sampler(0, kernels).probs(logits.clone(), [p], [history[:1]], [history[1:]])[0]
    torch.testing.assert_close(got, torch.tensor(expected), atol=2e-6, rtol=0)


def test_dry_example_of_llama_cpp_comments():
    # "a b c c b c y a b c": c extends a run of 3, b a run of 1 (allowed), y a run of 2.
    a, b, c, y = 1, 2, 3, 4
    p = dry(mult=1.0, base=2.0, allowed=2)
    assert reference_dry([a, b, c, c, b, c, y, a, b, c], p) == {c: 2.0, y: 1.0}
    logits = torch.zeros(1, 8)
    got = Sampler(0).processed_logits(logits, [dry(1.0, 2.0, 2, temperature=0)],
                                      [[a, b, c, c, b]], [[c, y, a, b, c]])[0]
    assert got.tolist() == [0, 0, 0, -2.0, -1.0, 0, 0, 0]


def _repetitive(rng: random.Random, length: int, vocab: int) -> list[int]:
    """Token histories with repeats: random tokens and copies of earlier stretches."""
    out = [rng.randrange(vocab) for _ in range(3)]
    while len(out) < length:
        if rng.random() < 0.5:
            start = rng.randrange(len(out))
            out += out[start:start + rng.randrange(1, 9)]
        else:
            out.append(rng.randrange(vocab))
    return out[:length]


def test_dry_penalties_equal_the_reference_on_random_histories(kernels):
    rng = random.Random(7)
    vocab, rows = 24, 40
    params, prompts, outputs = [], [], []
    for r in range(rows):
        history = _repetitive(rng, rng.randrange(2, 120), vocab)
        breakers = {}
        for head in rng.sample(range(vocab), rng.randrange(0, 3)):
            breakers[head] = ((),) if rng.random() < 0.5 else (
                (rng.randrange(vocab),), (rng.randrange(vocab), rng.randrange(vocab)))
        params.append(dry(mult=rng.choice([0.5, 0.8, 3.0]), base=rng.choice([1.0, 1.75, 3.0]),
                          allowed=rng.randrange(0, 4),
                          last_n=rng.choice([None, 0, 5, 30, 200]), breakers=breakers,
                          temperature=1.0))
        cut = rng.randrange(len(history) + 1)
        prompts.append(history[:cut])
        outputs.append(history[cut:])
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3))
    adjusted = Sampler(0).processed_logits(logits, params, prompts, outputs)
    probs = Sampler(0, kernels).probs(logits.clone(), params, prompts, outputs)
    penalized = 0
    for r, p in enumerate(params):
        expected = logits[r].clone()
        for token, amount in reference_dry(prompts[r] + outputs[r], p).items():
            expected[token] -= amount
            penalized += 1
        torch.testing.assert_close(adjusted[r], expected, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(probs[r], expected.softmax(-1), rtol=1e-4, atol=1e-6)
    assert penalized > 30  # the histories did repeat


def test_dry_exponent_is_capped_as_llama_cpp_caps_it():
    history = [5] * 300  # a run of 299: base ** 297 would overflow float32
    p = dry(mult=1.0, base=3.0, allowed=2, temperature=0)
    got = Sampler(0).processed_logits(torch.zeros(1, 8), [p], [history], [[]])[0]
    cap = int(88.7228391 / math.log(3.0))
    assert math.isfinite(got[5]) and got[5] == pytest.approx(-(3.0 ** cap), rel=1e-6)


# ----- XTC ---------------------------------------------------------------------------------

def reference_xtc(probs: list[float], threshold: float) -> list[float]:
    """llama.cpp's cut, on one normalized distribution (not renormalized)."""
    top = [q for q in probs if q >= threshold and q > 0]
    if len(top) < 2 or threshold > 0.5:
        return list(probs)
    least = min(top)
    return [0.0 if (q >= threshold and q > least) else q for q in probs]


def test_xtc_counts_only_candidates():
    # top-k left two tokens: with threshold 0 both are top choices, the zeros are not.
    probs = torch.tensor([[0.7, 0.3, 0.0, 0.0]])
    assert exclude_top_choices(probs, [0.0])[0].tolist() == pytest.approx([0, 0.3, 0, 0])


@pytest.mark.parametrize("threshold, kept", [
    (0.09, [0.1]), (0.19, [0.2, 0.1]), (0.29, [0.3, 0.2, 0.1]),
    (0.39, [0.4, 0.3, 0.2, 0.1])])  # llama.cpp's test_xtc cases (the last: "should not")
def test_xtc_cut_reproduces_llama_cpp_test_cases(threshold, kept):
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    cut = exclude_top_choices(probs.clone(), [threshold])[0]
    assert [round(q, 6) for q in cut.tolist() if q > 0] == kept
    assert cut.tolist() == pytest.approx(reference_xtc([0.4, 0.3, 0.2, 0.1], threshold))


def _filtered(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """transformers' warpers: temperature, top-k, top-p; the distribution before XTC."""
    scores, ids = logits[None].clone(), torch.zeros((1, 1), dtype=torch.long)
    scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
    if p.top_k:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    return scores[0].softmax(-1)


def _chi_square_bound(dof: int, z: float = 3.09) -> float:
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def _assert_frequencies(tokens: list[int], expected: torch.Tensor) -> None:
    counts = torch.bincount(torch.tensor(tokens), minlength=len(expected)).double()
    assert (counts[expected == 0] == 0).all()
    support = expected > 0
    exp_counts = expected[support].double() * len(tokens)
    chi2 = float(((counts[support] - exp_counts) ** 2 / exp_counts).sum())
    assert chi2 < _chi_square_bound(int(support.sum()) - 1), chi2


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, xtc_probability=0.5, xtc_threshold=0.1),
    SamplingParams(temperature=0.7, top_k=8, xtc_probability=1.0, xtc_threshold=0.05),
    SamplingParams(temperature=1.2, top_p=0.8, xtc_probability=0.3, xtc_threshold=0.15),
], ids=["p0.5", "topk-always", "topp"])
def test_xtc_samples_the_reference_mixture(params, kernels):
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(30, generator=gen) * 2.0
    logits[0] += 3.0  # one clear favourite and a few above the threshold
    base = _filtered(logits, params)
    cut = torch.tensor(reference_xtc(base.tolist(), params.xtc_threshold))
    cut = cut / cut.sum()
    expected = (1 - params.xtc_probability) * base + params.xtc_probability * cut
    draws = 20000
    # An unseeded row of another kind in the batch: the XTC rows are sampled apart.
    other = SamplingParams(temperature=0)
    out = Sampler(21, kernels).sample(
        torch.cat([logits.expand(draws, -1), logits[None]]).clone(),
        [str(i) for i in range(draws + 1)], [params] * draws + [other])
    assert out.token_ids[-1] == int(logits.argmax())
    _assert_frequencies(out.token_ids[:draws], expected)


def test_xtc_seeded_rows_do_not_depend_on_the_batch(kernels):
    torch.manual_seed(5)
    steps = [torch.randn(1, 300) * 2 for _ in range(10)]
    seeded = SamplingParams(temperature=1.0, seed=4, xtc_probability=0.5, xtc_threshold=0.05)
    alone, crowded, a, b = Sampler(0, kernels), Sampler(7, kernels), [], []
    for i, row in enumerate(steps):
        a += alone.sample(row.clone(), ["r"], [seeded]).token_ids
        others = torch.randn(2, 300)
        batch = torch.cat([others[:1], row, others[1:]])
        params = [SamplingParams(temperature=0.9, xtc_probability=0.7), seeded,
                  SamplingParams(temperature=1.0, seed=i)]
        b.append(crowded.sample(batch, ["x", "r", "y"], params).token_ids[1])
    assert a == b


def test_xtc_logprobs_stay_the_raw_ones(kernels):
    logits = torch.tensor([[4.0, 3.0, 2.0, -1.0]])
    p = SamplingParams(temperature=1.0, top_k=2, xtc_probability=1.0, xtc_threshold=0.0,
                       logprobs=2)
    out = Sampler(0, kernels).sample(logits.clone(), ["a"], [p])
    assert out.token_ids == [1]  # top-k 2, both above 0: the less likely one is kept
    entry = out.logprobs[0]
    raw = logits[0].log_softmax(-1)
    assert entry.token_ids == [1, 0, 1] and entry.ranks == [2, 1, 2]
    assert entry.logprobs[0] == pytest.approx(float(raw[1]), abs=1e-6)


# ----- allowed_token_ids and bad_words ---------------------------------------------------

def test_allowed_token_ids_and_bad_words(kernels):
    logits = torch.zeros(3, 12)
    logits[:, 7] = 5.0
    params = [SamplingParams(temperature=0, allowed_token_ids=[2, 3]),
              SamplingParams(temperature=0, bad_words=["x"],
                             tokenized=TokenizedWords(((7,), (4, 5, 9)))),
              SamplingParams(temperature=0, bad_words=["x"],
                             tokenized=TokenizedWords(((4, 5, 7),)))]
    outputs = [[], [1, 4, 5], [4, 5]]
    x = Sampler(0).processed_logits(logits, params, None, outputs)
    assert torch.isfinite(x[0]).tolist() == [t in (2, 3) for t in range(12)]
    assert x[1, 7] == -math.inf and x[1, 9] == -math.inf  # 9 ends "4 5 9" after 4 5
    assert x[2, 7] == -math.inf and torch.isfinite(x[2]).sum() == 11
    out = Sampler(0, kernels).sample(logits.clone(), list("abc"), params, None, outputs)
    assert out.token_ids[0] in (2, 3) and out.token_ids[1] != 7 and out.token_ids[2] != 7
    assert not any(takes_plain_argmax(p, 3) for p in params)
    assert not takes_plain_argmax(dry(temperature=0), 0)


def test_allowed_tokens_outlast_bans_that_would_leave_nothing(kernels):
    logits = torch.randn(2, 16)
    params = [SamplingParams(temperature=1.0, allowed_token_ids=[2], min_tokens=5),
              SamplingParams(temperature=1.0, allowed_token_ids=[2, 3], bad_words=["x"],
                             tokenized=TokenizedWords(((3,),)))]
    x = Sampler(0).processed_logits(logits, params, None, [[], []], eos_token_id=2)
    assert torch.isfinite(x[0]).tolist() == [t == 2 for t in range(16)]  # EOS kept
    assert torch.isfinite(x[1]).tolist() == [t == 2 for t in range(16)]  # 3 is banned
    out = Sampler(0, kernels).sample(logits.clone(), ["a", "b"], params, None, [[], []], 2)
    assert out.token_ids == [2, 2]
    with pytest.raises(ValueError, match="^allowed_token_ids cannot be combined"):
        from treadle.structured.spec import StructuredSpec
        SamplingParams(allowed_token_ids=[1], structured_outputs=StructuredSpec("regex", "a"))
