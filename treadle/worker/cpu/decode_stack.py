"""The decode stack: every decoder layer of a bf16 Llama-family model in one C call
(kernels/decode_stack.c) for the steps where each row is one decoded token.

Such a step runs ten small kernels per layer; between them the layer-by-layer path pays
Python (module calls, the wrappers' checks, ctypes' argument conversion) that was about
2 ms of a 20 ms four-request step of SmolLM2-135M. The C driver calls the same kernels
in the same order, so the hidden states are bit-identical to that path's
(tests/integration/test_decode_stack.py).

`DecodeStack.build` says whether a model qualifies: the model declares its layers plain
(`model.plain_decoder()`, layers/plain_layer.py: the plain Llama layer, no per-head q/k
norms, no sliding window or softcap; the stack never looks at the model's classes), and
here every linear is on the C kernel's `DenseLinearKernel` or on a quantized weight with
the same library's kernels (`--quantization`), and so no adapters, one rank, a bf16
`cpu-native` cache; calling the stack says whether a step
does (every row a single-token decode in the kernel's row order, at most the linear
kernels' rows, no heavy-hitter observer) and returns None otherwise, when the model runs
its layers one by one as before. A quantized linear runs the path `QuantizedLinear.apply`
would choose for the step's rows (models/quant_weights.py `choose_path`), so quantized
models stay bit-identical to their layer-by-layer run too. With batch-invariant kernels
(docs/batch_invariance.md) the attention's context split is the backend's fixed one
(`decode_split`), and a model whose dense weights those kernels would route one by one
(a shape the AMX kernel does not take, a weight without its packed copy) is not run here.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from treadle.layers.plain_layer import PlainDecoder
from treadle.models.quant_weights import QuantizedLinear, choose_path
from treadle.worker.cpu.linear_kernels import DenseLinearKernel
from treadle.worker.cpu.native_attention import CpuNativeBackend, CpuNativeMetadata
from treadle.worker.cpu.native_quant import FORMAT_CODES
from treadle.worker.cpu.quantized_linears import QuantizedLinearKernel

_P, _I64 = ctypes.c_void_p, ctypes.c_int64

QUANT_PATH_CODES = {"dot": 0, "amx_dot": 1, "amx": 2, "deq": 3, "deq_buffered": 4, "r16": 5,
                    "gemm": 6}
"""The quantized kernel paths the C driver calls (decode_stack.c's QP_*); a step whose
rows would take another path (prefill, torch) runs layer by layer."""
_MAX_QUANT_ROWS = 256  # rows up to which the stack looks for quantized paths it can call
_VNNI_MAX_ROWS = 1 << 16  # dense linears on the packed GEMM: no row limit of the kernel's


class _Linear(ctypes.Structure):
    _fields_ = [("w", _P), ("bias", _P), ("scales", _P), ("packed", _P), ("row_bytes", _I64),
                ("fmt", _I64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _Linear), ("o", _Linear),
                ("gate_up", _Linear), ("down", _Linear), ("k_cache", _P), ("v_cache", _P)]


class _Dims(ctypes.Structure):
    _fields_ = [(name, _I64) for name in (
        "hidden", "heads", "kv_heads", "head_dim", "intermediate", "num_blocks",
        "block_size", "amx_first", "amx_last", "widen_first", "vnni")] + [
        ("quant_path", _I64 * len(FORMAT_CODES)), ("eps", ctypes.c_float),
        ("scale", ctypes.c_float), ("decode_split", _I64)]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _kernel(linear, lib) -> DenseLinearKernel | QuantizedLinear | None:
    """What the driver runs for `linear`: its C-backed dense kernel, or its quantized
    weight when that runs on `lib`'s kernels; None for anything else (an adapter's
    kernel, torch's layers, another library)."""
    kernel = getattr(linear, "kernel", None)
    if type(kernel) is QuantizedLinearKernel:
        q = kernel.weight
        if q.kernels is None or q.kernels.lib is not lib:
            return None
        return q
    if type(kernel) is not DenseLinearKernel or kernel.native is None:
        return None
    if kernel.bias is not None and not kernel.bias.is_contiguous():
        return None
    return kernel


def _entry(entry: _Linear, kernel: DenseLinearKernel | QuantizedLinear) -> None:
    if isinstance(kernel, QuantizedLinear):
        # No stored blocks: r16 runs at every row count, and the driver reads `packed` only
        entry.w = _ptr(kernel.stored_blocks) or kernel.packed.data_ptr()
        entry.bias, entry.scales = _ptr(kernel.bias), _ptr(kernel.scales)
        entry.packed = _ptr(kernel.packed)
        entry.row_bytes, entry.fmt = kernel.row_bytes, FORMAT_CODES[kernel.format.name]
    else:
        entry.w, entry.bias, entry.scales = kernel.weight.data_ptr(), _ptr(kernel.bias), None
        entry.packed = _ptr(kernel.vnni)  # the packed GEMM's copy, where there is one
        entry.row_bytes, entry.fmt = 0, -1


def _quant_paths(quantized: list[QuantizedLinear]) -> list[tuple[int, ...]]:
    """Per row count m (index m - 1): each format's path code, up to the first m where a
    format in use takes a path the driver does not call."""
    if not quantized:
        return []
    kernels, names = quantized[0].kernels, {q.format.name for q in quantized}
    table = []
    for m in range(1, _MAX_QUANT_ROWS + 1):
        codes = [0] * len(FORMAT_CODES)
        for name in names:
            path = choose_path(kernels, name, m, torch.bfloat16)
            if path not in QUANT_PATH_CODES:
                return table
            codes[FORMAT_CODES[name]] = QUANT_PATH_CODES[path]
        table.append(tuple(codes))
    return table


def backend_qualifies(model: Any, layer_ops: Any, attention: Any) -> bool:
    """Whether the worker's kernels and backend are the driver's: the C layer ops, the
    cpu-native backend on a bf16 cache, a bf16 model on one rank."""
    return not (layer_ops is None or type(attention) is not CpuNativeBackend
                or attention.layer_ops is None or attention.kv_cache_dtype != "auto"
                or model.dtype != torch.bfloat16 or model.parallel.world_size != 1)


def decode_rows(hidden: torch.Tensor, meta: Any, max_rows: int) -> Any:
    """The step's decode-kernel rows (NativeDecode) when the step qualifies: every row one
    decoded token in the kernel's row order, at most max_rows, no heavy-hitter observer,
    contiguous bf16 hidden states; else None."""
    m = hidden.shape[0]
    if (type(meta) is not CpuNativeMetadata or getattr(meta, "observer", None) is not None
            or m > max_rows or meta.native_prefill is not None or meta.prefill_spans
            or hidden.dtype != torch.bfloat16 or not hidden.is_contiguous()):
        return None
    nd = meta.native_decode
    if nd is None or nd.token_index is not None or nd.num_rows != m:
        return None
    return nd


def rotary_fits(rotary: Any, m: int, head_dim: int) -> bool:
    """Whether RotaryInputs' cos / sin are the [m, head_dim / 2] bf16 rows rope_kv reads."""
    cos, sin = rotary.cos, rotary.sin
    return not (cos.dtype != torch.bfloat16 or cos.shape[0] != m or cos.stride(-1) != 1
                or sin.stride(-1) != 1 or cos.stride(0) != sin.stride(0)
                or cos.shape[-1] * 2 != head_dim)


def slots_fit(slots: torch.Tensor, m: int) -> bool:
    return slots.dtype == torch.int64 and slots.is_contiguous() and slots.shape == (m,)


def model_dims(model: Any, intermediate: int, eps: float, scale: float,
               decode_split: int | None) -> _Dims:
    """The driver's sizes of `model` (its routes are LinearRoutes')."""
    return _Dims(hidden=model.hidden_size, heads=model.num_heads,
                 kv_heads=model.num_kv_heads, head_dim=model.head_dim,
                 intermediate=intermediate, eps=eps, scale=scale,
                 decode_split=-1 if decode_split is None else decode_split)


def layer_kernels(layers: Any, lib: Any) -> list[tuple] | None:
    """Each layer's (qkv, o, gate_up, down) kernels the driver calls, or None when one of
    them is not on `lib`'s kernels."""
    kernels = []
    for layer in layers:
        found = tuple(_kernel(linear, lib)
                      for linear in (layer.qkv, layer.o, layer.gate_up, layer.down))
        if any(k is None for k in found):
            return None
        kernels.append(found)
    return kernels


class LinearRoutes:
    """Which kernel the driver runs each linear on, set in `dims` as the layers' own calls
    would choose it (NativeLayerOps.linear, QuantizedLinear.apply), and up to how many rows
    a step qualifies (`max_rows`)."""

    def __init__(self, layer_ops: Any, kernels: list[tuple], dims: _Dims) -> None:
        self._dims = dims
        flat = [k for layer in kernels for k in layer]
        dense = [k for k in flat if isinstance(k, DenseLinearKernel)]
        self._quant_paths = _quant_paths([k for k in flat if isinstance(k, QuantizedLinear)])
        self._paths_for = 0  # the rows whose paths dims holds
        # The AMX rows only when every projection fits that kernel, as the layers' own
        # calls would choose it (NativeLayerOps.linear): the same kernel for the same rows.
        amx = layer_ops.amx_rows is not None and all(
            layer_ops.amx_covers(layer_ops.amx_rows[0], *k.weight.shape) for k in dense)
        if amx:
            dims.amx_first, dims.amx_last = layer_ops.amx_rows
        if layer_ops.gemm_rows is not None:  # the rows NativeLayerOps.linear gives it
            dims.widen_first = layer_ops.gemm_rows
        # The packed GEMM at every row count, as NativeLayerOps.linear runs it for a weight
        # with its packed copy: only when every dense projection has one.
        vnni = bool(dense) and all(layer_ops.packed_fits(k.vnni, k.weight) for k in dense)
        dims.vnni = int(vnni)
        limits = ([_VNNI_MAX_ROWS if vnni else layer_ops.linear_rows if amx
                   else layer_ops.max_rows] if dense else [])
        if dense and layer_ops.batch_invariant and not (
                amx if layer_ops.amx_rows is not None else vnni or not layer_ops.vnni):
            # Batch-invariant ops route each weight alone (AMX or packed where it has
            # them, the widening GEMM otherwise); the driver routes all alike: not here.
            limits.append(0)
        if len(dense) < len(flat):
            limits.append(len(self._quant_paths))
        self.max_rows = min(limits)

    def set_rows(self, m: int) -> None:
        """Set the quantized formats' paths for a step of m rows."""
        if self._quant_paths and self._paths_for != m:
            self._dims.quant_path[:] = self._quant_paths[m - 1]
            self._paths_for = m


class DecodeStack:
    """One model's layers as the C driver reads them; `__call__` runs a qualifying step."""

    def __init__(self, layer_ops: Any, model: Any, plain: PlainDecoder,
                 kernels: list[tuple[DenseLinearKernel | QuantizedLinear, ...]],
                 decode_split: int | None = None) -> None:
        lib = layer_ops.lib
        self._fn = lib.decode_stack_bf16
        self._fn.argtypes = [_P, _I64, _P, _P, _P, _P, _I64, _P, _P, _I64, _P, _P, _I64, _P,
                             ctypes.c_int]
        self._fn.restype = ctypes.c_int
        self._final_norm = plain.final_norm
        self._layers = (_Layer * len(plain.layers))()
        for entry, layer, (qkv, o, gate_up, down) in zip(self._layers, plain.layers, kernels):
            entry.input_norm = _ptr(layer.input_norm.weight)
            entry.post_norm = _ptr(layer.post_attention_norm.weight)
            _entry(entry.qkv, qkv)
            _entry(entry.o, o)
            _entry(entry.gate_up, gate_up)
            _entry(entry.down, down)
        self._cache_ptrs: tuple[int, ...] = ()
        first = plain.layers[0]
        self._dims = model_dims(model, first.intermediate, float(first.input_norm.eps),
                                float(first.scale), decode_split)
        self._routes = LinearRoutes(layer_ops, kernels, self._dims)
        self.max_rows = self._routes.max_rows
        """Rows up to which a step runs here."""

    @classmethod
    def build(cls, model: Any, layer_ops: Any, attention: Any) -> DecodeStack | None:
        """The stack for `model`, or None where it does not qualify. layer_ops:
        worker.cpu.native_linear.NativeLayerOps (its library holds the driver); attention: the
        worker's backend."""
        if not backend_qualifies(model, layer_ops, attention):
            return None
        plain_decoder = getattr(model, "plain_decoder", None)
        plain = plain_decoder() if plain_decoder is not None else None
        if plain is None:
            return None
        norms = [plain.final_norm] + [n for layer in plain.layers for n in
                                      (layer.input_norm, layer.post_attention_norm)]
        if any(n.eps != norms[0].eps or not n.weight.is_contiguous() for n in norms):
            return None
        kernels = layer_kernels(plain.layers, layer_ops.lib)
        if kernels is None:
            return None
        return cls(layer_ops, model, plain, kernels, attention.decode_split)

    def _bind_caches(self, kv_caches: list[torch.Tensor]) -> bool:
        """Point the layers at this step's caches (re-done only when they moved)."""
        ptrs = tuple(c.data_ptr() for c in kv_caches)
        if ptrs == self._cache_ptrs:
            return True
        first = kv_caches[0]
        if len(kv_caches) != len(self._layers) or any(
                c.dtype != torch.bfloat16 or not c.is_contiguous() or c.dim() != 5
                or c.shape != first.shape for c in kv_caches):
            return False
        _, kv_heads, num_blocks, block_size, head_dim = first.shape
        if kv_heads != self._dims.kv_heads or head_dim != self._dims.head_dim:
            return False
        for entry, cache in zip(self._layers, kv_caches):
            entry.k_cache, entry.v_cache = cache[0].data_ptr(), cache[1].data_ptr()
        self._dims.num_blocks, self._dims.block_size = num_blocks, block_size
        self._cache_ptrs = ptrs
        return True

    def __call__(self, hidden: torch.Tensor, rotary: Any, kv_caches: list[torch.Tensor],
                 meta: Any) -> torch.Tensor | None:
        """The final-normed hidden states [M, H] of a qualifying step (`hidden`, the
        embedded tokens, becomes the residual stream), or None: then nothing was written
        and the caller runs its layers."""
        m = hidden.shape[0]
        nd = decode_rows(hidden, meta, self.max_rows)
        if (nd is None or not rotary_fits(rotary, m, self._dims.head_dim)
                or not slots_fit(meta.slot_mapping, m)):
            return None
        cos, sin, slots = rotary.cos, rotary.sin, meta.slot_mapping
        if not self._bind_caches(kv_caches):
            return None
        self._routes.set_rows(m)
        out = torch.empty_like(hidden)
        status = self._fn(self._layers, len(self._layers), ctypes.byref(self._dims),
                          self._final_norm.weight.data_ptr(), hidden.data_ptr(),
                          out.data_ptr(), m, cos.data_ptr(), sin.data_ptr(), cos.stride(0),
                          slots.data_ptr(), nd.block_table.data_ptr(), nd.block_table.shape[1],
                          nd.ctx_lens.data_ptr(), 0)
        if status != 0:
            raise RuntimeError(f"decode_stack_bf16 failed with status {status}")
        return out
