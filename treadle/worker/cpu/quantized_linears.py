"""Weight-only quantized execution (`--quantization`): the model's linear layers and LM
head on `QuantizedLinear` weights (models/quant_weights.py) and the C quantized kernels.

`gguf` takes each projection's blocks from the GGUF file as they are (Q8_0, Q4_0, Q4_1,
Q4_K; q/k/v and gate/up fused by concatenating rows, which needs one format per fused
group), `int8` quantizes the loaded weights per output row. A projection of another GGML
block type (Q5_0, Q6_K, ...), or a fused group of mixed formats, runs as Q8_0 blocks made
at load from its decoded weight (`REQUANTIZED_TYPES`): dense it read two bytes a value,
where Q8_0 reads 1.06 and holds more bits than any of those types. Measured: the
Llama-3.2-1B shape's Q4_0 file (its tied embedding and LM head Q6_K) decoded at 36.6 ms a
token, 1.11x its memory floor, against 55.8 ms with that head dense; the real Gemma 3 270M
Q4_K_M (Q5_0 q/k/v and gate/up, half its down projections Q6_K) 23.7 against 20.1 tok/s
at one stream, prefill 1,460 against 1,641 tok/s, and its greedy tokens scored
teacher-forced against the bf16 model's agreed as often either way (1,018 of 1,024;
docs/benchmarks.md). A layer whose tensors the kernels cannot hold otherwise (float
types, K that a format's block does not divide) keeps its dense kernel, and the start-up
log counts them. Activations stay in the engine's dtype; the embedding lookup stays dense (it reads
one row per token, and a tied LM head shares it). A quantized layer's dense weight is
then dropped (its parameter kept on the meta device, for its shape): nothing reads it
after this (LoRA wraps the layer's kernel, the torch fallback dequantizes its own copy),
so the weights take the memory of their blocks.

Decode steps run quantized linears inside the decode stack (worker/cpu/decode_stack.py) like
dense ones. `auto` (`resolve_mode`) is `gguf` for a GGUF file whose linears hold blocks
of the formats the r16 kernel runs (Q8_0, Q4_0, Q4_1, Q4_K), where the kernels have it (an
AVX-512 VNNI build, or AVX2 without VNNI), in bfloat16 on one CPU rank without LoRA; else
`none`. That is where it was measured faster: the engine-core run on the default model's
Q4_1 file, 528.8 / 555.7 output tok/s against 461.0 / 480.4 dequantized to bf16 on an AMX
Xeon (without r16 the quantized kernels ran at ~12 GB/s of blocks and only tied bf16;
docs/benchmarks.md, "Quantized weights in the decode stack, with AMX"), and 1.03-1.05x
the bf16 run's output tok/s on an AVX2-only AMD EPYC, the two engines stepping in turn
(docs/benchmarks.md, "A CPU with AVX2 only"). The worker decides, never the model; CPU
only, one rank (a shard of GGUF blocks is not cut).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from treadle.models.quant_formats import FORMATS, quantize_q8_0
from treadle.models.quant_weights import QuantizedLinear

logger = logging.getLogger(__name__)

_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_GGUF_FORMATS = {name for name, f in FORMATS.items() if f.ggml_type is not None}
REQUANTIZED_TYPES = frozenset({"Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K",
                               "Q6_K", "Q3_K", "Q2_K"})
"""GGML block types whose projections run as Q8_0 blocks made at load when the kernels
do not hold them as they are: Q8_0 keeps 8 bits a value per block of 32, more than any of
these hold, and reads about half a bf16 weight's bytes. Float types (F32, F16, BF16) are
not among them: a float checkpoint is not quantized behind the user's back."""


class QuantizedLinearKernel:
    """A LinearKernel (layers/linear.py) on a quantized weight: x @ W.T + bias in x's dtype."""

    def __init__(self, weight: QuantizedLinear) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight.apply(x)


@dataclass
class QuantizedModel:
    """What `attach` did: the mode, how many linears run quantized, which stayed dense."""

    mode: str
    num_quantized: int = 0
    dense: tuple[str, ...] = ()
    formats: tuple[str, ...] = ()
    quantized_bytes: int = 0
    dropped_bytes: int = 0
    """Bytes of dense weights freed (the quantized layers')."""

    def describe(self) -> str:
        text = (f"quantization {self.mode}: {self.num_quantized} linears quantized "
                f"({', '.join(self.formats)}; {self.quantized_bytes / 2**20:.1f} MiB, "
                f"{self.dropped_bytes / 2**20:.1f} MiB of dense weights freed)")
        if self.dense:
            text += f", {len(self.dense)} dense ({', '.join(self.dense[:4])}"
            text += ", ...)" if len(self.dense) > 4 else ")"
        return text


def resolve_mode(requested: str, gguf_path: Path | None, kernels=None, *,
                 dtype: torch.dtype = torch.bfloat16, world_size: int = 1,
                 lora: bool = False, has_quantized_linears: bool | None = None) -> str:
    """none, gguf or int8 for `requested` (config.QUANTIZATION_CHOICES); `auto` per the
    module docstring (kernels: worker.cpu.native_quant.QuantKernels or None).
    has_quantized_linears: whether the GGUF file holds projections in the kernels' r16
    formats, when already known (a weight cache of it exists); None: read the file."""
    if requested == "none":
        return "none"
    if requested == "auto":
        formats = getattr(kernels, "r16_formats", ())
        if (gguf_path is None or not formats or dtype != torch.bfloat16 or world_size != 1
                or lora):
            return "none"
        if has_quantized_linears is None:
            has_quantized_linears = _has_quantized_linears(gguf_path, formats)
        return "gguf" if has_quantized_linears else "none"
    if requested == "gguf" and gguf_path is None:
        raise ValueError("quantization=gguf needs a GGUF model (a .gguf file, or the "
                         "default model); use int8 to quantize another checkpoint")
    return requested


def _linears(model) -> list[tuple[str, object]]:
    """(parameter prefix, Linear) of every projection of every layer."""
    out = []
    for index, layer in model.model.layers.items():
        attn, mlp = layer.self_attn, layer.mlp
        for group, name, linear in (("self_attn", "qkv_proj", attn.qkv_proj),
                                    ("self_attn", "o_proj", attn.o_proj),
                                    ("mlp", "gate_up_proj", mlp.gate_up_proj),
                                    ("mlp", "down_proj", mlp.down_proj)):
            out.append((f"model.layers.{index}.{group}.{name}", linear))
    return out


def _bias(linear) -> torch.Tensor | None:
    bias = linear.kernel_bias  # a row-parallel layer's own bias is added after its sum
    return None if bias is None else bias.detach().float()


class _FreshWeights:
    """The quantized weights made now: a GGUF file's blocks (mode gguf), or INT8 made from
    the loaded weights (int8)."""

    def __init__(self, model, mode: str, kernels, gguf_path: Path | None) -> None:
        self.kernels = kernels
        self.raw = _gguf_rows(model, gguf_path) if mode == "gguf" else None

    def get(self, name: str, weight: torch.Tensor, bias) -> QuantizedLinear | None:
        try:
            if self.raw is None:
                return QuantizedLinear.quantize_int8(weight.detach().float(), bias,
                                                     kernels=self.kernels)
            parts = [self.raw.get(part) for part in _parts(name)]
            if any(p is None for p in parts):
                return None
            # The pieces without kernels: the final weight gets them (and the bias) once
            # below, so it is packed once and its blocks never unpacked on the way.
            if all(p.tensor_type in _GGUF_FORMATS for p in parts) and len(
                    {p.tensor_type for p in parts}) == 1:
                pieces = [QuantizedLinear.from_gguf(p.tensor_type, p.data, p.shape)
                          for p in parts]
                q = pieces[0] if len(pieces) == 1 else QuantizedLinear.concat_rows(pieces)
            elif all(p.tensor_type in REQUANTIZED_TYPES for p in parts):
                # Another GGML block type (Q5_0, Q6_K, ...) or formats that differ inside a
                # fused group: the loaded weight (those blocks decoded) as Q8_0 blocks.
                q = QuantizedLinear.from_gguf("Q8_0", quantize_q8_0(weight.detach()),
                                              tuple(weight.shape))
            else:
                return None
            return QuantizedLinear(q.format, q.blocks, q.in_features, q.scales, bias,
                                   self.kernels)
        except ValueError as exc:
            logger.info("%s stays dense: %s", name, exc)
            return None


class _CachedSource:
    """The weight cache's weights in `_FreshWeights`' place."""

    def __init__(self, cached, kernels) -> None:
        self.cached, self.kernels = cached, kernels

    def get(self, name: str, weight: torch.Tensor, bias) -> QuantizedLinear | None:
        return self.cached.get(name, tuple(weight.shape), bias, self.kernels)


def _targets(model) -> list[tuple[str, object, torch.Tensor, object]]:
    """(name, owner, dense weight, bias) of every linear to quantize and the LM head."""
    targets = [(name, linear, linear.weight, _bias(linear)) for name, linear in _linears(model)]
    if model.parallel.is_last_stage:
        head = "lm_head" if hasattr(model, "lm_head") else "model.embed_tokens"
        targets.append((head, model, model.lm_head_weight, None))
    return targets


def _make_all(targets, source) -> dict[str, QuantizedLinear | None]:
    return {name: source.get(name, weight, bias) for name, _, weight, bias in targets}


def _weights(model, mode: str, kernels, gguf_path: Path | None,
             cache: Path | None) -> dict[str, QuantizedLinear | None]:
    """Every target's quantized weight (None: stays dense), from the weight cache at
    `cache` when it holds them (worker/cpu/weight_cache.py), else made now and cached."""
    from treadle.worker.cpu import weight_cache

    targets = _targets(model)
    cached = weight_cache.CachedWeights.read(cache) if cache is not None else None
    if cached is not None:
        try:
            made = _make_all(targets, _CachedSource(cached, kernels))
            logger.info("quantized weights read from the cache %s", cache)
            return made
        except (KeyError, ValueError) as exc:
            logger.warning("the weight cache %s does not fit this model (%s): remaking it",
                           cache, exc)
    logger.info("quantizing %d linears (%s%s)%s", len(targets), mode,
                ", packed for the r16 kernel" if getattr(kernels, "r16_formats", ()) else "",
                "; cached for later starts" if cache is not None else "")
    made = _make_all(targets, _FreshWeights(model, mode, kernels, gguf_path))
    if cache is not None:
        weight_cache.write(cache, mode, {n: q for n, q in made.items() if q is not None},
                           [n for n, q in made.items() if q is None])
    return made


def attach(model, mode: str, kernels, gguf_path: Path | None,
           cache: Path | None = None) -> QuantizedModel | None:
    """Put every linear layer (and the LM head) of `model` on a quantized weight; None for
    mode none. kernels: worker.cpu.native_quant.QuantKernels (None: the torch fallback);
    cache: the weight cache's file (weight_cache.cache_path), None for none."""
    if mode == "none":
        return None
    if model.parallel.world_size != 1:
        raise ValueError(f"quantization={mode} runs on one rank (got tensor x pipeline "
                         f"parallel size {model.parallel.world_size})")
    made = _weights(model, mode, kernels, gguf_path, cache)
    report = QuantizedModel(mode)
    formats: set[str] = set()
    for name, owner, _, _ in _targets(model):
        q = made[name]
        if q is None:
            report.dense += (name,)
            continue
        if owner is model:  # the LM head: an untied one's own weight goes, a tied one embeds
            model.lm_head_kernel = QuantizedLinearKernel(q)
            if hasattr(model, "lm_head"):
                model.lm_head.kernel = model.lm_head_kernel
                report.dropped_bytes += _drop_dense(model.lm_head)
        else:
            owner.kernel = QuantizedLinearKernel(q)
            report.dropped_bytes += _drop_dense(owner)
        formats.add(q.format.name)
        report.num_quantized += 1
        report.quantized_bytes += q.nbytes
    report.formats = tuple(sorted(formats))
    return report


def _drop_dense(linear) -> int:
    """Free `linear`'s dense weight, keeping a parameter of its shape on the meta device
    (no memory; parameter counts still see it). Returns the bytes freed."""
    weight = linear.weight
    freed = weight.numel() * weight.element_size()
    linear.weight = torch.nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype,
                                                   device="meta"), requires_grad=False)
    return freed


def _parts(name: str) -> tuple[str, ...]:
    """The HF weight names a fused or plain projection is made of."""
    prefix, _, last = name.rpartition(".")
    lead = f"{prefix}." if prefix else ""
    return tuple(f"{lead}{p}.weight" for p in _FUSED.get(last, (last,)))


def _has_quantized_linears(path: Path, formats: tuple[str, ...]) -> bool:
    """Whether any projection of the GGUF file at `path` is stored in one of `formats`."""
    from treadle.models.gguf_reader import open_gguf, raw_tensors

    return any(t.hf_name.endswith("_proj.weight") and t.tensor_type in formats
               for t in raw_tensors(open_gguf(path)))


def _gguf_rows(model, path: Path | None) -> dict:
    """HF weight name -> RawTensor (rows in HF order) of the GGUF file."""
    from treadle.models.gguf_reader import hf_config, open_gguf, raw_tensors

    if path is None:
        raise ValueError("quantization=gguf needs the GGUF file the model was loaded from")
    gguf = open_gguf(path)
    return {t.hf_name: t for t in raw_tensors(gguf, hf_config(gguf))
            if t.value_transform is None}
