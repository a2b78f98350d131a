"""What a simulation replays: requests as lengths, arrival times and classes, and the
synthetic prompt contents that give the production prefix cache something to match.

Owns `SimRequest` (one request: arrival, prompt and output lengths, priority, tenant,
label, and real token ids when the source has them), the sources (an Azure-format CSV
trace read through treadle.measure.workloads, its generated workloads, a saved workload file,
the mixed-priority workload of treadle.measure.workloads, and the arrivals of a treadle
per-step trace), the rate scaling (`time_scale` compresses the arrivals; `rate_scale`
superposes copies of the trace over the same duration), and `PromptMaker`.

Prompt contents. The Azure trace has token counts only. A request's prompt is built
deterministically from the seed and its index: with `prefix_groups` > 0, a fraction
`prefix_fraction` of the requests start with the first `prefix_len` tokens (at most all
but one of its prompt) of one of `prefix_groups` shared prefixes (a system prompt), the
group drawn with Zipf weights of exponent `prefix_zipf` (0: uniform); then 8 marker
tokens that encode the request's index, so that no two requests share a block past their
shared prefix; then filler. Token ids stay below 256. So the simulation assumes that
prompts share exactly these prefixes and nothing else (no multi-turn reuse of earlier
turns, no accidental overlaps). Requests with real ids (workload files) keep theirs.
Must not: run the scheduler, or read any file but the one it is pointed at.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from treadle.measure import workloads

_ALPHABET = 253
_FIRST = workloads.FIRST_ORDINARY_TOKEN_ID
_MARKER_LEN = 8
_FILLER = 4


@dataclass
class SimRequest:
    """One request of a simulation (times in seconds from the first arrival)."""

    index: int
    arrival: float
    prompt_len: int
    output_len: int
    priority: int = 0
    tenant: str | None = None
    label: str = ""
    prompt_token_ids: list[int] | None = None
    """Real token ids, when the source has them; otherwise PromptMaker builds them."""
    band: str = "interactive"
    """interactive, or batch (the lowest band, treadle/request.py)."""
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    """Its deadlines, as the request carries them (the `slo` policy orders by them)."""


def _cap(p: int, o: int, max_model_len: int | None) -> tuple[int, int]:
    return workloads.cap_lengths(p, o, max_model_len)


def from_azure_csv(path: str | Path | None = None, num_requests: int | None = None,
                   token_scale: float = 1.0, max_model_len: int | None = None) -> list[SimRequest]:
    """Rows of an Azure LLM inference trace (TIMESTAMP, ContextTokens, GeneratedTokens),
    token counts scaled and capped to the context as measure.workloads.azure_conv does;
    the default file is the conversation trace where measure.workloads finds it."""
    if token_scale <= 0:
        raise ValueError(f"token_scale must be > 0, got {token_scale}")
    if path is None:
        path = workloads.default_traces_dir() / workloads.AZURE_CONV_FILE
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace not found at {path} (set ${workloads.TRACES_DIR_ENV} "
                                "or give --trace FILE)")
    rows = workloads.read_azure_trace(path, num_requests if num_requests else 1 << 62)
    if not rows:
        raise ValueError(f"{path}: no requests")
    t0 = rows[0][0]
    out = []
    for i, (ts, context, generated) in enumerate(rows):
        p, o = _cap(max(1, round(context * token_scale)), max(1, round(generated * token_scale)),
                    max_model_len)
        out.append(SimRequest(i, ts - t0, p, o))
    return out


def from_workload(workload: workloads.Workload) -> list[SimRequest]:
    """A bench workload (or a saved workload file) with its own token ids and arrivals."""
    return [SimRequest(i, r.arrival_time, len(r.prompt_token_ids), r.max_tokens,
                       prompt_token_ids=list(r.prompt_token_ids))
            for i, r in enumerate(workload.requests)]


def from_replay(requests) -> list[SimRequest]:
    """treadle.measure.workloads ReplayRequests (mixed-priority), ids and classes kept."""
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_time)
    return [SimRequest(n, requests[i].arrival_time, len(requests[i].prompt_token_ids),
                       requests[i].max_tokens, requests[i].priority, requests[i].tenant,
                       requests[i].label, list(requests[i].prompt_token_ids))
            for n, i in enumerate(order)]


def from_engine_trace(trace) -> list[SimRequest]:
    """The arrivals of a treadle per-step trace (treadle.engine.trace.Trace): lengths,
    priorities, tenants and times as the engine saw them (contents are synthetic)."""
    arrivals = sorted(trace.arrivals.values(), key=lambda a: a.t)
    if not arrivals:
        raise ValueError("the trace records no arrivals")
    t0 = arrivals[0].t
    return [SimRequest(i, a.t - t0, a.num_prompt_tokens, a.max_tokens, a.priority, a.tenant)
            for i, a in enumerate(arrivals)]


def scale_times(requests: list[SimRequest], time_scale: float) -> list[SimRequest]:
    """Arrival gaps divided by `time_scale` (2: twice the request rate, half the time)."""
    if time_scale <= 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    if time_scale == 1:
        return requests
    return [replace(r, arrival=r.arrival / time_scale) for r in requests]


def scale_rate(requests: list[SimRequest], rate_scale: float, seed: int = 0) -> list[SimRequest]:
    """`rate_scale` times the request rate over the same duration: floor(rate_scale)
    copies of the trace superposed, copy j shifted by j / rate_scale of the mean gap
    between arrivals (so the copies interleave instead of arriving together), plus each
    request of one more copy with probability of the fractional part (seeded). Indices
    are renumbered in arrival order; each copy's prompts are its own."""
    if rate_scale <= 0:
        raise ValueError(f"rate_scale must be > 0, got {rate_scale}")
    if rate_scale == 1 or not requests:
        return requests
    span = requests[-1].arrival - requests[0].arrival
    mean_gap = span / max(1, len(requests) - 1)
    whole, frac = int(rate_scale), rate_scale - int(rate_scale)
    rng = np.random.default_rng(seed)
    out = []
    for j in range(whole + (1 if frac > 0 else 0)):
        keep = rng.random(len(requests)) < frac if j == whole else None
        shift = j * mean_gap / rate_scale
        for i, r in enumerate(requests):
            if keep is None or keep[i]:
                out.append(replace(r, arrival=r.arrival + shift))
    out.sort(key=lambda r: (r.arrival, r.index))
    return [replace(r, index=i) for i, r in enumerate(out)]


def assign_priorities(requests: list[SimRequest], priority_mix: float,
                      seed: int = 0) -> list[SimRequest]:
    """A fraction `priority_mix` of the requests (seeded) get priority 0 ("high"), the
    rest priority 1 ("background"), as `treadle bench serve --priority-mix` does."""
    if not 0.0 <= priority_mix <= 1.0:
        raise ValueError(f"priority_mix must be in [0, 1], got {priority_mix}")
    draws = np.random.default_rng(seed).random(len(requests))
    return [replace(r, priority=0 if x < priority_mix else 1,
                    label="high" if x < priority_mix else "background")
            for r, x in zip(requests, draws.tolist())]


class PromptMaker:
    """Deterministic prompt token ids with a shared-prefix structure (module docstring)."""

    def __init__(self, num_requests: int, prefix_groups: int = 0, prefix_len: int = 0,
                 prefix_fraction: float = 1.0, prefix_zipf: float = 0.0, seed: int = 0) -> None:
        if prefix_groups < 0 or prefix_len < 0:
            raise ValueError(f"prefix_groups and prefix_len must be >= 0, got "
                             f"{prefix_groups}, {prefix_len}")
        if not 0.0 <= prefix_fraction <= 1.0:
            raise ValueError(f"prefix_fraction must be in [0, 1], got {prefix_fraction}")
        if prefix_zipf < 0:
            raise ValueError(f"prefix_zipf must be >= 0, got {prefix_zipf}")
        rng = np.random.default_rng(seed)
        self._groups: list[int] | None = None
        self._prefixes: list[list[int]] = []
        if prefix_groups and prefix_len:
            weights = 1.0 / np.arange(1, prefix_groups + 1) ** prefix_zipf
            weights /= weights.sum()
            groups = rng.choice(prefix_groups, size=num_requests, p=weights)
            shared = rng.random(num_requests) < prefix_fraction
            self._groups = [int(g) if s else -1 for g, s in zip(groups, shared)]
            self._prefixes = [(rng.integers(0, _ALPHABET, size=prefix_len) + _FIRST).tolist()
                              for _ in range(prefix_groups)]

    def group(self, index: int) -> int | None:
        """The shared prefix of request `index`, or None."""
        if self._groups is None or index >= len(self._groups) or self._groups[index] < 0:
            return None
        return self._groups[index]

    def prompt(self, request: SimRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            return request.prompt_token_ids
        n = request.prompt_len
        group = self.group(request.index)
        ids = self._prefixes[group][:n - 1] if group is not None else []
        marker, k = [], request.index
        for _ in range(_MARKER_LEN):
            marker.append(_FIRST + k % _ALPHABET)
            k //= _ALPHABET
        ids = ids + marker[:n - len(ids)]
        return ids + [_FILLER] * (n - len(ids))
