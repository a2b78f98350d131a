"""Speculative decoding in the worker: proposers behind one interface (base.py), exact
verification (rejection.py) and the start-up cost probe (cost_probe.py).

Proposers: `ngram` (prompt lookup, ngram.py) and the model-based `draft` and `self`
(draft.py). The worker builds the one `speculative_config` names (worker/worker.py) on
the output rank; the scheduler decides how many tokens each request gets proposed and
runs (core/spec_decode.py). docs/speculative.md has the design.
"""

from treadle.worker.spec.base import ProposalBatch, ProposalRequest, Proposer

__all__ = ["ProposalBatch", "ProposalRequest", "Proposer"]
