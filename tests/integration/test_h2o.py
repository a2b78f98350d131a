"""Heavy-hitter (H2O) eviction in the engine (`kv_eviction="h2o"`): against a reference
written here on transformers, which runs the whole sequence each step with a 4D mask
holding what each query saw when it was computed (so its attention probabilities are the
engine's), accumulates them, and evicts by the same rule (kv_specs/eviction.py): greedy
tokens, the kept positions (exactly the recent ones plus the heavy hitters) and their
scores agree. Memory stays within the budget, and swap preemption keeps the scores."""

from __future__ import annotations

import pytest
import torch

from treadle import LLM, SamplingParams
from tests.integration.conftest import make_tiny_checkpoint

BUDGET, RECENT, BLOCK = 32, 8, 4
MAX_STEP = (BUDGET - RECENT) // 2
STRIDE = min(BLOCK, MAX_STEP)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("h2o") / "llama", "llama", seed=3)


def reference_h2o(model, prompt: list[int], max_new: int):
    """Greedy tokens, kept positions and their scores, by the H2O rule."""
    tokens, kept, scores, seen = list(prompt), [], {}, {}
    computed, outputs = 0, []
    while len(outputs) < max_new:
        n = min(len(tokens) - computed, MAX_STEP)
        if len(kept) + n > BUDGET:
            num_kept = BUDGET - max(n, STRIDE)
            older, recent = kept[:len(kept) - RECENT], kept[len(kept) - RECENT:]
            ranked = sorted(older, key=lambda p: (-scores[p], p))
            kept = sorted(ranked[:num_kept - RECENT]) + recent
        for j in range(computed, computed + n):
            seen[j] = kept + list(range(computed, j + 1))
        kept = kept + list(range(computed, computed + n))
        length = computed + n
        mask = torch.full((1, 1, length, length), torch.finfo(torch.float32).min)
        for j in range(length):
            mask[0, 0, j, seen[j]] = 0.0
        with torch.no_grad():
            out = model(torch.tensor([tokens[:length]]), attention_mask=mask,
                        output_attentions=True)
        for attn in out.attentions:  # [1, heads, length, length]
            mass = attn[0, :, computed:length].double().sum(dim=0)  # [new, length]
            for r, j in enumerate(range(computed, length)):
                for p in seen[j]:
                    scores[p] = scores.get(p, 0.0) + float(mass[r, p])
        computed = length
        if computed == len(tokens):
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            outputs.append(token)
    return outputs, kept, [scores[p] for p in kept]


def run_engine(checkpoint, prompts, max_new, backend, **overrides):
    options = dict(model=checkpoint, dtype="float32", attention_backend=backend,
                   block_size=BLOCK, num_kv_blocks=256, kv_eviction="h2o",
                   kv_budget_tokens=BUDGET, kv_recent_tokens=RECENT)
    llm = LLM(**{**options, **overrides})
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def prompts(n, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (length,), generator=g).tolist() for length in lengths[:n]]


REFERENCE_BATCH, REFERENCE_MAX_NEW = prompts(3, [50, 9, 27]), 30


@pytest.fixture(scope="module")
def h2o_reference(checkpoint):
    """reference_h2o's (tokens, kept positions, scores) for each prompt of REFERENCE_BATCH:
    made once for both backends (it runs the whole sequence on transformers each step)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, attn_implementation="eager", torch_dtype=torch.float32).eval()
    return [reference_h2o(model, prompt, REFERENCE_MAX_NEW) for prompt in REFERENCE_BATCH]


@pytest.mark.parametrize("backend", ["reference", "cpu-native"])
def test_h2o_matches_a_reference_on_transformers(checkpoint, h2o_reference, backend):
    batch, max_new = REFERENCE_BATCH, REFERENCE_MAX_NEW
    llm, got = run_engine(checkpoint, batch, max_new, backend)
    tracker = llm.engine.executor.worker.runner.h2o
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    for i, prompt in enumerate(batch):
        want_tokens, want_kept, want_scores = h2o_reference[i]
        assert got[i] == want_tokens  # in a batch
        # alone, and the worker's last state of it (no step ran after it ended)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert out[0].outputs[0].token_ids == want_tokens
        (rid,) = tracker.scores
        assert tracker.positions[rid].tolist() == want_kept
        assert len(want_kept) <= BUDGET
        last = len(prompt) + max_new - 2  # the last token computed
        assert want_kept[-RECENT:] == list(range(last - RECENT + 1, last + 1))
        torch.testing.assert_close(tracker.scores[rid],
                                   torch.tensor(want_scores, dtype=torch.float64),
                                   rtol=1e-4, atol=1e-6)
    stats = llm.engine.scheduler.stats
    assert stats.num_kv_compactions > 0 and stats.num_evicted_tokens > 0


def test_memory_per_request_stays_within_the_budget(checkpoint):
    # 200 + 60 tokens would need 65 blocks of 4; two requests run in 24 without preempting
    batch = prompts(2, [200, 180], seed=1)
    llm, got = run_engine(checkpoint, batch, 60, "cpu-native", num_kv_blocks=24)
    assert all(len(t) == 60 for t in got)
    assert llm.engine.scheduler.stats.num_preemptions == 0
    roomy, want = run_engine(checkpoint, batch, 60, "cpu-native")
    assert got == want


def test_swap_preemption_keeps_the_scores(checkpoint):
    batch = prompts(3, [120, 100, 90], seed=2)
    _, want = run_engine(checkpoint, batch, 40, "cpu-native")
    tight, got = run_engine(checkpoint, batch, 40, "cpu-native", num_kv_blocks=18,
                            max_num_seqs=3, preemption_mode="swap", swap_space="4MiB",
                            preemption_cooldown_steps=1, admission_lookahead_tokens=0,
                            kv_watermark=0.0)
    assert tight.engine.scheduler.stats.num_preemptions_swap > 0
    assert got == want


@pytest.mark.parametrize("options, message", [
    (dict(kv_eviction="h2o"), "needs kv_budget_tokens"),
    (dict(kv_eviction="h2o", kv_budget_tokens=2), "kv_budget_tokens must be an int >= 4"),
    (dict(kv_eviction="h2o", kv_budget_tokens=64, kv_recent_tokens=63),
     r"kv_recent_tokens must be an int in \[1, kv_budget_tokens - 2 = 62\]"),
    (dict(kv_budget_tokens=64), "kv_budget_tokens is given without kv_eviction h2o"),
    (dict(kv_eviction="lru"), "kv_eviction must be one of none, h2o"),
    (dict(kv_eviction="h2o", kv_budget_tokens=64, tensor_parallel_size=2),
     "does not support tensor_parallel_size"),
    (dict(kv_eviction="h2o", kv_budget_tokens=64,
          speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "does not support speculative_config"),
])
def test_bad_eviction_options_are_refused_by_name(checkpoint, options, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=checkpoint, **options)
