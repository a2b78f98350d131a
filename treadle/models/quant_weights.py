"""`QuantizedLinear`: a linear layer's weight kept quantized in memory (GGUF Q8_0, Q4_0,
Q4_1, Q4_K blocks, or INT8 made at load), with `apply(x) -> x @ W.T + b` and
`dequantize()`.

Owns which kernel path runs for how many rows, per what the CPU has (`choose_path`; the
figures behind it: `python -m treadle.bench.quant_kernel`, summarized in the report of
the commit that set them). Measured on a Xeon with AVX-512 BF16, VNNI and AMX, each ISA
level's build run there (one core; the AMX row counts again with 2 threads):
- AVX-512 VNNI builds, for Q8_0, Q4_0, Q4_1, INT8 and Q4_K: `r16` (kernels/quant_r16.c: the
  same int8 activations as `dot`, on a copy of the weight repacked at load with 16 rows
  per vector) up to 24 rows with AMX (AMX_R16_MAX_ROWS), at every row count without
  (prefill chunks too:
  measured on a Zen 4, 2 threads, it beat the bf16 prefill tiles at every row count from
  16 to 1,024 and every SmolLM2-135M shape: gate_up at 48 rows Q8_0 0.38 ms against
  oneDNN's packed bf16 0.50, at 1,024 rows 7.7 against 8.6-9.1 ms for the 1,024-row
  tiles; down at 1,024 4.05 against 4.2-4.4; `python -m treadle.bench.quant_kernel
  --rows 16,24,32,48,64,128,256,512,1024 --prefill`). With 2 threads on SmolLM2-135M's
  shapes it took 0.5-0.7x `dot`'s time at 1-4 rows (gate_up at 4 rows: Q4_1 0.064 ms
  against 0.122, 17 GB/s of blocks; the bf16 C kernel 0.149 ms) and 0.3-0.6x at 8-16;
  with AMX it beat `amx_dot` up to 8 rows (Q8_0 tied at 8) and lost to it at 16 on Q8_0,
  until its pass over two 16-row groups (9 rows and up for Q8_0 and INT8, 32 for the
  Q4 formats): since then, on a Xeon with AMX, 2 threads, it took 0.5-0.95x the best
  AMX path's time at 8-24 rows on every SmolLM2-135M shape and format (Q8_0 gate_up at
  16 rows 0.163 ms against `amx` 0.226; Q4_1 lm_head at 8 rows 0.46x), about even at
  32 and 1.0-1.9x from 48 (`python benchmarks/quant_kernel.py --rows
  1,2,4,8,12,16,24,32,48,64,96,128 --num-threads 2`).
  Q4_K (one 32-value sub-block a chunk, run as Q4_1 with its sub-block's scale and min)
  came later, measured on a Xeon with VNNI and no AMX, 2 threads, against the paths it
  replaced: 0.3-0.5x `dot`'s time at 1-16 rows and 0.2-0.6x the prefill tiles' at
  64-512 (Gemma 3 270M's down, 640 x 2048, at 1 row 0.034 against 0.067 ms; the 1B
  shape's down, 2048 x 8192, at 512 rows 48 against 84 ms), 1.05-1.2x Q4_1's r16 time
  at the same shape. With AMX, measured the same way later: 0.24-0.4x `amx_dot`'s time
  and 0.6-0.8x `dot`'s at 1-4 rows, 0.7-0.9x `amx_dot`'s at 16-24, 1.0-1.2x at 32 (Gemma
  3's down 640 x 2048 at 1 row 0.051 against `dot` 0.064 ms; the 1B shape's down at 8
  rows 0.76 against `amx_dot` 1.85).
- AMX: `dot` (int8 dot products, kernels/quant_dot.c) at the row counts its register
  tiles cover in one pass over the weight (1, 2 and 4 rows), else `amx_dot` (AMX-INT8
  tiles on per-chunk int8 activations), whose cost is flat from 1 to 16 rows: at 3 rows
  `dot` reads the weight twice (a 2-row and a 1-row tile) and took 1.1-1.6x `amx_dot`'s
  time, at 6-8 rows 1.3-2.3x (SmolLM2-135M's o, down and gate_up shapes, 2 threads). At
  4 rows of Q4_1 `amx_dot` won the kernel benchmark by 7% but lost the engine's 4-row
  decode steps (14.9 against 14.1 ms), so 4 rows stay on `dot` for every format.
  `amx_dot` runs to 32 rows, `amx` (dequantized bf16 tiles, AMX-BF16) to 128: from 16
  rows these are 2-3x faster than `dot`, whose per-chunk scaling is paid per row, while
  AMX pays it per 16 rows.
- AVX-512 or AVX2 with VNNI (`r16` aside): `dot` up to 16 rows; it beat the dequantize-in-register
  paths (`deq`, `deq_buffered`) by 1.5-2x at every row count there: vpdpbusd does 4
  products per lane, the bf16 / fp32 paths 2 / 1 after paying the widening.
- AVX2 without VNNI (pmaddubsw), measured on an AMD EPYC (Zen 3), 2 threads: `r16` (the
  same layout as 8-row halves, quant_r16.c) for Q8_0, Q4_0, Q4_1 and INT8 (and Q4_K: the
  AVX2 build on the VNNI Xeon beat `dot` 1.2-2x at 1-16 rows and the widening `gemm`
  at 32-128; it takes Q4_1's limit), to the rows of `PLAIN_R16_MAX_ROWS`.
  It beat `dot` at every row count from 1 to 128 and every SmolLM2-135M shape (gate_up
  at 4 rows: Q4_1 0.171 ms against 0.321, Q8_0 0.224 against 0.282; the bf16 C kernel
  0.286), and the fp32 prefill tiles up to 128 rows (gate_up at 128: Q4_1 4.0 against
  5.4 ms, Q8_0 4.9 against 7.3). Formats r16 does not hold: `dot` up to 2 rows, then
  `deq_buffered` (each block of 16 weight rows dequantized once into an L1 buffer, then
  FMA tiles) to 16 rows (measured on Q4_K before r16 held it: 15-25% faster than `dot`
  at 16, `dot` 2x faster than `deq` at 1 row).
- above those: `prefill`, tiles of `tile_rows` weight rows dequantized into a bf16
  (fp32 for fp32 activations, and where the CPU has no bf16 arithmetic: `tile_dtype`)
  buffer and multiplied by torch (`F.linear`: oneDNN, MKL), so the dense copy is never
  larger than one tile: as many rows as TILE_BYTES of bf16 hold, at least TILE_ROWS.
  1,024-row tiles cost about what dequantizing the whole weight per call costs where
  that was measured first (smaller tiles pay oneDNN's per-call overhead), but on a Xeon
  with AMX, 2 threads, SmolLM2's gate_up (3,072 x 576: three such tiles, each product
  copied into its columns of y) took 1.2-1.6x the time of one whole-weight tile at 256
  and 512 rows (Q4_0 at 512 rows 2.69 against 1.70 ms; `python benchmarks/quant_kernel.py
  --prefill`), hence the byte budget: 8 MiB holds every SmolLM2-135M projection whole and
  2,048-row tiles of the 1B shape's.
The in-register `deq` path is never chosen (it lost or tied everywhere measured); it
stays callable for measurements. Paths round differently (int8 activations on the dot
paths, bf16 weights on the bf16 ones), so a row's output depends slightly on how many
rows share the call, as the bf16 kernels' already does.

Where `r16` is the path at every row count (`r16_at_every_row_count`: AVX-512 VNNI
without AMX, or batch-invariant kernels) the GGUF blocks are not kept beside the r16 copy
(it holds the same bytes; `blocks` unpacks them for readers at load and in tests), so the
weights take the file's bytes once, not twice.

Batch-invariant kernels (`kernels.batch_invariant`, docs/batch_invariance.md) take one
path per format at every row count (`invariant_path`): each path's sums run in an order
that does not depend on the rows, but two paths' results differ in the last float bits
(even the int8 ones, whose integer sums agree: the per-chunk scalings round in another
order), so no switch between them is kept. `r16` for its formats wherever it runs (with
AMX too: it is the decode rows' fastest, at 2.4x the default's time for a 512-row
prefill's linears, `python benchmarks/quant_kernel.py`); every format where r16 does
not run: `amx_dot` with AMX, `dot` with VNNI, else the widening `gemm` (bf16
activations; `deq_buffered` for fp32 ones).
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

AMX_R16_MAX_ROWS = 24
"""With AMX: rows up to which `r16` runs, for the formats it holds (see above)."""
AMX_DOT_ROWS = (1, 2, 4)
"""With AMX: the row counts that take `dot`; the others up to AMX_DOT_MAX_ROWS take
`amx_dot`."""
AMX_DOT_MAX_ROWS = 32
"""With AMX: rows up to which `amx_dot` runs, then `amx`."""
AMX_MAX_ROWS = 128
"""With AMX: rows up to which an AMX path runs, then `prefill`."""
VNNI_DOT_MAX_ROWS = 16
"""With VNNI, no AMX: rows up to which `dot` runs (formats r16 does not hold), then
`prefill`; r16's formats take `r16` at every row count."""
PLAIN_DOT_MAX_ROWS = 2
"""Without VNNI (and r16): rows up to which `dot` runs, then `deq_buffered`."""
PLAIN_R16_MAX_ROWS = {"Q4_0": 32, "Q4_1": 32, "Q4_K": 32, "Q8_0": 16, "INT8": 16}
"""AVX2 without VNNI (pmaddubsw): rows up to which `r16` runs per format, then `gemm`
(bf16 activations) or `prefill`."""
GEMV_MAX_ROWS = 16
"""Without AMX: rows up to which a GEMV path runs, then `prefill`."""
TILE_ROWS = 1024
"""Fewest weight rows per dequantized tile of the prefill path."""
TILE_BYTES = 8 << 20
"""Bytes of bf16 a prefill tile holds by default (TILE_ROWS rows where they take more)."""


def invariant_path(kernels, fmt: str, dtype: torch.dtype = torch.bfloat16) -> str:
    """The one path batch-invariant kernels take for a `fmt` weight at every row count
    (see the module docstring)."""
    if fmt in getattr(kernels, "r16_formats", ()):
        return "r16"
    if kernels.has_amx:
        return "amx_dot"
    if kernels.has_vnni:
        return "dot"
    return ("gemm" if dtype == torch.bfloat16 and getattr(kernels, "has_gemm", False)
            else "deq_buffered")


def choose_path(kernels, fmt: str, rows: int, dtype: torch.dtype = torch.bfloat16) -> str:
    """The kernel path for `rows` rows of `dtype` activations and a `fmt` weight on
    `kernels` (see the module docstring): r16, dot, deq_buffered, amx_dot, amx, gemm,
    prefill, or torch (no kernels). The bf16 AMX tiles take bf16 activations only: fp32 ones stay on
    amx_dot there. Batch-invariant kernels: `invariant_path` whatever the rows."""
    if kernels is None:
        return "torch"
    if getattr(kernels, "batch_invariant", False):
        return invariant_path(kernels, fmt, dtype)
    r16 = fmt in getattr(kernels, "r16_formats", ())
    if kernels.has_amx:
        if r16 and rows <= AMX_R16_MAX_ROWS:
            return "r16"
        if rows in AMX_DOT_ROWS:
            return "dot"
        if rows <= AMX_DOT_MAX_ROWS:
            return "amx_dot"
        if rows > AMX_MAX_ROWS:
            return "prefill"
        return "amx" if dtype == torch.bfloat16 else "amx_dot"
    if kernels.has_vnni:
        if r16:
            return "r16"
        return "dot" if rows <= VNNI_DOT_MAX_ROWS else "prefill"
    if r16:  # AVX2 without VNNI
        if rows <= PLAIN_R16_MAX_ROWS.get(fmt, 0):
            return "r16"
        return ("gemm" if dtype == torch.bfloat16 and getattr(kernels, "has_gemm", False)
                else "prefill")
    if rows > GEMV_MAX_ROWS:
        return "prefill"
    return "dot" if rows <= PLAIN_DOT_MAX_ROWS else "deq_buffered"


def r16_at_every_row_count(kernels, fmt: str) -> bool:
    """Whether `choose_path` takes `r16` for a `fmt` weight on `kernels` whatever the rows
    (batch-invariant kernels, or AVX-512 VNNI without AMX): then nothing reads the GGUF
    blocks at run time and `QuantizedLinear` keeps only the packed copy."""
    if kernels is None or fmt not in getattr(kernels, "r16_formats", ()):
        return False
    return bool(getattr(kernels, "batch_invariant", False)
                or (kernels.has_vnni and not kernels.has_amx))


class QuantizedLinear:
    """y = x @ W.T + bias with W [out_features, in_features] kept quantized.

    `kernels`: the worker's quantized kernels (worker/cpu/native_quant.py QuantKernels;
    None: the torch fallback).
    """

    def __init__(self, fmt: QuantFormat | str, blocks: torch.Tensor, in_features: int,
                 scales: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 kernels=None, tile_rows: int | None = None,
                 packed: torch.Tensor | None = None) -> None:
        """`packed`: the r16 copy `kernels` made of these blocks before (a weight cache's,
        or another QuantizedLinear's), taken instead of packing again."""
        self.format = fmt if isinstance(fmt, QuantFormat) else format_of(fmt)
        row_bytes = self.format.row_bytes(in_features)
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes:
            raise ValueError(f"{self.format.name} weight with in_features {in_features} needs "
                             f"uint8 blocks [out_features, {row_bytes}], got "
                             f"{blocks.dtype} {tuple(blocks.shape)}")
        if (self.format.name == "INT8") != (scales is not None):
            raise ValueError("scales are given for INT8 weights and only for them")
        self.stored_blocks: torch.Tensor | None = blocks.contiguous()
        """The GGUF-layout blocks held in memory; None where the r16 copy is the only one
        (`r16_at_every_row_count`): `blocks` then unpacks them for the few readers that
        want them (the weight cache, dequantizing, fusing rows at load)."""
        self.row_bytes = row_bytes
        self.in_features = in_features
        self.out_features = blocks.shape[0]
        self.scales = None if scales is None else scales.float().contiguous()
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"bias must have shape ({self.out_features},), got "
                             f"{tuple(bias.shape)}")
        self.bias = None if bias is None else bias.float().contiguous()
        self.kernels = kernels
        self.tile_rows = (max(1, tile_rows) if tile_rows is not None
                          else max(TILE_ROWS, TILE_BYTES // (2 * in_features)))
        """Weight rows per dequantized tile of the prefill path (None: TILE_BYTES' worth)."""
        self.packed: torch.Tensor | None = None
        """The weight in the r16 layout, where the kernels run that path for this format
        (the only copy where r16 runs at every row count; else beside the blocks, which
        the other paths read)."""
        if kernels is not None and self.format.name in getattr(kernels, "r16_formats", ()):
            self.packed = (kernels.r16_pack(self.format.name, self.stored_blocks, in_features)
                           if packed is None else
                           kernels.r16_adopt(self.format.name, packed, self.out_features,
                                             in_features))
            if r16_at_every_row_count(kernels, self.format.name):
                # Measured on the real Gemma 3 270M Q4_K_M (VNNI, no AMX): 508 MiB of
                # quantized weights for a 253 MB file, half of it blocks no kernel read.
                self.stored_blocks = None
        self._dense: torch.Tensor | None = None  # the fallback's copy
        self._bias_as: dict[torch.dtype, torch.Tensor] = {}

    @property
    def blocks(self) -> torch.Tensor:
        """The weight as GGUF blocks [out_features, row_bytes] (INT8: its rows): the stored
        ones, or unpacked from the r16 copy where only that is kept (a new tensor per call:
        for load-time and test readers, not for a step)."""
        if self.stored_blocks is not None:
            return self.stored_blocks
        return self.kernels.r16_unpack(self.format.name, self.packed, self.out_features,
                                       self.in_features, self.row_bytes)

    @classmethod
    def from_gguf(cls, ggml_type: int | str, data, shape: tuple[int, int],
                  bias: torch.Tensor | None = None, kernels=None, copy: bool = True,
                  tile_rows: int | None = None) -> QuantizedLinear:
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
        return cls(fmt, blocks.reshape(n, row_bytes), k, bias=bias, kernels=kernels,
                   tile_rows=tile_rows)

    @classmethod
    def quantize_int8(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      kernels=None, tile_rows: int | None = None) -> QuantizedLinear:
        """INT8 weight-only quantization of a float [out, in] weight (per output row
        symmetric scale, made here)."""
        blocks, scales = quantize_int8(weight)
        return cls("INT8", blocks, weight.shape[1], scales=scales, bias=bias, kernels=kernels,
                   tile_rows=tile_rows)

    @classmethod
    def concat_rows(cls, weights: list[QuantizedLinear]) -> QuantizedLinear:
        """One weight whose output rows are those of `weights` in order (fused QKV or
        gate/up projections); they must share format and in_features."""
        first = weights[0]
        for w in weights[1:]:
            if w.format != first.format or w.in_features != first.in_features:
                raise ValueError(f"cannot fuse a {w.format.name} [{w.out_features}, "
                                 f"{w.in_features}] weight with a {first.format.name} [..., "
                                 f"{first.in_features}] one: dequantize or keep them apart")
        biased = [w.bias is not None for w in weights]
        if any(biased) and not all(biased):
            raise ValueError("cannot fuse weights where only some have a bias")
        scales = None if first.scales is None else torch.cat([w.scales for w in weights])
        bias = torch.cat([w.bias for w in weights]) if all(biased) else None
        return cls(first.format, torch.cat([w.blocks for w in weights]), first.in_features,
                   scales=scales, bias=bias, kernels=first.kernels, tile_rows=first.tile_rows)

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` (int64, any shape) dequantized: [*ids.shape, in_features] of dtype,
        for a quantized token-embedding table (GGUF's token_embd, tied to the LM head)."""
        flat = ids.reshape(-1)
        blocks = self.blocks[flat]
        scales = None if self.scales is None else self.scales[flat]
        if self.kernels is None:
            rows = dequantize_torch(self.format, blocks, self.in_features, scales).to(dtype)
        else:
            out_dtype = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
            rows = self.kernels.dequantize(self.format.name, blocks, scales, self.in_features,
                                           dtype=out_dtype).to(dtype)
        return rows.reshape(*ids.shape, self.in_features)


    def path(self, rows: int, dtype: torch.dtype = torch.bfloat16) -> str:
        """The path `apply` takes for this many rows of `dtype` (`choose_path`)."""
        return choose_path(self.kernels, self.format.name, rows, dtype)

    @property
    def nbytes(self) -> int:
        """Bytes the weight holds in memory (stored blocks, scales and the r16 copy; not
        the bias)."""
        extra = 0 if self.scales is None else self.scales.numel() * 4
        packed = 0 if self.packed is None else self.packed.numel()
        blocks = 0 if self.stored_blocks is None else self.stored_blocks.numel()
        return blocks + extra + packed

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
        path = self.path(x2.shape[0], x2.dtype)
        if path == "torch":
            y = F.linear(x2, self._dense_copy(x.dtype), self._bias_in(x.dtype))
        elif path == "prefill":
            y = self._prefill(x2)
        elif path == "r16":
            y = self.kernels.gemv_r16(self.format.name, self.packed, self.scales,
                                      self.out_features, self.in_features, x2, self.bias)
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
        """Many rows: dequantize tiles of weight rows and let torch multiply each (oneDNN
        in bf16; in fp32 where the CPU has no bf16 arithmetic, `tile_dtype`)."""
        n, k = self.out_features, self.in_features
        dtype = self.tile_dtype(x.dtype)
        xt = x.to(dtype)
        tile = torch.empty(min(self.tile_rows, n), k, dtype=dtype)
        bias, blocks = self._bias_in(dtype), self.blocks
        if n <= self.tile_rows:  # one tile: torch's product is the answer, no copy into y
            w = self.kernels.dequantize(self.format.name, blocks, self.scales, k,
                                        rows=(0, n), out=tile)
            return F.linear(xt, w, bias).to(x.dtype)
        y = torch.empty(x.shape[0], n, dtype=x.dtype)
        for n0 in range(0, n, self.tile_rows):
            n1 = min(n, n0 + self.tile_rows)
            w = self.kernels.dequantize(self.format.name, blocks, self.scales, k,
                                        rows=(n0, n1), out=tile[:n1 - n0])
            y[:, n0:n1] = F.linear(xt, w, None if bias is None else bias[n0:n1])
        return y

    def tile_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the prefill path multiplies `dtype` activations in: bf16 tiles where
        the kernels' build has bf16 arithmetic (then the CPU has it, and oneDNN runs bf16
        at full speed), else fp32. Without it torch's bf16 linear is emulated: on an
        AVX2-only AMD EPYC (Zen 3) 16.6 GFLOP/s against 110 in fp32 (MKL) on SmolLM2-135M's
        shapes at 256-1024 rows (`treadle.bench.peak.measure_peak_matmul`)."""
        if dtype == torch.bfloat16 and not getattr(self.kernels, "has_bf16", True):
            return torch.float32
        return dtype

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
