"""Every attention backend against the `reference` backend on the same step: random block
tables, cached prefixes, decodes beside prefill chunks and multi-token decode rows, GQA,
head sizes the kernels cover and one they do not, float32 and bf16, with rotary. Outputs
and the K/V written must agree (exactly up to rounding of the dtype)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from treadle.layers.rotary import RotaryInputs
from treadle.layers.attention import AttentionLayer, AttentionStep
from treadle.worker.attention_backends import make_attention_backend
from treadle.worker.cpu.native import load_kernels
from treadle.worker.cpu.native_linear import NativeLayerOps
from treadle.worker.cpu.platform import CPU

NUM_BLOCKS, BLOCK_SIZE = 48, 16


def make_step(rng: np.random.Generator, rows: list[tuple[int, int]]):
    """rows: (tokens in the cache before, new tokens); single-token rows must come first."""
    q_lens = np.array([n for _, n in rows], dtype=np.int64)
    starts = np.array([c for c, _ in rows], dtype=np.int64)
    need = (starts + q_lens + BLOCK_SIZE - 1) // BLOCK_SIZE
    blocks = rng.permutation(NUM_BLOCKS)[:int(need.sum())]
    table = np.zeros((len(rows), int(need.max())), dtype=np.int64)
    offset = 0
    for i, n in enumerate(need):
        table[i, :n] = blocks[offset:offset + n]
        offset += n
    positions = np.concatenate([np.arange(c, c + n) for c, n in rows])
    token_rows = np.repeat(np.arange(len(rows)), q_lens)
    slots = table[token_rows, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    step = AttentionStep(q_lens, np.cumsum(q_lens) - q_lens, starts, table, slots,
                         int(np.count_nonzero(q_lens == 1)), BLOCK_SIZE, NUM_BLOCKS)
    return step, positions


def rotary_for(positions: np.ndarray, head_dim: int, dtype: torch.dtype) -> RotaryInputs:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.from_numpy(positions).float(), inv_freq).unsqueeze(1)
    return RotaryInputs(angles.cos().to(dtype), angles.sin().to(dtype))


def backend(name: str, kv_heads: int, head_dim: int, dtype: torch.dtype):
    kernels = load_kernels()
    ops = NativeLayerOps.load(kernels.lib) if kernels is not None else None
    return make_attention_backend(name, CPU, kv_heads, head_dim, dtype, kernels=kernels,
                                  layer_ops=ops if dtype == torch.bfloat16 else None)


STEPS = {
    "decodes": [(37, 1), (5, 1), (200, 1), (16, 1)],
    "prefill": [(0, 40), (0, 3)],
    "mixed": [(70, 1), (12, 1), (0, 33), (48, 20), (31, 5)],  # cached prefixes, 1+4 row
    # Verification rows right after the decodes (cpu-native: one decode-kernel call, no
    # gather), at the short-row limit and one past it, then a short row after a long one.
    "verify": [(70, 1), (12, 1), (31, 5), (90, 16), (0, 17), (40, 2)],
}


@pytest.mark.parametrize("name", ["torch", "cpu-native"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 64), (8, 1, 128), (3, 3, 24),
                                                       (8, 8, 64)])
@pytest.mark.parametrize("case", sorted(STEPS))
def test_backend_matches_reference(name, dtype, heads, kv_heads, head_dim, case):
    rng = np.random.default_rng(zlib.crc32(f"{heads}-{kv_heads}-{head_dim}-{case}".encode()))
    step, positions = make_step(rng, STEPS[case])
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    cache0 = torch.randn(2, kv_heads, NUM_BLOCKS, BLOCK_SIZE, head_dim, generator=gen).to(dtype)
    qk = torch.randn(step.num_tokens, heads + kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(step.num_tokens, kv_heads, head_dim, generator=gen).to(dtype)
    rotary = rotary_for(positions, head_dim, dtype)
    layer = AttentionLayer(heads, kv_heads, head_dim, head_dim ** -0.5)
    results = {}
    for which in ("reference", name):
        impl = backend(which, kv_heads, head_dim, dtype)
        cache = cache0.clone()
        meta = impl.build_metadata(step, torch.device("cpu"))
        results[which] = (layer(qk, value, cache, meta, rotary).float(), cache.float())
    (ref_out, ref_cache), (out, cache) = results["reference"], results[name]
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0)  # rotation + write exact
    torch.testing.assert_close(out, ref_out, **tol)


def test_reference_is_a_real_oracle():
    """The reference agrees with a dense causal softmax attention written out by hand for
    one request whose blocks are scattered."""
    rng = np.random.default_rng(0)
    step, _ = make_step(rng, [(20, 7)])
    heads, kv_heads, d = 4, 2, 16
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(2, kv_heads, NUM_BLOCKS, BLOCK_SIZE, d, generator=gen)
    q = torch.randn(7, heads, d, generator=gen)
    k_new, v_new = torch.randn(7, kv_heads, d, generator=gen), torch.randn(7, kv_heads, d,
                                                                           generator=gen)
    layer = AttentionLayer(heads, kv_heads, d, 0.25)
    impl = backend("reference", kv_heads, d, torch.float32)
    out = layer(torch.cat((q, k_new), 1), v_new, cache, impl.build_metadata(step, "cpu"))
    slots = [int(step.block_table[0, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
             for p in range(27)]
    flat = cache.view(2, kv_heads, -1, d)
    keys, values = flat[0][:, slots], flat[1][:, slots]  # [kv_heads, 27, d], new ones written
    assert torch.equal(keys[:, 20:], k_new.transpose(0, 1))
    for h in range(heads):
        kv = h // (heads // kv_heads)
        for i in range(7):
            scores = (keys[kv, :21 + i] @ q[i, h]) * 0.25
            expected = torch.softmax(scores, 0) @ values[kv, :21 + i]
            torch.testing.assert_close(out[i, h * d:(h + 1) * d], expected)


def test_unknown_or_unavailable_backend_is_named():
    with pytest.raises(ValueError, match="flash"):
        make_attention_backend("flash", CPU, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="cpu-native"):
        make_attention_backend("cpu-native", CPU, 2, 64, torch.float32, kernels=None)
    assert make_attention_backend("auto", CPU, 2, 64, torch.float32).name in (
        "cpu-native", "torch")
    assert make_attention_backend("native", CPU, 2, 64, torch.float32,
                                  kernels=load_kernels()).name == "cpu-native"
