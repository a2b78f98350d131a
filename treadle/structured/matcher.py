"""Per-request grammar state and the per-step token masks of a batch.

Owns `StructuredRequest` (one request's llguidance matcher: fill the allowed-token
bitmask of the next position, accept sampled tokens, roll back k tokens for speculative
decoding, `sync` to a request's authoritative token list after preemption or a
rejected draft), `BitmaskFiller` (every constrained row of a step in one llguidance call
that drops the GIL and runs on its own threads, optionally submitted to a thread so that
it runs while the forward pass does) and `apply_bitmask_` (torch: disallowed logits to
-inf, constrained rows only).

The state of a request is exactly its accepted tokens (`accepted`): whoever loses the
matcher (a new worker process, a request moved elsewhere) rebuilds it with
`GrammarCompiler.new_request(spec)` and `sync(output_token_ids)`. It never samples and
never decides when a request ends: `is_terminated()` tells the engine that the grammar
allows nothing but end-of-sequence.

Bitmask layout (llguidance's and xgrammar's): int32 [rows, ceil(vocab / 32)], bit j of
word w allows token 32 * w + j.
"""

from __future__ import annotations

import concurrent.futures
from typing import Sequence

import torch


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed bitmask: int32 [num_rows, ceil(vocab / 32)]."""
    return torch.full((num_rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


class StructuredRequest:
    """One request's position in its grammar."""

    def __init__(self, matcher, vocab_size: int, eos_token_ids: Sequence[int], spec) -> None:
        """Made by GrammarCompiler.new_request; `matcher` is the request's own copy."""
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.spec = spec
        self.accepted: list[int] = []
        """Every token accepted so far (the whole state: see `sync`)."""

    # ----- masks ---------------------------------------------------------------------------

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the allowed tokens of the next position into `row` (int32, contiguous,
        CPU, ceil(vocab / 32) words). A terminated request allows only end-of-sequence."""
        _check_row(row, self.vocab_size)
        if self._matcher.is_stopped():
            _eos_only(row, self.eos_token_ids)
            return
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def allowed_token_ids(self) -> list[int]:
        """The allowed tokens as a list (tests and debugging; fill_bitmask is the fast way)."""
        row = torch.zeros(bitmask_words(self.vocab_size), dtype=torch.int32)
        self.fill_bitmask(row)
        return allowed_ids(row, self.vocab_size)

    # ----- state -------------------------------------------------------------------------

    def accept(self, token_ids: Sequence[int] | int) -> bool:
        """Advance past these tokens. False when one of them is not allowed: the tokens
        before it are accepted, it and those after are not, and the matcher stays usable
        (the caller decides what a violation means; a masked sampler never makes one)."""
        tokens = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        if not tokens:
            return True
        if self.accepted and self.accepted[-1] in self.eos_token_ids:
            return False  # nothing follows end-of-sequence
        matcher = self._matcher
        num_ok = matcher.validate_tokens(tokens)
        if num_ok and not matcher.consume_tokens(tokens[:num_ok]):
            raise RuntimeError(f"grammar matcher failed on validated tokens: "
                               f"{matcher.get_error()}")
        # A matcher whose grammar is complete validates no further token, EOS included,
        # but consumes EOS (llguidance 1.9).
        if (num_ok < len(tokens) and tokens[num_ok] in self.eos_token_ids
                and matcher.is_accepting() and matcher.consume_token(tokens[num_ok])):
            num_ok += 1
        self.accepted.extend(tokens[:num_ok])
        return num_ok == len(tokens)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (rejected speculative tokens)."""
        if not 0 <= num_tokens <= len(self.accepted):
            raise ValueError(f"rollback of {num_tokens} tokens, but {len(self.accepted)} "
                             "were accepted")
        if num_tokens == 0:
            return
        if not self._matcher.rollback(num_tokens):
            self._replay(self.accepted[:-num_tokens])
            return
        del self.accepted[-num_tokens:]

    def sync(self, token_ids: Sequence[int]) -> bool:
        """Make the state that of exactly `token_ids` (the request's output so far): roll
        back what differs, accept what is new. Cheap when nothing changed, which is the
        case after preemption by recompute or swap (generated tokens are kept). False if
        `token_ids` break the grammar (then the state is their longest valid prefix)."""
        common = 0
        limit = min(len(self.accepted), len(token_ids))
        while common < limit and self.accepted[common] == token_ids[common]:
            common += 1
        if common < len(self.accepted):
            self.rollback(len(self.accepted) - common)
        return self.accept(list(token_ids[common:]))

    def is_terminated(self) -> bool:
        """The grammar allows only end-of-sequence now (or has accepted it): the request
        should end with finish_reason 'stop' once EOS is sampled, or at once if EOS is
        ignored."""
        return self._matcher.is_stopped()

    def is_error(self) -> bool:
        """The matcher hit one of the parser's limits (or broke): it stays in that state."""
        return self._matcher.is_error()

    def error(self) -> str:
        """What went wrong, when is_error()."""
        return self._matcher.get_error()

    def is_accepting(self) -> bool:
        """The output so far is a complete match (ending here would be valid)."""
        return self._matcher.is_accepting()

    def _replay(self, tokens: list[int]) -> None:
        self._matcher.reset()
        self.accepted = []
        self.accept(tokens)


class BitmaskFiller:
    """Fills the bitmask rows of many requests at once (llguidance's executor: Rust
    threads, GIL released), optionally in a background thread during the forward pass."""

    def __init__(self, num_threads: int | None = None) -> None:
        """`num_threads`: llguidance's mask threads (None: its default, 80% of the CPUs)."""
        import llguidance
        self._executor = llguidance.LLExecutor(num_threads=num_threads)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="treadle-masks")

    def fill(self, requests: Sequence[StructuredRequest], bitmask: torch.Tensor,
             rows: Sequence[int] | None = None) -> None:
        """Row rows[i] of `bitmask` (int32 [num_rows, words], contiguous, CPU) gets the
        mask of requests[i]; other rows are left as they are."""
        if not requests:
            return
        rows = list(range(len(requests))) if rows is None else list(rows)
        if len(rows) != len(requests):
            raise ValueError(f"{len(requests)} requests but {len(rows)} rows")
        if bitmask.dtype != torch.int32 or not bitmask.is_contiguous() or bitmask.dim() != 2:
            raise ValueError("bitmask must be a contiguous int32 [rows, words] tensor")
        if bitmask.device.type != "cpu":
            raise ValueError("bitmask must be on the CPU (copy it to the device after)")
        num_rows, words = bitmask.shape
        if any(not 0 <= r < num_rows for r in rows):
            raise ValueError(f"rows must be in [0, {num_rows})")
        live, stopped = [], []
        for request, row in zip(requests, rows):
            if words != bitmask_words(request.vocab_size):
                raise ValueError(f"bitmask rows have {words} words, the vocabulary needs "
                                 f"{bitmask_words(request.vocab_size)}")
            (stopped if request.is_terminated() else live).append((request, row))
        if live:
            self._executor.unsafe_compute_mask_ptr([(r._matcher, row) for r, row in live],
                                                   bitmask.data_ptr(), words * 4, num_rows)
        for request, row in stopped:
            _eos_only(bitmask[row], request.eos_token_ids)

    def submit(self, requests: Sequence[StructuredRequest], bitmask: torch.Tensor,
               rows: Sequence[int] | None = None) -> concurrent.futures.Future:
        """`fill` on the filler's thread; the future's result() is None once the rows are
        written. The requests must not be advanced (accept, rollback) until then."""
        return self._pool.submit(self.fill, list(requests), bitmask, rows)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor,
                   rows: Sequence[int] | None = None) -> None:
    """Set disallowed logits to -inf in place. logits: [R, vocab] float (any device);
    bitmask: int32 [B, words] (rows[i] of it masks logits row i; all rows, in order,
    when `rows` is None). Logit columns past the bitmask's 32 * words are disallowed."""
    num_rows, vocab = logits.shape
    masks = bitmask if rows is None else bitmask[list(rows)]
    if masks.shape[0] != num_rows:
        raise ValueError(f"{num_rows} logit rows but {masks.shape[0]} bitmask rows")
    masks = masks.to(logits.device, non_blocking=True)
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((masks.unsqueeze(-1) >> bits) & 1).bool().view(num_rows, -1)
    width = min(vocab, allowed.shape[1])
    logits[:, :width].masked_fill_(~allowed[:, :width], float("-inf"))
    if vocab > width:
        logits[:, width:] = float("-inf")


def allowed_ids(row: torch.Tensor, vocab_size: int) -> list[int]:
    """The token ids a bitmask row allows."""
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((row.unsqueeze(-1) >> bits) & 1).bool().view(-1)[:vocab_size]
    return allowed.nonzero().view(-1).tolist()


def _check_row(row: torch.Tensor, vocab_size: int) -> None:
    if (row.dtype != torch.int32 or row.dim() != 1 or not row.is_contiguous()
            or row.device.type != "cpu" or row.numel() != bitmask_words(vocab_size)):
        raise ValueError(f"a bitmask row must be a contiguous CPU int32 tensor of "
                         f"{bitmask_words(vocab_size)} words")


def _eos_only(row: torch.Tensor, eos_token_ids: Sequence[int]) -> None:
    row.zero_()
    for eos in eos_token_ids:
        row[eos // 32] |= _bit(eos % 32)


def _bit(j: int) -> int:
    """Bit j of an int32 word as a Python int that fits int32 (bit 31 is negative)."""
    return -(1 << 31) if j == 31 else 1 << j
