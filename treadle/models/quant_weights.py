"""`QuantizedLinear`: a linear layer's weight kept quantized in memory (GGUF Q8_0, Q4_0,
Q4_1, Q4_K blocks, or INT8 made at load), with `apply(x) -> x @ W.T + b` and
`dequantize()`.

Owns which kernel path runs for how many rows (the figures behind the rule are in
`python -m treadle.bench.quant_kernel`):
- up to `dot_max_rows` rows: `dot`, int8 dot products on activations quantized per
  32-element chunk (kernels/quant_dot.c);
- up to `gemv_max_rows`: `deq` / `deq_buffered`, the weight dequantized in registers
  (kernels/quant_gemv.c): dequantized rows are reused across all the x rows of a tile,
  while the dot path pays its per-chunk scale and int->float work for every row;
- above: `prefill`, tiles of `tile_rows` weight rows dequantized into a bf16 (fp32 for
  fp32 activations) buffer and multiplied by oneDNN (`F.linear`), so the dense copy is
  never larger than one tile.
Without the C kernels (`kernels=None`) a dense copy in the activations' dtype is made on
first use and `F.linear` runs on it: slower to load and larger, same results to rounding.

It does not parse GGUF files (treadle/models/gguf*.py) nor decide the model's dtype.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.nn.functional as F

from treadle.models.quant_formats import QuantFormat, dequantize_torch, format_of, quantize_int8

DOT_MAX_ROWS = 1
"""Rows up to which the int8 dot-product path runs (see the module docstring)."""
GEMV_MAX_ROWS = 16
"""Rows up to which a GEMV path runs; above, the prefill path."""
TILE_ROWS = 256
"""Weight rows per dequantized tile of the prefill path."""


class QuantizedLinear:
    """y = x @ W.T + bias with W [out_features, in_features] kept quantized.

    `kernels`: treadle.worker.native_quant.QuantKernels (None: the torch fallback).
    """

    def __init__(self, fmt: QuantFormat | str, blocks: torch.Tensor, in_features: int,
                 scales: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 kernels=None, dot_max_rows: int = DOT_MAX_ROWS,
                 gemv_max_rows: int = GEMV_MAX_ROWS, tile_rows: int = TILE_ROWS) -> None:
        self.format = fmt if isinstance(fmt, QuantFormat) else format_of(fmt)
        row_bytes = self.format.row_bytes(in_features)
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes:
            raise ValueError(f"{self.format.name} weight with in_features {in_features} needs "
                             f"uint8 blocks [out_features, {row_bytes}], got "
                             f"{blocks.dtype} {tuple(blocks.shape)}")
        if (self.format.name == "INT8") != (scales is not None):
            raise ValueError("scales are given for INT8 weights and only for them")
        self.blocks = blocks.contiguous()
        self.in_features = in_features
        self.out_features = blocks.shape[0]
        self.scales = None if scales is None else scales.float().contiguous()
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"bias must have shape ({self.out_features},), got "
                             f"{tuple(bias.shape)}")
        self.bias = None if bias is None else bias.float().contiguous()
        self.kernels = kernels
        self.dot_max_rows = dot_max_rows
        self.gemv_max_rows = gemv_max_rows
        self.tile_rows = max(1, tile_rows)
        self._dense: torch.Tensor | None = None  # the fallback's copy
        self._bias_as: dict[torch.dtype, torch.Tensor] = {}

    @classmethod
    def from_gguf(cls, ggml_type: int | str, data, shape: tuple[int, int],
                  bias: torch.Tensor | None = None, kernels=None, copy: bool = True,
                  **rules) -> QuantizedLinear:
        """A weight from a GGUF tensor's raw blocks: `ggml_type` its GGMLQuantizationType
        (or name), `data` its bytes (numpy array, torch uint8 tensor or bytes; any shape
        of N * row_bytes bytes), `shape` (out_features, in_features) in torch order (GGUF
        lists dimensions the other way round). copy=False keeps a numpy memory map as the
        storage (no second copy in memory; never written to)."""
        fmt = format_of(ggml_type)
        if fmt.name == "INT8":
            raise ValueError("INT8 is not a GGUF type: use QuantizedLinear.quantize_int8")
        n, k = shape
        row_bytes = fmt.row_bytes(k)
        if isinstance(data, (bytes, bytearray, memoryview)):
            data = np.frombuffer(data, dtype=np.uint8)
        if isinstance(data, np.ndarray):
            array = data.view(np.uint8).reshape(-1)
            with warnings.catch_warnings():  # read-only memory maps: never written
                warnings.simplefilter("ignore", UserWarning)
                blocks = torch.from_numpy(array.copy() if copy else array)
        else:
            blocks = data.reshape(-1).view(torch.uint8)
            blocks = blocks.clone() if copy else blocks
        if blocks.numel() != n * row_bytes:
            raise ValueError(f"{fmt.name} tensor of shape {shape} needs {n * row_bytes} bytes, "
                             f"got {blocks.numel()}")
        return cls(fmt, blocks.reshape(n, row_bytes), k, bias=bias, kernels=kernels, **rules)

    @classmethod
    def quantize_int8(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      kernels=None, **rules) -> QuantizedLinear:
        """INT8 weight-only quantization of a float [out, in] weight (per output row
        symmetric scale, made here)."""
        blocks, scales = quantize_int8(weight)
        return cls("INT8", blocks, weight.shape[1], scales=scales, bias=bias, kernels=kernels,
                   **rules)

    @property
    def nbytes(self) -> int:
        """Bytes the weight holds in memory (blocks and scales; not the bias)."""
        extra = 0 if self.scales is None else self.scales.numel() * 4
        return self.blocks.numel() + extra

    def path(self, rows: int) -> str:
        """The path `apply` takes for this many rows: dot, deq, deq_buffered, prefill
        or torch (no C kernels)."""
        if self.kernels is None:
            return "torch"
        if rows <= self.dot_max_rows:
            return "dot"
        if rows <= self.gemv_max_rows:
            return "deq" if rows <= 4 else "deq_buffered"
        return "prefill"

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] (bfloat16 or float32) @ W.T + bias, in x's dtype."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features, the weight takes "
                             f"{self.in_features}")
        if x.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"quantized linear takes bfloat16 or float32 input, not {x.dtype}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        path = self.path(x2.shape[0])
        if path == "torch":
            y = F.linear(x2, self._dense_copy(x.dtype), self._bias_in(x.dtype))
        elif path == "prefill":
            y = self._prefill(x2)
        else:
            y = self.kernels.gemv(self.format.name, self.blocks, self.scales, self.in_features,
                                  x2, self.bias, path)
        return y.reshape(*lead, self.out_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as a dense [out_features, in_features] tensor (for the logits-level
        comparison against a dequantized model, and for the fallback)."""
        if self.kernels is None:
            return dequantize_torch(self.format, self.blocks, self.in_features,
                                    self.scales).to(dtype)
        out_dtype = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
        w = self.kernels.dequantize(self.format.name, self.blocks, self.scales,
                                    self.in_features, dtype=out_dtype)
        return w.to(dtype)

    def _prefill(self, x: torch.Tensor) -> torch.Tensor:
        """Many rows: dequantize tiles of weight rows and let oneDNN multiply each."""
        n, k = self.out_features, self.in_features
        y = torch.empty(x.shape[0], n, dtype=x.dtype)
        tile = torch.empty(min(self.tile_rows, n), k, dtype=x.dtype)
        bias = self._bias_in(x.dtype)
        for n0 in range(0, n, self.tile_rows):
            n1 = min(n, n0 + self.tile_rows)
            w = self.kernels.dequantize(self.format.name, self.blocks, self.scales, k,
                                        rows=(n0, n1), out=tile[:n1 - n0])
            y[:, n0:n1] = F.linear(x, w, None if bias is None else bias[n0:n1])
        return y

    def _bias_in(self, dtype: torch.dtype) -> torch.Tensor | None:
        if self.bias is None:
            return None
        if dtype not in self._bias_as:
            self._bias_as[dtype] = self.bias.to(dtype)
        return self._bias_as[dtype]

    def _dense_copy(self, dtype: torch.dtype) -> torch.Tensor:
        if self._dense is None or self._dense.dtype != dtype:
            self._dense = dequantize_torch(self.format, self.blocks, self.in_features,
                                           self.scales).to(dtype)
        return self._dense
