"""The worker's side of structured outputs: grammar state per constrained request, token
masks computed while the forward pass runs, and masks applied before sampling.

Owns, on the rank that samples, a `GrammarCompiler` for the model's tokenizer (made on
the first constrained request) and a `StructuredRequest` per live constrained request
(treadle/structured). Each step: `start(rows)` brings every constrained request's
matcher to its tokens as the step message says (`sync`: cheap when one token was added;
it also undoes whatever a preemption or a rejected proposal took back) and submits the
mask fill of its sampling positions to llguidance's threads, so it overlaps the model's
forward pass; `masks()` waits for it and gives (bitmask, logits rows) for the sampler,
which applies them after logit_bias and penalties and before temperature and sampling.
Positions after proposed tokens (speculative decoding) are masked as if those tokens had
been accepted. Unconstrained rows are never touched. It decides nothing: ending a request
whose grammar is complete is the scheduler's (its end-of-sequence is then the only token
allowed).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class StepMasks:
    """A step's token masks: row i of `bitmask` masks sampling position `rows[i]`."""

    bitmask: torch.Tensor
    rows: list[int]


class GrammarState:
    """Grammar matchers of the constrained requests of one worker."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_id: int | None) -> None:
        self.model_dir, self.vocab_size, self.eos_token_id = model_dir, vocab_size, eos_token_id
        self._compiler = None
        self._filler = None
        self._requests: dict = {}
        self._pending: tuple | None = None
        """(fill future, bitmask, positions after proposals, logits rows) of this step."""

    def drop(self, request_ids) -> None:
        for request_id in request_ids:
            self._requests.pop(request_id, None)

    def _matcher(self, request_id: str, spec):
        matcher = self._requests.get(request_id)
        if matcher is None:
            if self._compiler is None:
                from treadle.models.tokenizer import load_tokenizer
                from treadle.structured.compiler import GrammarCompiler
                from treadle.structured.matcher import BitmaskFiller

                tokenizer = load_tokenizer(self.model_dir)
                if tokenizer is None:
                    raise ValueError("structured outputs need the model's tokenizer files")
                self._compiler = GrammarCompiler.from_hf_tokenizer(
                    tokenizer, self.vocab_size, self.eos_token_id)
                self._filler = BitmaskFiller()
            matcher = self._requests[request_id] = self._compiler.new_request(spec)
        return matcher

    def start(self, positions: list[tuple[int, str, object, list[int], list[int]]]) -> None:
        """Sync and submit the masks of sampling positions. `positions` holds, per
        sampling position of a constrained request: (its logits row, request id, its spec,
        its generated tokens, the proposed tokens before this position), a request's
        first position (no proposals before it) first."""
        self._pending = None
        if not positions:
            return
        from treadle.structured.matcher import allocate_bitmask

        with torch.inference_mode(False):  # written by the filler's thread, outside it
            bitmask = allocate_bitmask(len(positions), self.vocab_size)
        plain, ahead = [], []
        for row, (_, request_id, spec, output_ids, proposed) in enumerate(positions):
            matcher = self._matcher(request_id, spec)
            if not proposed:
                matcher.sync(output_ids)
                plain.append((matcher, row))
            else:
                ahead.append((matcher, row, proposed))
        future = self._filler.submit([m for m, _ in plain], bitmask, [r for _, r in plain])
        self._pending = (future, bitmask, ahead, [p[0] for p in positions])

    def masks(self) -> StepMasks | None:
        """The submitted masks, once filled (positions after proposed tokens are filled
        here, one by one: each tentatively accepts its proposals, then rolls them back)."""
        if self._pending is None:
            return None
        future, bitmask, ahead, logits_rows = self._pending
        self._pending = None
        future.result()
        for matcher, row, proposed in ahead:
            before = len(matcher.accepted)
            if matcher.accept(proposed):
                matcher.fill_bitmask(bitmask[row])
            # else an earlier proposal breaks the grammar: this position is never reached
            # (the masked token before it cannot equal that proposal), its mask is moot
            matcher.rollback(len(matcher.accepted) - before)
        return StepMasks(bitmask, logits_rows)
