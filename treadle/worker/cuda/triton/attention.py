"""One call for a step's attention: the decode kernel on the decodes, the prefill kernel
on the rest.

Owns the split of a flat batch between the two kernels. The batch must put its decodes
(one new token each) first: requests 0 .. num_decodes - 1 have their token in rows
0 .. num_decodes - 1, and the prefill chunks follow (the runner orders a step that way).
Both kernels are launched without reading anything back from the device.
"""

from __future__ import annotations

import torch

from treadle.worker.cuda.triton.decode import decode_attention
from treadle.worker.cuda.triton.prefill import prefill_attention


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, *, num_decodes: int,
                    num_splits: int = 1, sliding_window: int | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention for every new token of a step; the inputs of paged_attention_reference.

    query: [num_tokens, num_heads, head_dim]; query_start_loc: [num_reqs + 1] int32;
    seq_lens: [num_reqs] int32; block_tables: [num_reqs, max_blocks] int32;
    key_cache/value_cache: [num_blocks, block_size, num_kv_heads, head_dim].
    num_decodes: how many leading requests have exactly one new token (host-side count).
    num_splits: the decode kernel's split-K factor (decode.choose_num_splits).
    Returns out, [num_tokens, num_heads, head_dim].
    """
    num_seqs = seq_lens.shape[0]
    if not 0 <= num_decodes <= min(num_seqs, query.shape[0]):
        raise ValueError(f"num_decodes must be in [0, {min(num_seqs, query.shape[0])}], "
                         f"got {num_decodes}")
    if out is None:
        out = torch.empty_like(query)
    if num_decodes:
        decode_attention(query[:num_decodes], key_cache, value_cache, block_tables,
                         seq_lens[:num_decodes], scale, out[:num_decodes],
                         num_splits=num_splits, sliding_window=sliding_window)
    if num_decodes < num_seqs:
        prefill_attention(query, key_cache, value_cache, block_tables[num_decodes:],
                          query_start_loc[num_decodes:], seq_lens[num_decodes:], scale, out,
                          sliding_window=sliding_window)
    return out
