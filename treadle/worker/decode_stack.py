"""The decode stack: every decoder layer of a bf16 Llama-family model in one C call
(kernels/decode_stack.c) for the steps where each row is one decoded token.

Such a step runs ten small kernels per layer; between them the layer-by-layer path pays
Python (module calls, the wrappers' checks, ctypes' argument conversion) that was about
2 ms of a 20 ms four-request step of SmolLM2-135M. The C driver calls the same kernels
in the same order, so the hidden states are bit-identical to that path's
(tests/integration/test_decode_stack.py).

`DecodeStack.build` says whether a model qualifies (the plain Llama layer: no per-head
q/k norms, no sliding window or softcap, every linear on the C kernel's `DenseLinearKernel`
and so no adapters, one rank, a bf16 `cpu-native` cache); calling the stack says whether
a step does (every row a single-token decode in the kernel's row order, at most the
linear kernel's rows, no heavy-hitter observer) and returns None otherwise, when the
model runs its layers one by one as before.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from treadle.models.llama import DecoderLayer, LlamaForCausalLM
from treadle.worker.attention.cpu_native import CpuNativeBackend, CpuNativeMetadata
from treadle.worker.linear_kernels import DenseLinearKernel

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Layer(ctypes.Structure):
    _fields_ = [(name, _P) for name in (
        "input_norm", "post_norm", "qkv_w", "qkv_b", "o_w", "o_b", "gate_up_w", "gate_up_b",
        "down_w", "down_b", "k_cache", "v_cache")]


class _Dims(ctypes.Structure):
    _fields_ = [(name, _I64) for name in (
        "hidden", "heads", "kv_heads", "head_dim", "intermediate", "num_blocks",
        "block_size", "amx_first", "amx_last")] + [("eps", ctypes.c_float),
                                                   ("scale", ctypes.c_float)]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _dense(linear) -> DenseLinearKernel | None:
    """The layer's kernel when it is the C-backed dense kernel (not under an adapter)."""
    kernel = getattr(linear, "kernel", None)
    if type(kernel) is not DenseLinearKernel or kernel.native is None:
        return None
    if kernel.bias is not None and not kernel.bias.is_contiguous():
        return None
    return kernel


class DecodeStack:
    """One model's layers as the C driver reads them; `__call__` runs a qualifying step."""

    def __init__(self, layer_ops: Any, model: LlamaForCausalLM,
                 kernels: list[tuple[DenseLinearKernel, ...]]) -> None:
        lib = layer_ops.lib
        self._fn = lib.decode_stack_bf16
        self._fn.argtypes = [_P, _I64, _P, _P, _P, _P, _I64, _P, _P, _I64, _P, _P, _I64, _P,
                             ctypes.c_int]
        self._fn.restype = ctypes.c_int
        self.model = model
        layers = list(model.model.layers.values())
        self._layers = (_Layer * len(layers))()
        for entry, layer, (qkv, o, gate_up, down) in zip(self._layers, layers, kernels):
            entry.input_norm = _ptr(layer.input_layernorm.weight)
            entry.post_norm = _ptr(layer.post_attention_layernorm.weight)
            entry.qkv_w, entry.qkv_b = _ptr(qkv.weight), _ptr(qkv.bias)
            entry.o_w, entry.o_b = _ptr(o.weight), _ptr(o.bias)
            entry.gate_up_w, entry.gate_up_b = _ptr(gate_up.weight), _ptr(gate_up.bias)
            entry.down_w, entry.down_b = _ptr(down.weight), _ptr(down.bias)
        self._cache_ptrs: tuple[int, ...] = ()
        first = layers[0]
        self._dims = _Dims(hidden=model.hidden_size, heads=model.num_heads,
                           kv_heads=model.num_kv_heads, head_dim=model.head_dim,
                           intermediate=first.mlp.intermediate,
                           eps=float(first.input_layernorm.eps),
                           scale=float(first.self_attn.scale))
        # The AMX rows only when every projection fits that kernel, as the layers' own
        # calls would choose it (NativeLayerOps.linear): the same kernel for the same rows.
        shapes = [k.weight.shape for layer in kernels for k in layer]
        amx = layer_ops.amx_rows is not None and all(
            layer_ops.amx_covers(layer_ops.amx_rows[0], n, k) for n, k in shapes)
        if amx:
            self._dims.amx_first, self._dims.amx_last = layer_ops.amx_rows
        self.max_rows = layer_ops.linear_rows if amx else layer_ops.max_rows
        """Rows up to which a step runs here."""

    @classmethod
    def build(cls, model: Any, layer_ops: Any, attention: Any) -> DecodeStack | None:
        """The stack for `model`, or None where it does not qualify. layer_ops:
        worker.native_linear.NativeLayerOps (its library holds the driver); attention: the
        worker's backend."""
        if (layer_ops is None or type(attention) is not CpuNativeBackend
                or attention.layer_ops is None or attention.kv_cache_dtype != "auto"
                or not isinstance(model, LlamaForCausalLM)
                or getattr(model, "family", None) not in ("llama", "mistral", "qwen2")
                or model.dtype != torch.bfloat16 or model.parallel.world_size != 1):
            return None
        layers = list(model.model.layers.values())
        if not layers or any(type(layer) is not DecoderLayer for layer in layers):
            return None
        norms = [model.model.norm] + [n for layer in layers for n in
                                      (layer.input_layernorm, layer.post_attention_layernorm)]
        if any(n.eps != norms[0].eps or not n.weight.is_contiguous() for n in norms):
            return None
        kernels = []
        for layer in layers:
            attn = layer.self_attn
            if (attn.q_norm is not None or attn.attn.sliding_window is not None
                    or attn.attn.logit_softcap is not None):
                return None
            found = tuple(_dense(linear) for linear in (
                attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))
            if any(k is None for k in found):
                return None
            kernels.append(found)
        return cls(layer_ops, model, kernels)

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
        if (type(meta) is not CpuNativeMetadata or getattr(meta, "observer", None) is not None
                or m > self.max_rows or meta.native_prefill is not None or meta.prefill_spans
                or hidden.dtype != torch.bfloat16 or not hidden.is_contiguous()):
            return None
        nd = meta.native_decode
        if nd is None or nd.token_index is not None or nd.num_rows != m:
            return None
        cos, sin = rotary.cos, rotary.sin
        if (cos.dtype != torch.bfloat16 or cos.shape[0] != m or cos.stride(-1) != 1
                or sin.stride(-1) != 1 or cos.stride(0) != sin.stride(0)
                or cos.shape[-1] * 2 != self._dims.head_dim):
            return None
        slots = meta.slot_mapping
        if slots.dtype != torch.int64 or not slots.is_contiguous() or slots.shape != (m,):
            return None
        if not self._bind_caches(kv_caches):
            return None
        out = torch.empty_like(hidden)
        status = self._fn(self._layers, len(self._layers), ctypes.byref(self._dims),
                          self.model.model.norm.weight.data_ptr(), hidden.data_ptr(),
                          out.data_ptr(), m, cos.data_ptr(), sin.data_ptr(), cos.stride(0),
                          slots.data_ptr(), nd.block_table.data_ptr(), nd.block_table.shape[1],
                          nd.ctx_lens.data_ptr(), 0)
        if status != 0:
            raise RuntimeError(f"decode_stack_bf16 failed with status {status}")
        return out
