"""DRY ("don't repeat yourself", llama.cpp's sampler): the penalty each token gets for
extending a repetition of the request's history.

Owns `dry_penalties(history, params)`: for one request, the tokens whose logits DRY
lowers and by how much, with llama.cpp's semantics:

1. The history is the last `dry_penalty_last_n` tokens of prompt + output (all of them
   when None). Nothing is penalized when it holds no more than `dry_allowed_length`
   tokens.
2. A sequence breaker (`params.tokenized.dry_breakers`: head token -> tails, made by
   treadle/engine/token_words.py) caps how far back a repetition may reach: scanning
   from the end, the first head whose longest matching tail ends inside the history sets
   the cap to the tokens after that tail. A cap below `dry_allowed_length` means no
   penalty.
3. For every earlier position p, n(p) is the length (at most the cap) of the longest
   run of tokens ending at p that equals the run ending at the history's last token.
   Where n(p) >= dry_allowed_length, the token after p would extend that repetition:
   it is penalized for the longest such n.
4. The penalty is dry_multiplier * dry_base ** (n - dry_allowed_length), the exponent
   capped so that the power stays a finite float32 (llama.cpp's cap); a token that is a
   breaker on its own is never penalized.

llama.cpp computes step 3 with a Z-algorithm over the reversed history; here the run
lengths are grown one token at a time over the positions still matching, with numpy, so
the work is the history's length plus the total length of the repetitions found.
Pure numpy over token ids: no torch, no tokenizer, no state.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from treadle.sampling_params import SamplingParams

_FLOAT_MAX_LOG = 88.7228391
"""log(float32's largest value): llama.cpp caps the exponent at this over log(base)."""


def dry_history(prompt: Sequence[int], output: Sequence[int], last_n: int | None) -> list[int]:
    """The last `last_n` tokens of prompt + output (all of them for None)."""
    if last_n is None:
        return [*prompt, *output]
    if len(output) >= last_n:
        return list(output[len(output) - last_n:])
    return [*prompt[max(0, len(prompt) - (last_n - len(output))):], *output]


def repeat_cap(history: np.ndarray, breakers: dict) -> int:
    """How many of the history's last tokens a repetition may span (step 2)."""
    n = len(history)
    if not breakers:
        return n
    heads = np.fromiter(breakers, dtype=np.int64, count=len(breakers))
    for start in np.flatnonzero(np.isin(history, heads))[::-1].tolist():
        after = n - 1 - start  # tokens after the head
        longest = -1
        for tail in breakers[int(history[start])]:
            if longest < len(tail) <= after and all(
                    history[start + 1 + k] == t for k, t in enumerate(tail)):
                longest = len(tail)
        if longest >= 0:
            return after - longest
    return n


def repeat_lengths(history: np.ndarray, cap: int) -> np.ndarray:
    """n(p) for p < len(history) - 1 (step 3), each at most `cap`."""
    last = len(history) - 1
    lengths = np.zeros(last, dtype=np.int64)
    if cap <= 0 or last <= 0:
        return lengths
    alive = np.flatnonzero(history[:last] == history[last])
    length = 1
    while alive.size:
        lengths[alive] = length
        if length == cap:
            break
        alive = alive[alive >= length]
        alive = alive[history[alive - length] == history[last - length]]
        length += 1
    return lengths


def dry_penalties(history: Sequence[int], params: SamplingParams
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, amounts to subtract from their logits) for one request's history."""
    none = (np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float64))
    allowed = params.dry_allowed_length
    if not params.uses_dry or len(history) <= allowed:
        return none
    breakers = params.tokenized.dry_breakers if params.tokenized is not None else {}
    h = np.asarray(history, dtype=np.int64)
    cap = repeat_cap(h, breakers)
    if cap < allowed:
        return none
    lengths = repeat_lengths(h, cap)
    where = np.flatnonzero(lengths >= allowed)
    if not where.size:
        return none
    tokens, inverse = np.unique(h[where + 1], return_inverse=True)
    longest = np.zeros(len(tokens), dtype=np.int64)
    np.maximum.at(longest, inverse, lengths[where])
    if breakers:
        alone = np.array([() in breakers.get(int(t), ()) for t in tokens.tolist()], dtype=bool)
        tokens, longest = tokens[~alone], longest[~alone]
    exponent = longest - allowed
    base = params.dry_base
    if base > 1.000001:
        exponent = np.minimum(exponent, int(_FLOAT_MAX_LOG / math.log(base)))
    return tokens, params.dry_multiplier * np.power(base, exponent.astype(np.float64))
