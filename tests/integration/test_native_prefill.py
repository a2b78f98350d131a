"""The C prefill-attention kernel (worker/cpu/kernels/paged_prefill.c) against a plain causal
softmax(QK^T)V over each span's blocks, and the engine's prefill logprobs with it against
the torch attention path; once per kernel ISA level this CPU executes (worker/cpu/cpu_isa.py)."""

from __future__ import annotations

import math

import pytest
import torch


@pytest.fixture(scope="module")
def kernels(level_kernels, kernel_level):
    if not level_kernels.supports_prefill(torch.bfloat16, 64):
        pytest.skip(f"the {kernel_level} build has no vector unit: prefills use torch's "
                    "attention")
    return level_kernels


def reference(q, kc, vc, table, start, n, scale, window=None):
    """fp32 causal attention of n new tokens at positions [start, start + n) (with a
    window: each query sees the last `window` positions up to its own)."""
    num_kv_heads, _, block_size, head_dim = kc.shape
    group = q.shape[1] // num_kv_heads
    pos = torch.arange(start + n)
    blocks, offsets = table[pos // block_size], pos % block_size
    k = kc[:, blocks, offsets].float().repeat_interleave(group, 0)  # [heads, ctx, dim]
    v = vc[:, blocks, offsets].float().repeat_interleave(group, 0)
    scores = q.float().transpose(0, 1) @ k.transpose(1, 2) * scale  # [heads, n, ctx]
    allowed = pos[None, :] <= (start + torch.arange(n))[:, None]
    if window is not None:
        allowed &= pos[None, :] > (start + torch.arange(n))[:, None] - window
        k[:, ~allowed.any(0)] = 0.0  # positions no query sees: a sliding group's stale blocks
        v[:, ~allowed.any(0)] = 0.0
    probs = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1)
    return (probs @ v).transpose(0, 1).reshape(n, -1)


def run_spans(kernels, cases, num_heads, num_kv_heads, head_dim, block_size, scale, seed=0,
              extra_query_heads=0, poison=False, window=None, amx=False):
    """Lay the spans out in one flat batch over shuffled blocks, run the kernel once, and
    return (out, [(reference, rows)]). With a window, each span's table entries for blocks
    wholly before its first query's window name a block of NaNs, as a sliding KV group's
    stale ids would: the kernel must not read them."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per = [(s + n + block_size - 1) // block_size for s, n in cases]
    num_blocks = sum(blocks_per) + 3
    kc = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen).bfloat16()
    vc = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen).bfloat16()
    stale = num_blocks - 1  # never in a table otherwise: the permutation's last 3 are spare
    kc[:, stale] = float("nan")
    vc[:, stale] = float("nan")
    perm = torch.randperm(num_blocks - 1, generator=gen)
    rows = sum(n for _, n in cases)
    # Queries as a strided view, like the model's [tokens, heads + kv_heads, dim] tensor.
    q = torch.randn(rows, num_heads + extra_query_heads, head_dim, generator=gen).bfloat16()
    q = q[:, :num_heads]
    tables = torch.zeros(len(cases), max(blocks_per), dtype=torch.int64)
    spans, row, used = [], 0, 0
    for i, ((start, n), nb) in enumerate(zip(cases, blocks_per)):
        tables[i, :nb] = perm[used:used + nb]
        if window is not None:
            tables[i, :max(0, start - window + 1) // block_size] = stale
        used += nb
        spans.append([row, n, start])
        row += n
    if poison:  # cache slots past each context: never read
        for i, (start, n) in enumerate(cases):
            last = tables[i, blocks_per[i] - 1]
            used_slots = (start + n) - (blocks_per[i] - 1) * block_size
            kc[:, last, used_slots:] = float("nan")
            vc[:, last, used_slots:] = float("nan")
    spans = torch.tensor(spans, dtype=torch.int64)
    out = torch.full((rows, num_heads * head_dim), 7.0, dtype=torch.bfloat16)
    kernels.paged_prefill(q, kc, vc, spans, tables, out,
                          kernels.prefill_workspace(spans, num_kv_heads, head_dim), scale,
                          window, amx=amx)
    refs = [(reference(q[r:r + n], kc, vc, tables[i], s, n, scale, window), slice(r, r + n))
            for i, (r, n, s) in enumerate(spans.tolist())]
    return out, refs


# (spans as (positions before, new tokens), heads, kv heads, head_dim, block_size, scale)
SHAPES = [
    ([(0, 512)], 9, 3, 64, 16, 0.125),                      # a first chunk, benchmark layout
    ([(512, 512), (1536, 300)], 9, 3, 64, 16, 0.125),       # later chunks, two spans
    ([(0, 2), (5, 3), (31, 1 + 1), (30, 7), (100, 33)], 9, 3, 64, 16, 0.125),  # tile edges
    ([(0, 65), (17, 40)], 8, 8, 64, 5, 0.3),                # group 1, odd block size
    ([(0, 100), (250, 31)], 8, 2, 128, 16, 0.09),           # head_dim 128, group 4
    ([(3, 50)], 16, 2, 128, 32, 0.2),                       # group 8, big blocks
]


@pytest.mark.parametrize("cases, heads, kv_heads, head_dim, block_size, scale", SHAPES,
                         ids=[f"shape{i}" for i in range(len(SHAPES))])
def test_paged_prefill_matches_reference(kernels, cases, heads, kv_heads, head_dim,
                                         block_size, scale):
    out, refs = run_spans(kernels, cases, heads, kv_heads, head_dim, block_size, scale,
                          extra_query_heads=kv_heads)
    for ref, rows in refs:
        got = out[rows].float()
        # bf16 output (relative rounding 2^-8) and bf16 probabilities in P.V
        assert torch.allclose(got, ref, atol=1.5e-2, rtol=1.5e-2), (got - ref).abs().max()


@pytest.mark.parametrize("cases, heads, kv_heads, head_dim, block_size, scale", SHAPES,
                         ids=[f"shape{i}" for i in range(len(SHAPES))])
def test_paged_prefill_on_amx_tiles_matches_reference(kernels, kernel_level, cases, heads,
                                                      kv_heads, head_dim, block_size, scale):
    """The compute phase on AMX tiles (its twin where there are none: the test above, the
    same shapes on the vector kernels), with the cache poisoned past every context."""
    if not kernels.supports_amx_prefill(head_dim):
        pytest.skip(f"no AMX compute path here ({kernel_level} build, or no AMX-BF16)")
    out, refs = run_spans(kernels, cases, heads, kv_heads, head_dim, block_size, scale,
                          extra_query_heads=kv_heads, poison=True, amx=True)
    for ref, rows in refs:
        got = out[rows].float()
        assert torch.allclose(got, ref, atol=1.5e-2, rtol=1.5e-2), (got - ref).abs().max()
    plain, _ = run_spans(kernels, cases, heads, kv_heads, head_dim, block_size, scale,
                         extra_query_heads=kv_heads, poison=True)
    # The same products, summed and rescaled in other places: as close to fp32 as the
    # vector kernels are (mean absolute error, whose spread is small).
    errors = [sum((o[rows].float() - ref).abs().mean() for ref, rows in refs) / len(refs)
              for o in (out, plain)]
    assert errors[0] <= 1.1 * errors[1], errors


# (spans, heads, kv heads, head_dim, block_size, scale, window): Gemma 3's grouping and
# head size, its local layers' window, chunks past it; windows shorter than a 32-key tile
# (both bounds in one tile), odd block sizes, a window wider than the context.
WINDOWED = [
    ([(0, 512)], 4, 1, 256, 16, 0.0625, None),              # Gemma 3 270M, a first chunk
    ([(700, 100), (0, 40), (1000, 3 + 6)], 4, 1, 256, 16, 0.0625, 512),  # its local layers
    ([(0, 70), (45, 50), (200, 17)], 8, 2, 64, 16, 0.125, 16),   # a window inside a tile
    ([(33, 61), (5, 90)], 4, 2, 128, 5, 0.1, 29),           # odd block size and window
    ([(100, 40)], 4, 1, 256, 7, 0.0625, 10_000),            # wider than the context
]


def _windowed_ok(kernels, head_dim, window):
    if not kernels.supports_prefill(torch.bfloat16, head_dim, window):
        assert kernels.has_dpbf16, "the widening builds run every head_dim and window here"
        pytest.skip("the AVX-512 BF16 build keeps head_dim 256 and windows on torch's "
                    "attention (its twin: the widening builds, tested on this CPU)")


@pytest.mark.parametrize("cases, heads, kv_heads, head_dim, block_size, scale, window",
                         WINDOWED, ids=[f"windowed{i}" for i in range(len(WINDOWED))])
def test_paged_prefill_with_head_dim_256_and_windows(kernels, cases, heads, kv_heads,
                                                     head_dim, block_size, scale, window):
    """head_dim 256 and sliding windows (the widening builds), without reading the table
    entries a sliding group leaves stale before each span's window."""
    _windowed_ok(kernels, head_dim, window)
    out, refs = run_spans(kernels, cases, heads, kv_heads, head_dim, block_size, scale,
                          extra_query_heads=kv_heads, window=window)
    for ref, rows in refs:
        got = out[rows].float()
        assert torch.isfinite(got).all()
        assert torch.allclose(got, ref, atol=1.5e-2, rtol=1.5e-2), (got - ref).abs().max()


def test_paged_prefill_reads_only_the_context(kernels):
    out, refs = run_spans(kernels, [(0, 37), (20, 12)], 9, 3, 64, 16, 0.125, poison=True)
    for ref, rows in refs:
        assert torch.isfinite(out[rows].float()).all()
        assert torch.allclose(out[rows].float(), ref, atol=1.5e-2, rtol=1.5e-2)


def test_paged_prefill_leaves_other_rows_alone(kernels):
    # Rows 0-3 of the batch are decodes (another kernel's); the span starts at row 4.
    gen = torch.Generator().manual_seed(1)
    kc = torch.randn(3, 8, 16, 64, generator=gen).bfloat16()
    vc = torch.randn(3, 8, 16, 64, generator=gen).bfloat16()
    q = torch.randn(24, 9, 64, generator=gen).bfloat16()
    spans = torch.tensor([[4, 20, 10]])
    tables = torch.arange(8).view(1, 8)
    out = torch.full((24, 9 * 64), 7.0, dtype=torch.bfloat16)
    kernels.paged_prefill(q, kc, vc, spans, tables, out, kernels.prefill_workspace(spans, 3, 64),
                          0.125)
    assert (out[:4] == 7.0).all()
    assert torch.allclose(out[4:].float(), reference(q[4:], kc, vc, tables[0], 10, 20, 0.125),
                          atol=1.5e-2, rtol=1.5e-2)


def test_unsupported_head_dim_is_reported(kernels):
    assert not kernels.supports_prefill(torch.bfloat16, 80)
    assert not kernels.supports_prefill(torch.float32, 64)
    spans = torch.tensor([[0, 4, 0]])
    with pytest.raises(ValueError, match="head_dim 80"):
        kernels.paged_prefill(torch.zeros(4, 2, 80, dtype=torch.bfloat16),
                              torch.zeros(1, 2, 16, 80, dtype=torch.bfloat16),
                              torch.zeros(1, 2, 16, 80, dtype=torch.bfloat16), spans,
                              torch.zeros(1, 1, dtype=torch.int64),
                              torch.zeros(4, 160, dtype=torch.bfloat16),
                              kernels.prefill_workspace(spans, 1, 80), 0.1)


def test_engine_prefill_logprobs_native_vs_torch(kernels, tmp_path, monkeypatch):
    """A bf16 model with head_dim 64, prompts chunked over steps: the C prefill path gives
    the same prompt logprobs as torch's attention, to bf16 accuracy. (Where torch runs on
    AMX the engine prefers its attention: oneDNN capped below AMX gives the kernel back,
    and the start-up line says which ran.)"""
    import transformers

    from treadle import LLM, SamplingParams
    from treadle.worker.cpu.native_linear import onednn_uses_amx

    if onednn_uses_amx():
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
        initializer_range=0.05, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (300, 77, 5)]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)

    def prompt_logprobs(backend):
        llm = LLM(model=str(tmp_path), dtype="bfloat16", max_num_batched_tokens=128,
                  attention_backend=backend, enable_prefix_caching=False,
                  kernel_isa=kernels.isa)
        if backend == "native":
            assert "prefill attention" in llm.engine.info.kernels.split("; torch:")[0]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [torch.tensor([next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]])
                for o in outs]

    native, reference_path = prompt_logprobs("native"), prompt_logprobs("torch")
    for a, b in zip(native, reference_path):
        assert torch.allclose(a, b, atol=0.05), (a - b).abs().max()


def test_prefill_path_follows_amx(kernels, monkeypatch):
    """Where AMX runs (oneDNN not capped below it) prefills take the kernel's AMX compute
    path, or, in a build without one, torch's attention (faster there than the vector
    kernels); sliding-window layers, which the AMX path does not take, go to torch's
    attention then. Elsewhere, or with oneDNN capped below AMX, the vector kernels take
    every prefill."""
    from treadle.worker.cpu import native_attention
    from treadle.worker.cpu.native_attention import CpuNativeBackend, prefill_kernel_runs

    monkeypatch.setattr(native_attention, "onednn_uses_amx", lambda: True)
    for has_amx_path in (True, False):
        monkeypatch.setattr(kernels, "supports_amx_prefill", lambda head_dim: has_amx_path)
        assert prefill_kernel_runs(kernels, torch.bfloat16, 64) == has_amx_path
        backend = CpuNativeBackend(kernels, None, 1, 64, torch.bfloat16)
        assert backend.native_prefill == backend.prefill_amx == has_amx_path
        assert not backend.native_window_prefill
    monkeypatch.setattr(native_attention, "onednn_uses_amx", lambda: False)
    assert prefill_kernel_runs(kernels, torch.bfloat16, 64)
    backend = CpuNativeBackend(kernels, None, 1, 64, torch.bfloat16)
    assert backend.native_prefill and not backend.prefill_amx


def test_prefill_benchmark_times_both_paths(kernels):
    from benchmarks.attention_kernel import bench_prefill

    row = bench_prefill(kernels, 16, 32, rounds=1)
    assert row["native_ms"] > 0 and row["sdpa_ms"] > 0
    # The reported speedup is the ratio of the two times, to its two decimals (a loaded
    # machine can make either path slow, so the ratio itself is not asserted).
    assert row["speedup"] == pytest.approx(row["sdpa_ms"] / row["native_ms"], rel=0.05,
                                           abs=0.006)


def test_prefill_benchmark_runs_another_build(kernels, capsys):
    """--so (a build of other sources, for before/after timings) takes the prefill
    kernel as well as the decode one."""
    import json

    from benchmarks.attention_kernel import main

    main(["--prefill", "8x16", "--rounds", "1", "--so", kernels.lib._name])
    rows = json.loads(capsys.readouterr().out)["prefill"]
    assert [(r["positions_before"], r["new_tokens"]) for r in rows] == [(8, 16)]
    assert rows[0]["native_ms"] > 0


def test_decode_benchmark_takes_the_block_size(kernels, capsys):
    """--block-size lays the decode benchmark's caches out in blocks of that many tokens:
    the layout says so and a context that is not a multiple of it is still read whole."""
    import json

    from benchmarks.attention_kernel import main

    main(["--shapes", "2x40", "--rounds", "1", "--block-size", "32", "--so",
          kernels.lib._name])
    report = json.loads(capsys.readouterr().out)
    assert report["layout"]["block_size"] == 32
    (row,) = report["results"]
    assert (row["batch"], row["context"]) == (2, 40)
    # K and V of 2 requests x 40 tokens x 3 KV heads x 64 dims in bf16
    assert row["kv_bytes_per_call"] == 2 * 2 * 40 * 3 * 64 * 2
    assert row["ms_per_call"] > 0


def test_decode_benchmark_in_cache_from_huge_pages(kernels, capsys):
    """--in-cache cycles two layers' caches (the kernel's arithmetic, not the memory's) and
    --huge-pages cuts them from the huge-page arena; both say so in the layout."""
    import json

    from benchmarks.attention_kernel import main

    main(["--shapes", "2x40", "--rounds", "1", "--in-cache", "--huge-pages", "--so",
          kernels.lib._name])
    report = json.loads(capsys.readouterr().out)
    assert report["layout"]["in_cache"] and report["layout"]["huge_pages"]
    (row,) = report["results"]
    assert row["layers_cycled"] == 2
    assert row["ms_per_call"] > 0
    main(["--shapes", "2x40", "--rounds", "1", "--so", kernels.lib._name])
    (row,) = json.loads(capsys.readouterr().out)["results"]
    assert row["layers_cycled"] == 30  # 256 MB at least, 30 layers at most
