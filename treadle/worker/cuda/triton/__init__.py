"""Triton GPU kernels: paged decode and prefill attention, and the K/V cache write.

Owns the kernels only; which backend uses them, and when, is the attention backend's and
the platform's business. Importing this package needs triton (the `triton` extra); on a
machine without a GPU the kernels run under TRITON_INTERPRET=1, which is how CI tests
them. KV layout and design: docs/gpu.md.
"""

from treadle.worker.cuda.triton.attention import paged_attention
from treadle.worker.cuda.triton.decode import MAX_SPLITS, choose_num_splits, decode_attention
from treadle.worker.cuda.triton.kv_write import write_kv
from treadle.worker.cuda.triton.prefill import prefill_attention

__all__ = ["MAX_SPLITS", "choose_num_splits", "decode_attention", "paged_attention",
           "prefill_attention", "write_kv"]
