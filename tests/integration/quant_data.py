"""Test data for the quantized-weight tests: GGUF blocks made by the gguf package's own
quantizer (Q8_0, Q4_0, Q4_1) or drawn at random (Q4_K, which gguf can only dequantize:
any bytes with finite, small fp16 scales are a valid Q4_K block), and their fp32
reference weights from gguf.quants.dequantize."""

from __future__ import annotations

import numpy as np
import torch

from treadle.models.quant_weights import QuantizedLinear


def make_weight(fmt: str, n: int, k: int, seed: int, kernels=None
                ) -> tuple[QuantizedLinear, np.ndarray]:
    """(weight object, its fp32 [n, k] reference) for a random weight in `fmt`."""
    import gguf
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(seed)
    if fmt == "INT8":
        dense = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32))
        weight = QuantizedLinear.quantize_int8(dense, kernels=kernels)
        q = weight.blocks[:, :k].view(torch.int8).double()
        return weight, (q * weight.scales.double()[:, None]).float().numpy()
    qtype = getattr(gguf.GGMLQuantizationType, fmt)
    if fmt == "Q4_K":
        blocks = rng.integers(0, 256, size=(n * k // 256, 144), dtype=np.uint8)
        for offset in (0, 2):  # d, dmin
            scale = rng.uniform(1e-3, 2e-2, size=len(blocks)).astype(np.float16)
            blocks[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
        raw = blocks.reshape(n, -1)
    else:
        raw = quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    reference = dequantize(raw, qtype).astype(np.float32).reshape(n, k)
    return QuantizedLinear.from_gguf(qtype.value, raw, (n, k), kernels=kernels), reference
