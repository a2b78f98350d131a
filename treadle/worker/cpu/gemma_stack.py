"""The Gemma 3 decode stack: every layer of a bf16 Gemma 3 model in one C call
(kernels/decode_stack.c `decode_stack_gemma_bf16`) for the steps where each row is one
decoded token: the sandwich layer's counterpart of decode_stack.py's plain Llama stack.

Layer by layer, a Gemma 3 decode step is about fifteen kernel calls per layer (four norms
around two sublayers, the per-head q/k norms, GeGLU, RoPE with one of two bases,
windowed or global attention) and the Python between them. The driver calls the same
kernels in the same order as Gemma3DecoderLayer.forward does with the native ops
(models/gemma3.py: `gemma_add_norm`, the head norms, `gelu_tanh_mul`, the backend's
rope_kv and windowed decode attention), so the hidden states are bit-identical to that
path's (tests/integration/test_gemma_stack.py).

A model qualifies when it declares its layers in the sandwich shape
(`model.sandwich_decoder()`, layers/plain_layer.py) and every linear is on the C kernels
(dense or `--quantization`), as for the plain stack (same routes: decode_stack.py
`LinearRoutes`). Each layer has a kind: global layers read the full KV group's tables
and slots and the global RoPE; local layers the sliding group's (AttentionStep.sliding,
core/kv/sliding.py) with their window and the local RoPE.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from treadle.layers.plain_layer import SandwichDecoder
from treadle.worker.cpu.decode_stack import (_Dims, _Linear, _entry, _ptr, LinearRoutes,
                                             backend_qualifies, decode_rows, layer_kernels,
                                             model_dims, rotary_fits, slots_fit)

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_GLOBAL, _LOCAL = 0, 1  # the layer kinds (decode_stack.c gemma_layer.kind)


class _GemmaLayer(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("input_norm", "post_attn_norm", "pre_ffw_norm",
                                        "post_ffw_norm", "q_norm", "k_norm")] + [
        ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
        ("k_cache", _P), ("v_cache", _P), ("num_blocks", _I64), ("window", _I64),
        ("kind", _I64)]


class _StepKind(ctypes.Structure):
    _fields_ = [("cos", _P), ("sin", _P), ("slots", _P), ("block_table", _P),
                ("cs_row", _I64), ("max_blocks", _I64)]


class GemmaDecodeStack:
    """One Gemma 3 model's layers as the C driver reads them; `__call__` runs a qualifying
    step."""

    def __init__(self, layer_ops: Any, model: Any, decoder: SandwichDecoder,
                 kernels: list[tuple], decode_split: int | None) -> None:
        self._fn = layer_ops.lib.decode_stack_gemma_bf16
        self._fn.argtypes = [_P, _I64, _P, _P, _P, _P, _I64, _P, _P, ctypes.c_int]
        self._fn.restype = ctypes.c_int
        self._final_norm = decoder.final_norm
        self._layers = (_GemmaLayer * len(decoder.layers))()
        for entry, layer, (qkv, o, gate_up, down) in zip(self._layers, decoder.layers,
                                                         kernels):
            for field, norm in (("input_norm", layer.input_norm),
                                ("post_attn_norm", layer.post_attention_norm),
                                ("pre_ffw_norm", layer.pre_feedforward_norm),
                                ("post_ffw_norm", layer.post_feedforward_norm),
                                ("q_norm", layer.q_norm), ("k_norm", layer.k_norm)):
                setattr(entry, field, _ptr(norm.weight))
            for field, kernel in (("qkv", qkv), ("o", o), ("gate_up", gate_up),
                                  ("down", down)):
                _entry(getattr(entry, field), kernel)
            entry.window = layer.window or 0
            entry.kind = _GLOBAL if layer.window is None else _LOCAL
        self._kinds = (_StepKind * 2)()
        self._cache_ptrs: tuple[int, ...] = ()
        first = decoder.layers[0]
        self._dims: _Dims = model_dims(model, first.intermediate, float(first.q_norm.eps),
                                       float(first.scale), decode_split)
        self._routes = LinearRoutes(layer_ops, kernels, self._dims)
        self.max_rows = self._routes.max_rows
        """Rows up to which a step runs here."""

    @classmethod
    def build(cls, model: Any, layer_ops: Any, attention: Any) -> GemmaDecodeStack | None:
        """The stack for `model`, or None where it does not qualify (as DecodeStack.build;
        the model declares `sandwich_decoder()`)."""
        if not backend_qualifies(model, layer_ops, attention):
            return None
        declare = getattr(model, "sandwich_decoder", None)
        decoder = declare() if declare is not None else None
        if decoder is None:
            return None
        layers = decoder.layers
        norms = [decoder.final_norm] + [n for layer in layers for n in (
            layer.input_norm, layer.post_attention_norm, layer.pre_feedforward_norm,
            layer.post_feedforward_norm, layer.q_norm, layer.k_norm)]
        if (any(n.eps != norms[0].eps or not n.weight.is_contiguous() for n in norms)
                or len({layer.scale for layer in layers}) != 1
                or len({layer.intermediate for layer in layers}) != 1):
            return None
        kernels = layer_kernels(layers, layer_ops.lib)
        if kernels is None:
            return None
        return cls(layer_ops, model, decoder, kernels, attention.decode_split)

    def _bind_caches(self, kv_caches: list[torch.Tensor]) -> bool:
        """Point the layers at this step's caches (re-done only when they moved); each
        layer's group has its own pool (the sliding layers' is smaller)."""
        ptrs = tuple(c.data_ptr() for c in kv_caches)
        if ptrs == self._cache_ptrs:
            return True
        if len(kv_caches) != len(self._layers):
            return False
        block_size = kv_caches[0].shape[3]
        for cache in kv_caches:
            if (cache.dtype != torch.bfloat16 or not cache.is_contiguous() or cache.dim() != 5
                    or cache.shape[1] != self._dims.kv_heads or cache.shape[3] != block_size
                    or cache.shape[4] != self._dims.head_dim):
                return False
        for entry, cache in zip(self._layers, kv_caches):
            entry.k_cache, entry.v_cache = cache[0].data_ptr(), cache[1].data_ptr()
            entry.num_blocks = cache.shape[2]
        self._dims.block_size = block_size
        self._cache_ptrs = ptrs
        return True

    def _set_kind(self, kind: int, rotary: Any, slots: torch.Tensor,
                  table: torch.Tensor) -> None:
        k = self._kinds[kind]
        k.cos, k.sin, k.cs_row = rotary.cos.data_ptr(), rotary.sin.data_ptr(), rotary.cos.stride(0)
        k.slots, k.block_table, k.max_blocks = slots.data_ptr(), table.data_ptr(), table.shape[1]

    def __call__(self, hidden: torch.Tensor, rotary: Any, kv_caches: list[torch.Tensor],
                 meta: Any, local_rotary: Any) -> torch.Tensor | None:
        """The final-normed hidden states [M, H] of a qualifying step (`hidden`, the
        scaled embeddings, becomes the residual stream), or None: then nothing was written
        and the caller runs its layers. rotary / local_rotary: the global and local
        layers' RotaryInputs."""
        m = hidden.shape[0]
        nd = decode_rows(hidden, meta, self.max_rows)
        if (nd is None or not rotary_fits(rotary, m, self._dims.head_dim)
                or not rotary_fits(local_rotary, m, self._dims.head_dim)
                or not slots_fit(meta.slot_mapping, m)):
            return None
        # The local layers' kernel rows over the sliding group's tables (the step's own
        # without one), one table row per kernel row as the global layers' nd: a short
        # multi-token row (a prefill's last few tokens) is a kernel row per token. Its
        # per-request table, read for every kernel row, sent the rows past the requests'
        # to another row's ids or past the array (a served Gemma 3 at 16 streams
        # segfaulted in the decode kernel).
        local_nd, local_slots = meta.sliding()
        local_table = local_nd.block_table
        if (not slots_fit(local_slots, m) or local_nd.num_rows != m
                or local_table.dtype != torch.int64 or not local_table.is_contiguous()):
            return None
        if not self._bind_caches(kv_caches):
            return None
        self._routes.set_rows(m)
        self._set_kind(_GLOBAL, rotary, meta.slot_mapping, nd.block_table)
        self._set_kind(_LOCAL, local_rotary, local_slots, local_table)
        out = torch.empty_like(hidden)
        status = self._fn(self._layers, len(self._layers), ctypes.byref(self._dims),
                          self._final_norm.weight.data_ptr(), hidden.data_ptr(),
                          out.data_ptr(), m, self._kinds, nd.ctx_lens.data_ptr(), 0)
        if status != 0:
            raise RuntimeError(f"decode_stack_gemma_bf16 failed with status {status}")
        return out
