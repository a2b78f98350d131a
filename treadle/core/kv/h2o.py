"""The heavy-hitter (H2O) group's manager: full attention whose table holds a request's
kept tokens only (kv_specs/eviction.py decides when and how many; the worker, which).

Differs from full attention in three rules. A prefix hit is capped so that the first
step fits under the budget (`EvictionBudget.max_prefix_hit_tokens`). A block is
registered in the prefix cache only while its request has evicted nothing. `compact`
moves the kept tokens to the front of the table and frees the rest; a block it rewrites
is first taken out of the prefix cache (copied to a fresh block when another request
shares it), so nobody finds a block whose contents changed. No torch here.
"""

from __future__ import annotations

from treadle.core.kv.full import FullAttentionManager
from treadle.core.kv.interface import BlockHashes
from treadle.kv_specs.specs import H2OSpec
from treadle.core.outputs import KVCompaction
from treadle.request import Request


class H2OManager(FullAttentionManager):
    """Full-attention tables under an eviction budget."""

    spec: H2OSpec

    def find_longest_cache_hit(self, hashes: BlockHashes, max_blocks: int) -> int:
        cap = self.spec.budget.max_prefix_hit_tokens // self.block_size
        return super().find_longest_cache_hit(hashes, min(max_blocks, cap))

    def cache_blocks(self, request: Request, num_full_blocks: int,
                     hashes: BlockHashes) -> None:
        if request.num_evicted_tokens:
            return  # after an eviction its blocks no longer hold its prefix
        super().cache_blocks(request, num_full_blocks, hashes)

    def compact(self, request: Request, num_kept: int, num_recent: int) -> KVCompaction | None:
        """Keep `num_kept` of the request's cached tokens in the front of its table (which
        ones, the worker chooses) and free the blocks past them. Returns the step
        message's instruction, or None when a shared block cannot be copied for lack of a
        free block (nothing changes then)."""
        rid = request.request_id
        blocks = self._blocks[rid]
        num_tokens = request.num_kv_tokens
        src_block_ids = self._block_ids[rid][:self.num_blocks_for(num_tokens)]
        num_keep_blocks = self.num_blocks_for(num_kept)
        kept, tail = blocks[:num_keep_blocks], blocks[num_keep_blocks:]
        num_shared = sum(1 for b in kept if b.ref_cnt > 1)
        if num_shared > self.pool.num_free_blocks + sum(1 for b in tail if b.ref_cnt == 1):
            return None
        self.pool.free(reversed(tail))
        copies = iter(self.pool.allocate(num_shared)) if num_shared else None
        for i, block in enumerate(kept):
            if block.ref_cnt > 1:  # another request reads it as it is: rewrite a copy
                self.pool.free([block])
                kept[i] = next(copies)
            else:
                self.pool.uncache(block)
        self.replace_table(rid, kept)
        request.num_evicted_tokens += num_tokens - num_kept
        return KVCompaction(rid, num_tokens, num_kept, num_recent, src_block_ids,
                            list(self._block_ids[rid]))
