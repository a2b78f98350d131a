"""`QuantizedLinear` (models/quant_weights.py) and the format table (models/quant_formats.py):
the path rule per row count, apply() against the dequantized weight on every path and
without the C kernels, the torch dequantizer against gguf, the int8 quantizer, and the
clear errors for what a format cannot hold."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from quant_data import make_weight

from treadle.models.quant_formats import FORMATS, dequantize_torch, format_of, quantize_int8
from treadle.models.quant_weights import QuantizedLinear, choose_path, r16_at_every_row_count
from treadle.worker.cpu.native import load_kernels
from treadle.worker.cpu.native_quant import ISA_VARIANTS, QuantKernels, build_variant, cpu_runs

ROWS = (1, 3, 16, 17, 64, 200)


@pytest.fixture(scope="module")
def kernels() -> QuantKernels:
    built = load_kernels()
    assert built is not None, "the C kernels must build on the test machine (gcc)"
    return QuantKernels.load(built.lib)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_torch_dequantizer_matches_gguf(fmt):
    for i, (n, k) in enumerate([(3, 256), (8, 512)]):
        weight, ref = make_weight(fmt, n, k, seed=20 + i)
        got = dequantize_torch(weight.format, weight.blocks, k, weight.scales)
        torch.testing.assert_close(got, torch.from_numpy(ref), rtol=3e-7, atol=1e-9)


@pytest.fixture(scope="module", params=["native", "avx512-vnni", "avx2"])
def rule_kernels(request, kernels) -> QuantKernels:
    """Builds that take each branch of the path rule (AMX here; VNNI; neither)."""
    if request.param == "native":
        return kernels
    if not cpu_runs(request.param):
        pytest.skip(f"this CPU cannot run the {request.param} build")
    return build_variant(ISA_VARIANTS[request.param][0])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_apply_matches_dequantized_weight_on_every_path(rule_kernels, fmt):
    k = 512
    weight, ref = make_weight(fmt, 37, k, seed=1, kernels=rule_kernels)
    weight.bias = torch.randn(37)
    w = torch.from_numpy(ref)
    seen = set()
    for m in ROWS:
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(m, k).to(dtype)
            path = weight.path(m, dtype)
            seen.add(path)
            y = weight.apply(x)
            assert y.dtype == dtype and y.shape == (m, 37)
            want = F.linear(x.double(), w.double(), weight.bias.double())
            scale = x.double().abs() @ w.double().abs().T
            # dot paths: activations quantized per chunk (<= amax / 254 each); bf16:
            # weights and output rounded; fp32 elsewhere.
            rel = (1 / 100 if path in ("dot", "amx_dot", "r16")
                   else 2 ** -7 if dtype == torch.bfloat16 else 1e-5)
            assert ((y.double() - want).abs() <= rel * scale + 2 ** -8 * want.abs()).all(), (m, path)
    # the rule's ends (decode rows on int8 dot products; many rows on prefill tiles, or on
    # r16 at every row count with AVX-512 VNNI and no AMX); the middle varies by CPU
    assert seen & {"dot", "r16"}
    r16_everywhere = (rule_kernels.has_vnni and not rule_kernels.has_amx
                      and fmt in rule_kernels.r16_formats)
    assert seen == {"r16"} if r16_everywhere else "prefill" in seen


def test_path_rule():
    from types import SimpleNamespace

    amx = SimpleNamespace(has_amx=True, has_vnni=True)
    vnni = SimpleNamespace(has_amx=False, has_vnni=True)
    plain = SimpleNamespace(has_amx=False, has_vnni=False)
    rows = (1, 3, 4, 8, 16, 17, 32, 33, 128, 129, 512)
    assert [choose_path(amx, "Q8_0", m) for m in rows] == [
        "dot", "amx_dot", "dot", "amx_dot", "amx_dot", "amx_dot", "amx_dot", "amx", "amx",
        "prefill", "prefill"]
    assert [choose_path(amx, "Q4_K", m) for m in (1, 2, 3, 4, 5)] == [
        "dot", "dot", "amx_dot", "dot", "amx_dot"]
    assert [choose_path(vnni, "Q4_0", m) for m in rows[:6]] == ["dot"] * 5 + ["prefill"]
    assert [choose_path(plain, "INT8", m) for m in (1, 2, 3, 16, 17)] == [
        "dot", "dot", "deq_buffered", "deq_buffered", "prefill"]
    assert choose_path(None, "Q8_0", 1) == "torch"
    # r16 where the build runs it, for the formats it holds
    amx16 = SimpleNamespace(has_amx=True, has_vnni=True, r16_formats=("Q8_0", "Q4_0"))
    vnni16 = SimpleNamespace(has_amx=False, has_vnni=True, r16_formats=("Q8_0", "Q4_0"))
    assert [choose_path(amx16, "Q8_0", m) for m in (1, 8, 9, 24, 25, 33)] == [
        "r16", "r16", "r16", "r16", "amx_dot", "amx"]
    assert choose_path(amx16, "Q4_K", 1) == "dot"
    assert [choose_path(vnni16, "Q4_0", m) for m in (1, 16, 17, 1024)] == ["r16"] * 4
    assert [choose_path(vnni16, "Q4_K", m) for m in (1, 16, 17)] == ["dot", "dot", "prefill"]
    plain16 = SimpleNamespace(has_amx=False, has_vnni=False, r16_formats=("Q8_0", "Q4_0"),
                              has_gemm=True)
    assert [choose_path(plain16, "Q8_0", m) for m in (1, 16, 17)] == ["r16", "r16", "gemm"]
    assert [choose_path(plain16, "Q4_0", m) for m in (1, 32, 33)] == ["r16", "r16", "gemm"]
    assert choose_path(plain16, "Q4_0", 33, torch.float32) == "prefill"  # gemm: bf16 only
    assert [choose_path(plain16, "Q4_K", m) for m in (1, 3, 17)] == [
        "dot", "deq_buffered", "prefill"]


def test_fp32_input_never_takes_the_bf16_amx_tiles(kernels):
    if not kernels.has_amx:
        pytest.skip("no AMX here: the rule never picks the amx path (test_path_rule)")
    weight, ref = make_weight("Q8_0", 40, 256, seed=2, kernels=kernels)
    assert weight.path(64) == "amx" and weight.path(64, torch.float32) == "amx_dot"
    x = torch.randn(64, 256)
    y = weight.apply(x)
    assert y.dtype == torch.float32
    w = torch.from_numpy(ref).double()
    # int8 activations (amx_dot): each within amax / 254 of x
    assert ((y.double() - x.double() @ w.T).abs() <= (x.double().abs() @ w.abs().T) / 100).all()


def test_prefill_tiles_cover_every_row(kernels):
    weight, ref = make_weight("Q4_0", 1000, 256, seed=3, kernels=kernels)
    x = torch.randn(40, 256)
    want = x @ torch.from_numpy(ref).T
    for tile_rows in (1, 7, 256, 4096):
        weight.tile_rows = tile_rows
        torch.testing.assert_close(weight._prefill(x), want, rtol=1e-5, atol=1e-4)


def test_leading_dimensions_and_strided_input(kernels):
    weight, ref = make_weight("Q4_K", 20, 256, seed=4, kernels=kernels)
    x = torch.randn(2, 3, 512)[..., ::2]  # stride 2 along the features
    y = weight.apply(x)
    assert y.shape == (2, 3, 20)
    torch.testing.assert_close(y, weight.apply(x.contiguous()))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_without_kernels_torch_runs_the_same_weight(kernels, fmt):
    native, ref = make_weight(fmt, 24, 256, seed=5, kernels=kernels)
    plain = QuantizedLinear(native.format, native.blocks, 256, scales=native.scales)
    assert plain.path(1) == "torch"
    torch.testing.assert_close(plain.dequantize(), torch.from_numpy(ref), rtol=3e-7, atol=1e-9)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(6))
    want = x.double() @ torch.from_numpy(ref).double().T
    scale = x.double().abs() @ torch.from_numpy(ref).double().abs().T
    # fp32 sums of 256 products: within 1e-5 of the sum of their magnitudes (a fixed 1e-5
    # failed on one entry in 120 at 2.0e-5, an outcome of rounding, not of the weight)
    assert ((plain.apply(x).double() - want).abs() <= scale * 1e-5 + 1e-7).all()
    assert ((native.apply(x).double() - want).abs() <= scale / 100).all()


def test_int8_quantizer_error_and_padding():
    w = torch.randn(6, 33) * torch.arange(1, 7)[:, None]
    w[2] = 0.0
    blocks, scales = quantize_int8(w.to(torch.bfloat16))
    assert blocks.shape == (6, 64) and scales.shape == (6,)
    q = blocks.view(torch.int8)
    assert (q[:, 33:] == 0).all() and (q[2] == 0).all() and scales[2] == 0
    assert q.abs().max() == 127
    deq = q[:, :33].float() * scales[:, None]
    # round to nearest: within half a step (plus the fp32 roundings of w * 127 / amax)
    assert ((deq - w.to(torch.bfloat16).float()).abs() <= scales[:, None] * 0.5001 + 1e-7).all()


def test_q8_0_quantizer_is_gguf_q8_0_within_half_a_step():
    """quantize_q8_0 writes GGUF Q8_0 blocks (what gguf's own dequantizer and ours read
    back), each value within half a step of its block's scale; an all-zero block has
    scale 0; K not a multiple of 32 is refused naming the rule."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from treadle.models.quant_formats import quantize_q8_0
    w = torch.randn(5, 96) * torch.arange(1, 6)[:, None]
    w[3, :32] = 0.0
    blocks = quantize_q8_0(w.to(torch.bfloat16))
    assert blocks.shape == (5, 3 * 34) and blocks.dtype == torch.uint8
    ours = dequantize_torch(FORMATS["Q8_0"], blocks, 96, torch.float32)
    theirs = torch.from_numpy(dequantize(blocks.numpy(), GGMLQuantizationType.Q8_0)).float()
    assert torch.equal(ours, theirs.reshape(5, 96))
    step = w.reshape(5, 3, 32).abs().amax(-1) / 127
    err = (ours - w.to(torch.bfloat16).float()).abs().reshape(5, 3, 32)
    assert (err <= step[..., None] * 0.5 + step[..., None] * 2e-3 + 1e-7).all()
    assert (ours[3, :32] == 0).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(torch.randn(2, 48))


def test_formats_refuse_what_they_cannot_hold():
    with pytest.raises(ValueError, match="block of 32"):
        FORMATS["Q8_0"].check_k(48)
    with pytest.raises(ValueError, match="block of 256"):
        FORMATS["Q4_K"].row_bytes(576)  # SmolLM2's hidden size: not a Q4_K row
    FORMATS["INT8"].check_k(577)  # INT8 takes any K
    with pytest.raises(ValueError, match="supported are"):
        format_of("Q5_K")
    with pytest.raises(ValueError, match="supported are"):
        format_of(13)
    assert format_of(8).name == "Q8_0" and format_of("q4_k").name == "Q4_K"


def test_weight_object_refuses_bad_input(kernels):
    with pytest.raises(ValueError, match="block of 256"):
        QuantizedLinear.from_gguf("Q4_K", bytes(144 * 9), (4, 576))
    with pytest.raises(ValueError, match="needs 136 bytes"):
        QuantizedLinear.from_gguf("Q8_0", np.zeros(100, np.uint8), (2, 64))
    with pytest.raises(ValueError, match="not a GGUF type"):
        QuantizedLinear.from_gguf("INT8", bytes(64), (1, 64))
    with pytest.raises(ValueError, match="uint8 blocks"):
        QuantizedLinear("Q8_0", torch.zeros(2, 35, dtype=torch.uint8), 64)
    with pytest.raises(ValueError, match="scales"):
        QuantizedLinear("INT8", torch.zeros(2, 64, dtype=torch.uint8), 64)
    weight, _ = make_weight("Q8_0", 4, 64, seed=0, kernels=kernels)
    with pytest.raises(ValueError, match="65 features"):
        weight.apply(torch.randn(1, 65))
    with pytest.raises(ValueError, match="float16"):
        weight.apply(torch.randn(1, 64).half())
    with pytest.raises(ValueError, match="bias"):
        QuantizedLinear(weight.format, weight.blocks, 64, bias=torch.zeros(3))


def test_only_the_r16_copy_is_kept_where_r16_runs_at_every_row_count():
    """The rule that drops a weight's GGUF blocks agrees with the path rule: exactly
    where every row count takes r16 (VNNI without AMX, batch-invariant kernels)."""
    from types import SimpleNamespace

    r16 = ("Q8_0", "Q4_0")
    cases = {
        "vnni": (SimpleNamespace(has_amx=False, has_vnni=True, r16_formats=r16), True),
        "amx": (SimpleNamespace(has_amx=True, has_vnni=True, r16_formats=r16), False),
        "avx2": (SimpleNamespace(has_amx=False, has_vnni=False, r16_formats=r16,
                                 has_gemm=True), False),
        "invariant": (SimpleNamespace(has_amx=True, has_vnni=True, r16_formats=r16,
                                      batch_invariant=True), True),
    }
    for name, (kernels, every) in cases.items():
        assert r16_at_every_row_count(kernels, "Q8_0") == every, name
        assert all(choose_path(kernels, "Q8_0", m) == "r16" for m in range(1, 2049)) == every
        assert not r16_at_every_row_count(kernels, "Q4_K")  # a format r16 does not hold
    assert not r16_at_every_row_count(None, "Q8_0")


def test_from_gguf_views_and_sizes(kernels):
    weight, ref = make_weight("Q4_0", 8, 64, seed=6)
    raw = weight.blocks.numpy()
    for data in (raw, raw.reshape(-1), raw.tobytes(), torch.from_numpy(raw)):
        again = QuantizedLinear.from_gguf(2, data, (8, 64), kernels=kernels)
        assert torch.equal(again.dequantize(), torch.from_numpy(ref))
    shared = QuantizedLinear.from_gguf(2, raw, (8, 64), copy=False)
    assert shared.blocks.data_ptr() == torch.from_numpy(raw).data_ptr()
    assert weight.nbytes == 8 * 2 * 18
    int8 = QuantizedLinear.quantize_int8(torch.randn(3, 100))
    assert int8.nbytes == 3 * 128 + 3 * 4


@pytest.mark.parametrize("fmt", ["Q8_0", "INT8"])
def test_concat_rows_and_embedding(kernels, fmt):
    parts = [make_weight(fmt, n, 64, seed=30 + n, kernels=kernels) for n in (5, 3, 8)]
    for (w, _), b in zip(parts, (1.0, 2.0, 3.0)):
        w.bias = torch.full((w.out_features,), b)
    fused = QuantizedLinear.concat_rows([w for w, _ in parts])
    ref = torch.from_numpy(np.concatenate([r for _, r in parts]))
    assert fused.out_features == 16 and torch.equal(fused.dequantize(), ref)
    x = torch.randn(2, 64)
    y = fused.apply(x)
    for (w, _), (a, b) in zip(parts, ((0, 5), (5, 8), (8, 16))):
        torch.testing.assert_close(y[:, a:b], w.apply(x))
    ids = torch.tensor([[3, 0], [15, 3]])
    assert torch.equal(fused.embedding(ids), ref[ids])
    without_kernels = QuantizedLinear(fused.format, fused.blocks, 64, scales=fused.scales)
    assert torch.equal(without_kernels.embedding(ids), ref[ids])
    other, _ = make_weight("Q4_0", 4, 64, seed=1)
    with pytest.raises(ValueError, match="cannot fuse"):
        QuantizedLinear.concat_rows([parts[0][0], other])


def test_prefill_tiles_multiply_in_fp32_where_the_build_has_no_bf16_arithmetic(rule_kernels):
    """Without bf16 arithmetic torch's bf16 linear is emulated (several times slower than
    fp32), so bf16 activations meet fp32 tiles there; with it, bf16 tiles. Both give the
    dequantized weight's product."""
    weight, ref = make_weight("Q4_1", 40, 256, seed=3, kernels=rule_kernels)
    expected = torch.bfloat16 if rule_kernels.has_bf16 else torch.float32
    assert weight.tile_dtype(torch.bfloat16) == expected
    assert weight.tile_dtype(torch.float32) == torch.float32
    x = torch.randn(300, 256).to(torch.bfloat16)
    want = F.linear(x.double(), torch.from_numpy(ref).double())
    scale = x.double().abs() @ torch.from_numpy(ref).double().abs().T
    got = weight._prefill(x)  # what the prefill path runs (AVX2 takes `gemm` at these rows)
    assert got.dtype == torch.bfloat16
    assert ((got.double() - want).abs() <= 2 ** -7 * scale + 2 ** -8 * want.abs()).all()
