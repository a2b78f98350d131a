"""The vectorized prompt lookup (worker/spec/ngram.py) against a plain loop per request."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from treadle.sampling_params import SamplingParams
from treadle.worker.spec.base import ProposalBatch, ProposalRequest
from treadle.worker.spec.ngram import NgramProposer, lookup


def reference(seq: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Longest n first, then the latest earlier occurrence that has a token after it."""
    n_tokens = len(seq)
    for n in range(min(max_n, n_tokens - 1), min_n - 1, -1):
        suffix = seq[n_tokens - n:]
        for end in range(n_tokens - 2, n - 2, -1):  # the match's last index
            if seq[end - n + 1:end + 1] == suffix:
                return seq[end + 1:end + 1 + k]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=40), min_size=1, max_size=6),
       st.integers(1, 3), st.integers(0, 3), st.integers(1, 6))
def test_lookup_matches_the_loop(seqs, min_n, extra, k):
    max_n = min_n + extra
    got = lookup([np.array(s, dtype=np.int64) for s in seqs],
                 np.full(len(seqs), k, dtype=np.int64), min_n, max_n)
    assert got == [reference(s, k, min_n, max_n) for s in seqs]


def test_longest_match_wins_over_a_later_shorter_one():
    seq = [1, 2, 3, 9, 8, 5, 3, 7, 7, 1, 2, 3]
    # "1 2 3" occurs at the start (followed by 9); "2 3"/"3" alone later would give 7.
    assert lookup([np.array(seq)], np.array([3]), 1, 3) == [[9, 8, 5]]


def test_proposer_keeps_each_request_s_tokens_incrementally():
    proposer = NgramProposer(1, 3)
    params = SamplingParams()
    tokens = [5, 6, 7, 8, 5, 6]
    req = ProposalRequest("a", tokens, 2, 2, params, 0)
    assert proposer.propose(ProposalBatch([req], np.zeros((1, 1), dtype=np.int64))) == {
        "a": [7, 8]}
    tokens = tokens + [7, 9, 5]
    req = ProposalRequest("a", tokens, 2, 3, params, 0)
    assert proposer.propose(ProposalBatch([req], np.zeros((1, 1), dtype=np.int64))) == {
        "a": [6, 7, 9]}
