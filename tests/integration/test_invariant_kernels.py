"""The batch-invariant kernels alone (docs/batch_invariance.md): each kernel a
batch-invariant engine runs gives a row the same bits whatever other rows share the call
(1 row or 300, a row anywhere in the batch): the bf16 linear kernels (AMX tiles, the
packed vdpbf16ps GEMM, the widening GEMM) with the LM head's float32 and argmax outputs,
the quantized paths `invariant_path` picks, on every ISA level this CPU executes
(native_quant.ISA_VARIANTS), and the decode-attention kernel with its fixed context
split. The engine's logprobs: test_batch_invariance.py."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from treadle.models.quant_weights import QuantizedLinear, choose_path, invariant_path
from treadle.worker.cpu.native_linear import NativeLayerOps
from treadle.worker.cpu.native_quant import ISA_VARIANTS, QuantKernels, build_variant, cpu_runs

ROW_COUNTS = (1, 2, 3, 5, 16, 17, 63, 64, 65, 129, 300)
"""Prefixes of a 300-row batch compared with the whole call (the kernels' tile edges)."""


def assert_rows_invariant(fn, x: torch.Tensor) -> torch.Tensor:
    """fn's rows of x alone, in every prefix of the batch and from its middle are the bits
    of the whole call; returns the whole call's result."""
    full = fn(x)
    for m in ROW_COUNTS:
        if m <= x.shape[0]:
            assert torch.equal(fn(x[:m]), full[:m]), f"rows 0..{m} differ from the full call"
    for r in (4, 70, x.shape[0] - 1):
        assert torch.equal(fn(x[r:r + 1]), full[r:r + 1]), f"row {r} alone differs"
    assert torch.equal(fn(x[40:200]), full[40:200])
    return full


def reference(x, w, b):
    return F.linear(x.float(), w.float(), None if b is None else b.float())


def invariant_choices(lib) -> dict[str, NativeLayerOps]:
    """The kernel each kind of CPU runs batch-invariant, as far as this build can run it:
    what `load` picks here, the packed GEMM (a CPU with vdpbf16ps and no AMX) and the
    widening GEMM (one without bf16 instructions), each forced."""
    picked = NativeLayerOps.load(lib, batch_invariant=True)
    if picked is None:
        return {}
    choices = {"picked": picked,
               "widening": NativeLayerOps(lib, 1 << 62, None, 1, False, batch_invariant=True)}
    lib.gemm_bf16_vnni_available.restype = ctypes.c_int
    if lib.kernels_have_dpbf16() and lib.gemm_bf16_vnni_available():
        choices["packed"] = NativeLayerOps(lib, 1 << 62, None, 1, True, batch_invariant=True)
    return choices


@pytest.mark.parametrize("n, k", [(960, 576), (100, 577), (512, 128)])
def test_linear_kernels_give_a_row_the_same_bits_in_any_batch(level_kernels, kernel_level, n, k):
    choices = invariant_choices(level_kernels.lib)
    if not choices:
        pytest.skip(f"the {kernel_level} build has no vector unit (batch_invariant is refused)")
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    x = torch.randn(300, k, generator=gen).to(torch.bfloat16)
    for name, ops in choices.items():
        packed = ops.pack(w)
        full = assert_rows_invariant(lambda v: ops.linear(v, w, b, packed=packed), x)
        torch.testing.assert_close(full.float(), reference(x, w, b), rtol=2 ** -7, atol=1e-2)
        if packed is not None:  # the LM head's float32 logits and greedy choice: the same
            assert torch.equal(ops.linear_float(x, w, b, packed), full.float())
            assert torch.equal(ops.argmax(x, w, b, packed), full.float().argmax(-1))


def test_picked_kernel_per_cpu(level_kernels):
    """AMX tiles where the CPU has them (whatever oneDNN is capped to), the packed GEMM with
    vdpbf16ps alone, the widening GEMM without bf16 instructions: never a row limit."""
    ops = NativeLayerOps.load(level_kernels.lib, batch_invariant=True)
    if ops is None:
        pytest.skip("this build has no vector unit")
    lib = level_kernels.lib
    lib.gemm_bf16_amx_available.restype = ctypes.c_int
    if level_kernels.has_dpbf16 and lib.gemm_bf16_amx_available():
        assert ops.amx_rows[0] == 1 and ops.amx_rows[1] >= 1 << 40 and ops.max_rows == 0
    elif level_kernels.has_dpbf16:
        assert ops.vnni and ops.gemm_rows == 1
    else:
        assert not ops.vnni and ops.amx_rows is None and ops.gemm_rows == 1
    assert ops.batch_invariant and "batch-invariant" in ops.describe()


@pytest.fixture(scope="module", params=["native", *ISA_VARIANTS])
def quant_kernels(request):
    if request.param == "native":
        from treadle.worker.cpu.native import load_kernels
        kernels = QuantKernels.load(load_kernels().lib, batch_invariant=True)
    elif not cpu_runs(request.param):
        pytest.skip(f"this CPU does not run the {request.param} build")
    else:
        kernels = build_variant(ISA_VARIANTS[request.param][0])
        kernels.batch_invariant = True
    return kernels


def random_weight(fmt: str, n: int, k: int, kernels, seed: int) -> QuantizedLinear:
    """A valid random weight of `fmt` (small finite scales) on `kernels`."""
    from treadle.models.quant_formats import FORMATS

    gen = torch.Generator().manual_seed(seed)
    if fmt == "INT8":
        return QuantizedLinear.quantize_int8(torch.randn(n, k, generator=gen), kernels=kernels)
    spec = FORMATS[fmt]
    raw = torch.randint(0, 256, (n, k // spec.block_elems, spec.block_bytes), generator=gen,
                        dtype=torch.uint8)
    scales = (torch.rand(n, k // spec.block_elems, 2, generator=gen) * 0.01 + 0.001).half()
    raw[..., 0:4] = scales.view(torch.uint8).reshape(n, k // spec.block_elems, 4)
    if fmt == "Q8_0":
        raw[..., 2:] = torch.randint(-127, 128, raw[..., 2:].shape, generator=gen,
                                     dtype=torch.int8).view(torch.uint8)
    bias = torch.randn(n, generator=gen)
    return QuantizedLinear(fmt, raw.reshape(n, -1).contiguous(), k, bias=bias, kernels=kernels)


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "INT8"])
def test_quantized_weights_take_one_path_at_every_row_count(quant_kernels, fmt):
    k = 256
    weight = random_weight(fmt, 80, k, quant_kernels, seed=len(fmt))
    path = invariant_path(quant_kernels, fmt)
    assert {choose_path(quant_kernels, fmt, m) for m in (1, 4, 9, 33, 129, 4096)} == {path}
    if fmt in quant_kernels.r16_formats:
        assert path == "r16"
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    assert_rows_invariant(weight.apply, x)


def test_default_kernels_keep_their_row_rule(quant_kernels):
    """Without the mode the path still follows the rows (the default's speed)."""
    quant_kernels.batch_invariant = False
    try:
        paths = {choose_path(quant_kernels, "Q4_1", m) for m in (1, 4, 9, 33, 129, 4096)}
    finally:
        quant_kernels.batch_invariant = True
    assert len(paths) >= 2 or quant_kernels.has_vnni and not quant_kernels.has_amx


def decode_case(ctx_lens: list[int], seed: int = 0, heads: int = 4, kv_heads: int = 2,
                head_dim: int = 64, block_size: int = 16):
    """Queries, a cache over shuffled blocks and block tables for these contexts."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [(c + block_size - 1) // block_size for c in ctx_lens]
    num_blocks = sum(blocks) + 2
    kc = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen).bfloat16()
    vc = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen).bfloat16()
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(ctx_lens), max(blocks), dtype=torch.int64)
    used = 0
    for i, nb in enumerate(blocks):
        table[i, :nb] = perm[used:used + nb]
        used += nb
    q = torch.randn(len(ctx_lens), heads, head_dim, generator=gen).bfloat16()
    return q, kc, vc, table, torch.tensor(ctx_lens, dtype=torch.int64)


def run_decode(kernels, q, kc, vc, table, ctx, rows, split):
    index = torch.tensor(rows, dtype=torch.int64)
    out = torch.empty(len(rows), *q.shape[1:], dtype=torch.bfloat16)
    kernels.paged_decode(q.index_select(0, index).contiguous(), kc, vc,
                         table.index_select(0, index).contiguous(), ctx.index_select(0, index),
                         out, 0.125, split)
    return out


def test_decode_kernel_fixed_split_gives_a_row_the_same_bits_in_any_batch(level_kernels):
    """With the fixed split every context is cut at the same positions whether its row runs
    alone (where the batch-suited split cuts a long context for the threads) or among
    many rows (where it does not): the same bits; and it is the attention still."""
    lens = [1, 15, 16, 17, 255, 256, 257, 700, 1000, 2049]
    q, kc, vc, table, ctx = decode_case(lens)
    everyone = list(range(len(lens))) * 3  # many rows: no context split by the batch rule
    together = run_decode(level_kernels, q, kc, vc, table, ctx, everyone, 256)
    for i in range(len(lens)):
        alone = run_decode(level_kernels, q, kc, vc, table, ctx, [i], 256)
        assert torch.equal(alone[0], together[i]), f"context {lens[i]}"
        pair = run_decode(level_kernels, q, kc, vc, table, ctx, [len(lens) - 1 - i, i], 256)
        assert torch.equal(pair[1], together[i])
    # No split at all is a fixed rule too.
    whole = run_decode(level_kernels, q, kc, vc, table, ctx, everyone, 0)
    assert torch.equal(run_decode(level_kernels, q, kc, vc, table, ctx, [9], 0)[0], whole[9])
    torch.testing.assert_close(whole.float(), together.float(), rtol=2e-2, atol=2e-2)
    reference = decode_reference(q[9], kc, vc, table[9], int(ctx[9]))
    torch.testing.assert_close(together[9].float(), reference, rtol=2e-2, atol=2e-2)


def decode_reference(q, kc, vc, table, ctx):
    pos = torch.arange(ctx)
    block_size = kc.shape[2]
    k = kc[:, table[pos // block_size], pos % block_size].float()  # [kv_heads, ctx, d]
    v = vc[:, table[pos // block_size], pos % block_size].float()
    group = q.shape[0] // kc.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    probs = torch.softmax(q.float()[:, None, :] @ k.transpose(1, 2) * 0.125, dim=-1)
    return (probs @ v)[:, 0]


def test_decode_kernel_rows_are_any_position_of_a_prompt(level_kernels):
    """A prompt's tokens as decode rows (what a batch-invariant step does with its prefill
    rows): each row's bits are those of the same position decoded alone."""
    q, kc, vc, table, _ = decode_case([300], seed=3)
    q = torch.randn(300, *q.shape[1:], generator=torch.Generator().manual_seed(4)).bfloat16()
    table = table.expand(300, -1).contiguous()
    ctx = torch.arange(1, 301, dtype=torch.int64)
    together = run_decode(level_kernels, q, kc, vc, table, ctx, list(range(300)), 256)
    for i in (0, 15, 16, 255, 256, 299):
        assert torch.equal(run_decode(level_kernels, q, kc, vc, table, ctx, [i], 256)[0],
                           together[i])
