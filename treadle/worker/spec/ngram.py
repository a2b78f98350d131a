"""`ngram`: prompt lookup. Propose what followed the latest earlier occurrence of the
request's last n tokens (n from prompt_lookup_max down to prompt_lookup_min; the longest
match wins, then the latest) in its own prompt and output.

It runs every step for every speculating request, so the search is one set of numpy
operations over the whole batch, not a loop per request or per position: the requests'
tokens are right-aligned in one [requests, width] array (width: the longest, capped at
`window` tokens), and for each of the n offsets one comparison of every column against
the suffix token at that offset extends the run of matches ending at each column. The
proposal is the tokens after the best column. Tokens are kept per request in numpy
buffers that grow by what each step adds. No model, no KV: it proposes deterministically,
so verification compares tokens (worker/spec/rejection.py).
"""

from __future__ import annotations

import numpy as np

from treadle.core.outputs import SchedulerOutput
from treadle.worker.spec.base import ProposalBatch, Proposer

WINDOW = 4096
"""Most recent tokens of a request searched (bounds the work on very long contexts)."""


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, min_n: int, max_n: int, window: int = WINDOW) -> None:
        self.min_n, self.max_n, self.window = min_n, max_n, window
        self._tokens: dict[str, np.ndarray] = {}
        self._lengths: dict[str, int] = {}

    def begin_step(self, scheduler_output: SchedulerOutput) -> None:
        for request_id in scheduler_output.finished_request_ids:
            self._tokens.pop(request_id, None)
            self._lengths.pop(request_id, None)

    def _sync(self, request_id: str, token_ids: list[int]) -> np.ndarray:
        """The request's tokens as int64 (a request's tokens only ever grow)."""
        n = len(token_ids)
        buf = self._tokens.get(request_id)
        have = self._lengths.get(request_id, 0)
        if buf is None or buf.shape[0] < n:
            grown = np.empty(max(2 * n, 64), dtype=np.int64)
            if buf is not None:
                grown[:have] = buf[:have]
            buf = self._tokens[request_id] = grown
        if have < n:
            buf[have:n] = token_ids[have:n]
            self._lengths[request_id] = n
        return buf[:n]

    def propose(self, batch: ProposalBatch) -> dict[str, list[int]]:
        requests = [r for r in batch.requests if r.num_proposals > 0]
        if not requests:
            return {}
        seqs = [self._sync(r.request_id, r.token_ids)[-self.window:] for r in requests]
        k = np.array([r.num_proposals for r in requests], dtype=np.int64)
        return {r.request_id: p for r, p in zip(requests, lookup(seqs, k, self.min_n,
                                                                  self.max_n)) if p}


def lookup(seqs: list[np.ndarray], num_tokens: np.ndarray, min_n: int, max_n: int
           ) -> list[list[int]]:
    """For each token sequence, up to num_tokens[i] tokens that followed the best earlier
    match of its last n tokens (min_n <= n <= max_n): the longest n, then the latest
    position. An empty list when nothing matches."""
    num = len(seqs)
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    width = int(lengths.max())
    if width < 2:
        return [[] for _ in range(num)]
    tokens = np.full((num, width), -1, dtype=np.int64)  # right-aligned; -1 never matches
    for i, s in enumerate(seqs):
        tokens[i, width - len(s):] = s
    # run[:, e]: the match ending at column e (e < width - 1: something follows it)
    # extends to offset j when tokens[:, e - j] equals the suffix token at offset j.
    ends = width - 1
    run = np.ones((num, ends), dtype=bool)
    match_len = np.zeros((num, ends), dtype=np.int64)
    for j in range(min(max_n, width - 1)):
        suffix = tokens[:, width - 1 - j]
        column = np.zeros((num, ends), dtype=bool)
        column[:, j:] = tokens[:, :ends - j] == suffix[:, None]
        column &= (j < lengths)[:, None]  # the suffix itself must be real tokens
        run &= column
        match_len += run
    match_len[match_len < min_n] = 0
    # Longest match, then the latest column.
    score = match_len * width + np.arange(ends)[None, :]
    score[match_len == 0] = -1
    best = score.argmax(axis=1)
    found = score[np.arange(num), best] >= 0
    out: list[list[int]] = []
    for i in range(num):
        if not found[i]:
            out.append([])
            continue
        start = int(best[i]) + 1
        stop = min(start + int(num_tokens[i]), width)
        out.append(tokens[i, start:stop].tolist())
    return out
