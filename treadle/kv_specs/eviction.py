"""Heavy-hitter (H2O) eviction, the engine core's half: when a request's KV is compacted,
and to how many tokens.

With `--kv-eviction h2o` a request holds at most `budget_tokens` tokens of KV: its
`recent_tokens` most recent ones and, for the rest, the heavy hitters, the tokens with
the largest attention they have received so far (summed over queries, heads and layers;
Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models", 2023). Which tokens those are only the worker can tell (it holds the
scores, worker/h2o.py); this module decides when and how many, from counts alone:

- A step that would take the request past its budget first compacts it to
  `budget - max(new tokens, stride)` tokens: the kept tokens move, in their order, to the
  front of the request's own block table, and the blocks past them are freed
  (core/kv/h2o.py `compact`). Compacting by a stride rather than by one token
  per decode step copies the kept KV once every `stride` steps, not every step; the cache
  then stays between `budget - stride` and `budget` tokens.
- A step computes at most `max_step_tokens` = (budget - recent) / 2 tokens of such a
  request (prompt chunks are cut to it), so every compaction keeps at least that many
  heavy hitters besides the recent tokens.
- Positions keep counting every computed token (rotary angles are those of the token's
  real position: keys are stored rotated); cache slots count only the kept ones
  (`Request.num_kv_tokens`).

The spec (kv_specs/specs.py `H2OSpec`) carries this budget; the manager (core/kv/h2o.py)
applies it to block tables. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EvictionBudget:
    """The H2O budget every request of an engine runs under."""

    budget_tokens: int
    recent_tokens: int
    block_size: int

    @classmethod
    def from_cache_config(cls, cache) -> "EvictionBudget | None":
        if cache.kv_eviction == "none":
            return None
        return cls(cache.kv_budget_tokens, cache.kv_recent_tokens, cache.block_size)

    @property
    def max_step_tokens(self) -> int:
        """The most tokens one step computes of a request (its prompt chunks included)."""
        return max(1, (self.budget_tokens - self.recent_tokens) // 2)

    @property
    def stride(self) -> int:
        """Tokens a compaction frees beyond the step's own: a block, or less when the
        budget is small."""
        return max(1, min(self.block_size, self.max_step_tokens))

    @property
    def max_prefix_hit_tokens(self) -> int:
        """The most prompt tokens a request takes from the prefix cache: what leaves
        room for its first step under the budget (hit tokens come with no scores)."""
        return self.budget_tokens - self.max_step_tokens

    def num_to_keep(self, num_kv_tokens: int, num_new_tokens: int) -> int | None:
        """Tokens to keep before a step adds `num_new_tokens`, or None when the request
        stays within its budget without compacting."""
        if num_kv_tokens + num_new_tokens <= self.budget_tokens:
            return None
        return self.budget_tokens - max(num_new_tokens, self.stride)

    def max_blocks(self) -> int:
        """Blocks a request holds at most."""
        return -(-self.budget_tokens // self.block_size)
