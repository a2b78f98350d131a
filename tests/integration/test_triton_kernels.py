"""The Triton kernels (worker/cuda/triton/) against the plain-torch reference.

On CPU they run under triton's interpreter (TRITON_INTERPRET=1, set here before the
kernels are defined) at tiny shapes; on a GPU the same tests run compiled, and the
`cuda`-marked ones add real model shapes. Every batch mixes decodes and prefill chunks
over shuffled blocks, with cached prefixes, GQA ratios 1/2/4/8 and sliding windows.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the triton extra is not installed "
                                     "(pip install -e '.[triton]')")

from treadle.worker.cuda.attention_reference import paged_attention_reference  # noqa: E402
from treadle.worker.cuda.triton import (MAX_SPLITS, choose_num_splits, decode_attention,  # noqa: E402
                                   paged_attention, prefill_attention, write_kv)

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
cuda_only = pytest.mark.skipif(DEVICE != "cuda", reason="real shapes need a GPU")


def make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
               seed=0, spare_blocks=3):
    """Random K/V caches and queries; each request's blocks a random subset of the pool."""
    gen = torch.Generator().manual_seed(seed)
    num_reqs = len(q_lens)
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    num_blocks = num_reqs * max_blocks + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[:num_reqs * max_blocks]
    block_tables = tables.view(num_reqs, max_blocks).to(torch.int32)
    query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(q_lens).cumsum(0)
    query = torch.randn(int(query_start_loc[-1]), num_heads, head_dim, generator=gen).to(dtype)
    to = dict(device=DEVICE)
    return (query.to(**to), key_cache.to(**to), value_cache.to(**to), block_tables.to(**to),
            query_start_loc.to(**to), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE))


def check_close(out, ref, dtype):
    err = (out.float().cpu() - ref.float().cpu()).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, ref.float().abs().max().item()), err


# (q_lens, seq_lens): decodes first (one token each), then prefill chunks; a chunk with
# seq_len == q_len is a fresh prompt, one with seq_len > q_len has a cached prefix.
MIXED = ([1, 1, 1, 5, 17, 9], [1, 37, 70, 5, 50, 9])
# (dtype, head_dim, block_size, num_heads, num_kv_heads): each dtype, head_dim, block
# size and GQA ratio (1, 2, 4, 8) at least once.
SHAPES = [
    (torch.float32, 64, 16, 4, 4),
    (torch.float32, 128, 32, 8, 4),
    (torch.bfloat16, 64, 16, 8, 2),
    (torch.bfloat16, 128, 16, 8, 1),
    (torch.float16, 64, 32, 16, 2),
    (torch.float16, 256, 16, 4, 2),
    (torch.bfloat16, 256, 32, 2, 2),
]


@pytest.mark.parametrize("dtype, head_dim, block_size, num_heads, num_kv_heads", SHAPES,
                         ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("num_splits", [1, 4])
def test_mixed_batch_matches_reference(dtype, head_dim, block_size, num_heads, num_kv_heads,
                                       num_splits):
    q, kc, vc, bt, qsl, sl = make_batch(*MIXED, num_heads, num_kv_heads, head_dim, block_size,
                                        dtype, seed=head_dim + block_size + num_heads)
    scale = head_dim ** -0.5
    out = paged_attention(q, kc, vc, bt, qsl, sl, scale, num_decodes=3, num_splits=num_splits)
    ref = paged_attention_reference(q.cpu(), kc.cpu(), vc.cpu(), bt.cpu(), qsl.cpu(),
                                    sl.cpu(), scale)
    assert out.dtype == dtype and out.shape == q.shape
    check_close(out, ref, dtype)


@pytest.mark.parametrize("window", [1, 5, 16, 40])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_sliding_window_matches_reference(window, num_splits):
    q, kc, vc, bt, qsl, sl = make_batch([1, 1, 23, 6], [3, 90, 60, 6], 8, 2, 64, 16,
                                        torch.float32, seed=window)
    out = paged_attention(q, kc, vc, bt, qsl, sl, 0.3, num_decodes=2, num_splits=num_splits,
                          sliding_window=window)
    ref = paged_attention_reference(q.cpu(), kc.cpu(), vc.cpu(), bt.cpu(), qsl.cpu(),
                                    sl.cpu(), 0.3, sliding_window=window)
    check_close(out, ref, torch.float32)
    if window < 60:  # the window changes the answer (the test can fail)
        full = paged_attention_reference(q.cpu(), kc.cpu(), vc.cpu(), bt.cpu(), qsl.cpu(),
                                         sl.cpu(), 0.3)
        assert (full - ref).abs().max() > 1e-3


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("sliding_window", [None, 20])
def test_prefill_small_tiles_many_programs_per_request(group, sliding_window):
    """BLOCK_M = 16 rows: several query tiles per request, found by the binary search,
    tiles across and below the diagonal, a non-power-of-two group, and a batch slice whose
    offsets do not start at 0 (rows before it untouched)."""
    q_lens, seq_lens = [1, 2, 33, 1, 12, 40], [20, 8, 33, 70, 50, 97]
    q, kc, vc, bt, qsl, sl = make_batch(q_lens, seq_lens, 2 * group, 2, 32, 16, torch.float32,
                                        seed=group)
    ref = paged_attention_reference(q.cpu(), kc.cpu(), vc.cpu(), bt.cpu(), qsl.cpu(),
                                    sl.cpu(), 0.2, sliding_window)
    out = torch.full_like(q, 7.0)
    prefill_attention(q, kc, vc, bt[1:], qsl[1:], sl[1:], 0.2, out,
                      sliding_window=sliding_window, block_m=16, tile_n=16)
    assert torch.all(out[0].cpu() == 7.0)
    check_close(out[1:], ref[1:], torch.float32)


def test_decode_padding_rows_and_tiles_spanning_blocks():
    """seq_len 0 rows (a graph's padding) give zeros; 16-token tiles over 4-token blocks."""
    q, kc, vc, bt, qsl, sl = make_batch([1] * 4, [9, 1, 130, 64], 4, 1, 16, 4, torch.float32)
    sl_padded = torch.cat([sl, torch.zeros(2, dtype=torch.int32, device=DEVICE)])
    q_padded = torch.cat([q, torch.randn(2, 4, 16, device=DEVICE)])
    bt_padded = torch.cat([bt, torch.zeros(2, bt.shape[1], dtype=torch.int32, device=DEVICE)])
    ref = paged_attention_reference(q.cpu(), kc.cpu(), vc.cpu(), bt.cpu(), qsl.cpu(),
                                    sl.cpu(), 0.25)
    for splits in (1, 8, MAX_SPLITS):
        out = decode_attention(q_padded, kc, vc, bt_padded, sl_padded, 0.25,
                               num_splits=splits, tile_n=16)
        check_close(out[:4], ref, torch.float32)
        assert torch.all(out[4:] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_scatters_and_skips_negative_slots(dtype):
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, kv_heads, head_dim = 6, 16, 3, 64
    key_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype,
                            device=DEVICE)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:10]
    slots[[2, 7]] = -1
    key = torch.randn(10, kv_heads, head_dim, generator=gen)
    value = torch.randn(10, kv_heads, head_dim, generator=gen)
    write_kv(key.to(DEVICE, dtype), value.to(DEVICE, dtype), key_cache, value_cache,
             slots.to(DEVICE))
    expect_k = torch.zeros(num_blocks * block_size, kv_heads, head_dim, dtype=dtype)
    expect_v = torch.zeros_like(expect_k)
    keep = slots >= 0
    expect_k[slots[keep]] = key[keep].to(dtype)
    expect_v[slots[keep]] = value[keep].to(dtype)
    assert torch.equal(key_cache.cpu().flatten(0, 1), expect_k)
    assert torch.equal(value_cache.cpu().flatten(0, 1), expect_v)


def test_write_then_attend_is_the_reference():
    """The step's order on a device: write the new tokens' K/V, then attend to them."""
    q, kc, vc, bt, qsl, sl = make_batch([1, 4], [5, 12], 4, 2, 32, 16, torch.float32)
    new_k = torch.randn(5, 2, 32, device=DEVICE)
    new_v = torch.randn(5, 2, 32, device=DEVICE)
    positions = [4, 8, 9, 10, 11]
    requests = [0, 1, 1, 1, 1]
    slots = torch.tensor([int(bt[r, p // 16]) * 16 + p % 16 for r, p in zip(requests, positions)],
                         device=DEVICE)
    write_kv(new_k, new_v, kc, vc, slots)
    out = paged_attention(q, kc, vc, bt, qsl, sl, 0.2, num_decodes=1)
    ref = paged_attention_reference(q.cpu(), kc.cpu(), vc.cpu(), bt.cpu(), qsl.cpu(),
                                    sl.cpu(), 0.2)
    check_close(out, ref, torch.float32)
    assert torch.equal(kc.flatten(0, 1)[slots].cpu(), new_k.cpu())


def fp8_cache(cache):
    """A float cache as fp8_e4m3 rows (kv_quant's quantization), and its dequantized values."""
    from treadle.worker import kv_quant

    rows = kv_quant.quantize(cache.cpu(), "fp8_e4m3")
    return rows.to(DEVICE), kv_quant.dequantize(rows, "fp8_e4m3")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("window", [None, 7])
def test_fp8_cache_attention_is_the_reference_on_its_dequantized_values(dtype, num_splits,
                                                                      window):
    q, kc, vc, bt, qsl, sl = make_batch(*MIXED, 8, 2, 64, 16, torch.float32, seed=11)
    (k8, k_deq), (v8, v_deq) = fp8_cache(kc), fp8_cache(vc)
    assert k8.dtype == torch.uint8 and k8.shape[-1] == 66
    q = q.to(dtype)
    out = paged_attention(q, k8, v8, bt, qsl, sl, 0.125, num_decodes=3,
                          num_splits=num_splits, sliding_window=window)
    ref = paged_attention_reference(q.float().cpu(), k_deq, v_deq, bt.cpu(), qsl.cpu(),
                                    sl.cpu(), 0.125, sliding_window=window)
    assert out.dtype == dtype
    check_close(out, ref, dtype)
    unquantized = paged_attention_reference(q.float().cpu(), kc.float().cpu(),
                                            vc.float().cpu(), bt.cpu(), qsl.cpu(), sl.cpu(),
                                            0.125, sliding_window=window)
    assert (unquantized - ref).abs().max() > 1e-4  # the quantization is really there


def test_fp8_write_kv_is_kv_quant_byte_for_byte():
    from treadle.worker import kv_quant

    gen = torch.Generator().manual_seed(4)
    num_blocks, block_size, kv_heads, head_dim = 4, 8, 2, 32
    shape = (num_blocks, block_size, kv_heads, head_dim + 2)
    key_cache = torch.zeros(shape, dtype=torch.uint8, device=DEVICE)
    value_cache = torch.zeros_like(key_cache)
    key = torch.randn(9, kv_heads, head_dim, generator=gen) * 5
    value = torch.randn(9, kv_heads, head_dim, generator=gen)
    # scale 1 exactly (max 448), then ties, carries into the next power of two and
    # subnormals; and an all-zero row (scale 0)
    special = torch.tensor([448.0, 124.0, 124.9, -1.94, 0.0117, -0.0029, 0.00097, 3.25,
                            232.0, -15.5, 0.5, 1e-6] + [0.0] * (head_dim - 12))
    key[0, 0] = special
    key[1, 1] = 0.0
    slots = torch.tensor([3, 0, 31, -1, 17, 8, 9, 24, 2])
    write_kv(key.to(DEVICE), value.to(DEVICE), key_cache, value_cache, slots.to(DEVICE))
    keep = slots >= 0
    for cache, new in ((key_cache, key), (value_cache, value)):
        got = cache.cpu().flatten(0, 1)[slots[keep]]
        assert torch.equal(got, kv_quant.quantize(new[keep], "fp8_e4m3"))
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert not key_cache.cpu().flatten(0, 1)[untouched].any()


def test_choose_num_splits():
    # one request, 8 KV heads, 132 SMs: 33 programs wanted per (request, head) -> 32
    assert choose_num_splits(1, 8, 32768, 132) == 32
    # a full batch already fills the GPU
    assert choose_num_splits(256, 8, 32768, 132) == 1
    # short contexts are not split finer than two 64-token tiles
    assert choose_num_splits(1, 8, 256, 132) == 2
    assert choose_num_splits(1, 1, 10**6, 1000) == MAX_SPLITS
    with pytest.raises(ValueError, match="num_seqs"):
        choose_num_splits(0, 8, 100, 132)


def test_bad_inputs_name_the_argument():
    q, kc, vc, bt, qsl, sl = make_batch([1, 3], [4, 3], 4, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention(q, kc, vc, bt.long(), qsl, sl, 1.0, num_decodes=1)
    with pytest.raises(ValueError, match="num_heads"):
        paged_attention(q[:, :3].contiguous(), kc, vc, bt, qsl, sl, 1.0, num_decodes=1)
    with pytest.raises(ValueError, match="dtype"):
        paged_attention(q.half(), kc, vc, bt, qsl, sl, 1.0, num_decodes=1)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention(q, kc, vc, bt, qsl, sl, 1.0, num_decodes=1, sliding_window=0)
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention(q, kc, vc, bt, qsl, sl, 1.0, num_decodes=1, num_splits=3)
    with pytest.raises(ValueError, match="num_decodes"):
        paged_attention(q, kc, vc, bt, qsl, sl, 1.0, num_decodes=3)
    with pytest.raises(ValueError, match="key_cache and value_cache"):
        paged_attention(q, kc, vc[:, :8], bt, qsl, sl, 1.0, num_decodes=1)


# Real shapes on a GPU: (num_heads, num_kv_heads, head_dim, dtype, block_size) of
# Llama-3.2-1B, Llama-3-8B and a Gemma-3-style head_dim 256; 64 decodes over long
# contexts plus two long prefill chunks with cached prefixes. Each head_dim in bf16 at
# block 16, and fp16 / block 32 once each (every case compiles its own kernels: the
# device check's time is bounded).
REAL = [(32, 8, 64, torch.bfloat16, 16), (32, 8, 128, torch.bfloat16, 16),
        (8, 4, 256, torch.bfloat16, 16), (32, 8, 128, torch.float16, 32),
        (8, 4, 256, torch.bfloat16, 32)]


@cuda_only
@pytest.mark.cuda
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, dtype, block_size", REAL,
                         ids=lambda v: str(v).replace("torch.", ""))
def test_real_shapes_on_gpu(num_heads, num_kv_heads, head_dim, dtype, block_size):
    gen = torch.Generator().manual_seed(head_dim)
    decode_lens = torch.randint(1, 4096, (64,), generator=gen).tolist()
    q_lens = [1] * 64 + [1024, 300]
    seq_lens = decode_lens + [3000, 300]
    q, kc, vc, bt, qsl, sl = make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim,
                                        block_size, dtype, seed=head_dim)
    scale = head_dim ** -0.5
    ref = paged_attention_reference(q, kc, vc, bt, qsl, sl, scale)
    for splits in (1, choose_num_splits(64, num_kv_heads, 4096, 132)):
        out = paged_attention(q, kc, vc, bt, qsl, sl, scale, num_decodes=64,
                              num_splits=splits)
        check_close(out, ref, dtype)
    window = 1000
    ref = paged_attention_reference(q, kc, vc, bt, qsl, sl, scale, sliding_window=window)
    out = paged_attention(q, kc, vc, bt, qsl, sl, scale, num_decodes=64, num_splits=4,
                          sliding_window=window)
    check_close(out, ref, dtype)
