"""Which attention backend a worker runs: the names, what each reads, and the choice.

Backends: `cpu-native` (the C kernels, CPU: worker/cpu/native_attention.py), `triton`
(the Triton kernels: GPU, or the CPU under TRITON_INTERPRET=1 for tests:
worker/cuda/triton_attention.py), `torch` (plain torch ops, any device:
worker/attention/torch_backend.py) and `reference` (the oracle, any device:
worker/attention/reference.py). `make_attention_backend` picks the one
`--attention-backend` names, or for `auto` the platform's first that can be built here.
It stands above worker/attention/ (the interface and the device-neutral backends),
worker/cpu/ and worker/cuda/, which never import it. Models never import it: they call
layers.attention.AttentionLayer, and the step's metadata carries the backend.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from treadle.compat import backends_reading, check_attention_backend
from treadle.worker.attention.base import AttentionBackend

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "cpu-native", "triton", "torch", "reference")
ALIASES = {"native": "cpu-native"}
"""Earlier names still accepted."""
KV_CACHE_DTYPE_SUPPORT = backends_reading()
"""The `kv_cache_dtype`s each backend reads and writes (worker/kv_quant.py), as the cache
dtypes declare them (kv_specs/specs.py `CACHE_DTYPES`; triton: fp8 rows of a uint8 cache,
worker/cuda/triton/common.py)."""


def make_attention_backend(name: str, platform: Any, num_kv_heads: int, head_dim: int,
                           dtype: torch.dtype, kernels: Any = None,
                           layer_ops: Any = None,
                           kv_cache_dtype: str = "auto",
                           batch_invariant: bool = False) -> AttentionBackend:
    """The backend `name` names (`auto`: the platform's first that builds).

    `kernels` (worker.cpu.native.NativeKernels) and `layer_ops` (NativeLayerOps) are what the
    C kernels need; without them `cpu-native` cannot be built. `kv_cache_dtype`: what the
    cache stores (worker/kv_quant.py); a backend that cannot read it is skipped by `auto`
    and an error when named. `batch_invariant`: the backend's batch-invariant mode where it
    has one (cpu-native; treadle/compat.py refuses the others). Raises ValueError naming
    the backend when one asked for by name cannot run here."""
    name = ALIASES.get(name, name)
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKEND_NAMES)}, "
                         f"got {name!r}")
    wanted = platform.attention_backends if name == "auto" else (name,)
    for candidate in wanted:
        if candidate not in platform.attention_backends:
            raise ValueError(f"attention backend {candidate!r} does not run on "
                             f"{platform.name}; it has {', '.join(platform.attention_backends)}")
        if kv_cache_dtype not in KV_CACHE_DTYPE_SUPPORT[candidate]:
            if name != "auto":
                check_attention_backend(candidate, kv_cache_dtype)  # raises, naming both
            continue
        backend = _build(candidate, platform, num_kv_heads, head_dim, dtype, kernels,
                         layer_ops, kv_cache_dtype, batch_invariant)
        if backend is not None:
            return backend
        if name != "auto":
            raise ValueError(f"attention backend {candidate!r} cannot run here: "
                             + ("triton is not installed, or this CPU run is not under "
                                "TRITON_INTERPRET=1" if candidate == "triton" else
                                f"the C kernels could not be built or do not support {dtype}"))
    raise ValueError(f"no attention backend of {platform.name} runs here")


def _build(name: str, platform: Any, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
           kernels: Any, layer_ops: Any, kv_cache_dtype: str,
           batch_invariant: bool = False) -> AttentionBackend | None:
    if name == "cpu-native":
        if kernels is None or not kernels.supports(dtype):
            return None
        from treadle.worker.cpu.native_attention import CpuNativeBackend
        return CpuNativeBackend(kernels, layer_ops, num_kv_heads, head_dim, dtype,
                                kv_cache_dtype, batch_invariant)
    if name == "triton":
        from treadle.worker.cuda.triton_attention import build_triton_backend
        return build_triton_backend(platform, num_kv_heads)
    if name == "torch":
        from treadle.worker.attention.torch_backend import TorchBackend
        return TorchBackend(num_kv_heads, kv_cache_dtype)
    from treadle.worker.attention.reference import ReferenceBackend
    return ReferenceBackend(kv_cache_dtype)
