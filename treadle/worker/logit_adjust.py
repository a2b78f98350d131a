"""The adjustments a request's own parameters make to its raw logits before sampling.

Owns `adjust_logits`, applied in place to a batch of logits rows (each row its own
SamplingParams), in this order: logit_bias; bad_words (vLLM's: the last token of a
banned word whose other tokens end the output so far, to -inf); min_tokens (the stop
tokens and EOS of a row still short of it, to -inf); allowed_token_ids (every other
token to -inf; if the bans took every allowed token, those come back: a row always
keeps a token to sample); the repetition, frequency and presence penalties; DRY
(worker/dry.py). Work
is per token that appears, not per vocabulary entry, except allowed_token_ids (one mask
per row). Every change can be remembered for the rows that report logprobs, so that
their raw logits are restored (the C kernel path: worker/cpu/native_sampling.py).
Shared by the sampler's torch path and its C path, so both sample the same distribution.
It decides nothing about which requests run.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np
import torch

from treadle.sampling_params import SamplingParams
from treadle.worker.dry import dry_history, dry_penalties


def adjust_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                  prompt_token_ids: Sequence[Sequence[int]] | None,
                  output_token_ids: Sequence[Sequence[int]] | None,
                  eos_token_id: int | None, save_rows: Sequence[int] = ()
                  ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Apply logit_bias, allowed_token_ids, bad_words, min_tokens masking, the penalties
    and DRY, in place, on raw logits.

    Repetition (transformers): each distinct token of prompt + output, logit / p when
    positive, * p otherwise. Frequency and presence (OpenAI): logit -= frequency * count
    + presence * (count > 0), counts over the output only. Work is per token, not per
    vocabulary entry: only the logits of tokens that appear are touched.

    Returns, for the rows in `save_rows`, the (rows, cols, values) each change overwrote,
    in order: written back in reverse order, they restore the raw logits.
    """
    num_rows = logits.shape[0]
    dev = logits.device
    outputs = output_token_ids if output_token_ids is not None else [()] * num_rows
    prompts = prompt_token_ids if prompt_token_ids is not None else [()] * num_rows
    saved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    save_mask = None
    if save_rows:
        save_mask = torch.zeros(num_rows, dtype=torch.bool, device=dev)
        save_mask[list(save_rows)] = True

    def remember(r: torch.Tensor, c: torch.Tensor) -> None:
        if save_mask is not None:
            keep = save_mask[r]
            if bool(keep.any()):
                saved.append((r[keep], c[keep], logits[r[keep], c[keep]].clone()))

    _bias_and_bans(logits, params, outputs, eos_token_id, remember)
    _penalties(logits, params, prompts, outputs, remember)
    _dry(logits, params, prompts, outputs, remember)
    return saved


def _bias_and_bans(logits: torch.Tensor, params: Sequence[SamplingParams], outputs,
                   eos_token_id: int | None, remember) -> None:
    """logit_bias added, then bad_words' bans, the stop tokens (and EOS) of rows still
    short of min_tokens, and every token outside allowed_token_ids set to -inf (when
    that leaves a row nothing, its allowed tokens are kept); `remember(rows, cols)` is
    called before each change."""
    vocab, dev = logits.shape[1], logits.device
    rows, cols, values = [], [], []
    for i, p in enumerate(params):
        if p.logit_bias:
            for token_id, bias in p.logit_bias.items():
                if token_id < vocab:  # admission rejects others; never index past the row
                    rows.append(i)
                    cols.append(token_id)
                    values.append(bias)
    if rows:
        r, c = torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)
        remember(r, c)
        logits.index_put_((r, c), torch.tensor(values, dtype=logits.dtype, device=dev),
                          accumulate=True)
    allowed = _allowed_values(logits, params)
    _ban(logits, *_bad_words(params, outputs, vocab), remember)

    rows, cols = [], []
    for i, p in enumerate(params):
        if p.min_tokens and len(outputs[i]) < p.min_tokens:
            banned = list(p.stop_token_ids)
            if eos_token_id is not None and not p.ignore_eos:
                banned.append(eos_token_id)
            banned = [t for t in banned if t < vocab]
            rows += [i] * len(banned)
            cols += banned
    if rows:
        r, c = torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)
        remember(r, c)
        logits[r, c] = float("-inf")
    _ban(logits, *_allowed_only(params, vocab, dev), remember)
    _keep_an_allowed_token(logits, allowed, remember)


def _allowed_values(logits: torch.Tensor, params: Sequence[SamplingParams]) -> list:
    """(row, its allowed columns, their logits) of the rows with allowed_token_ids,
    before any ban."""
    vocab, out = logits.shape[1], []
    for i, p in enumerate(params):
        if p.allowed_token_ids:
            cols = torch.tensor([t for t in p.allowed_token_ids if t < vocab],
                                dtype=torch.long, device=logits.device)
            out.append((i, cols, logits[i, cols].clone()))
    return out


def _keep_an_allowed_token(logits: torch.Tensor, allowed: list, remember) -> None:
    """A row whose bad_words and min_tokens bans took every allowed token gets its
    allowed tokens back (allowed_token_ids wins; the row would have nothing to sample)."""
    for i, cols, values in allowed:
        if cols.numel() and bool(torch.isneginf(logits[i, cols]).all()):
            rows = torch.full_like(cols, i)
            remember(rows, cols)
            logits[i, cols] = values


def _penalties(logits: torch.Tensor, params: Sequence[SamplingParams], prompts, outputs,
               remember) -> None:
    """The repetition penalty, then the frequency and presence penalties (see
    `adjust_logits`); `remember(rows, cols)` is called before each change."""
    vocab, dev = logits.shape[1], logits.device
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep:
        r, c = _distinct_pairs([itertools.chain(prompts[i], outputs[i]) for i in rep],
                               [len(prompts[i]) + len(outputs[i]) for i in rep], rep, vocab,
                               dev)
        if r.numel():
            pen = torch.tensor([params[i].repetition_penalty for i in rep],
                               dtype=logits.dtype, device=dev)
            pen = pen[torch.searchsorted(torch.tensor(rep, device=dev), r)]
            remember(r, c)
            v = logits[r, c]
            logits[r, c] = torch.where(v > 0, v / pen, v * pen)

    freq = [i for i, p in enumerate(params)
            if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
    if freq:
        r, c, counts = _distinct_pairs([outputs[i] for i in freq],
                                       [len(outputs[i]) for i in freq], freq, vocab, dev,
                                       return_counts=True)
        if r.numel():
            index = torch.searchsorted(torch.tensor(freq, device=dev), r)
            f = torch.tensor([params[i].frequency_penalty for i in freq],
                             dtype=logits.dtype, device=dev)[index]
            pres = torch.tensor([params[i].presence_penalty for i in freq],
                                dtype=logits.dtype, device=dev)[index]
            remember(r, c)
            logits[r, c] -= f * counts.to(logits.dtype) + pres


def _distinct_pairs(token_lists, lengths: list[int], rows: list[int], vocab: int,
                    device: torch.device, return_counts: bool = False):
    """Distinct (row, token) pairs of each row's tokens, sorted by row (and counts), on
    `device`."""
    total = sum(lengths)
    tokens = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long,
                          device=device)
    if total == 0:
        empty = torch.empty(0, dtype=torch.long, device=device)
        return (empty, empty, empty) if return_counts else (empty, empty)
    row_of = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long, device=device),
                                     torch.tensor(lengths, dtype=torch.long, device=device))
    keys = row_of * vocab + tokens
    if return_counts:
        keys, counts = torch.unique(keys, return_counts=True)
        return keys // vocab, keys % vocab, counts
    keys = torch.unique(keys)
    return keys // vocab, keys % vocab


def _ban(logits: torch.Tensor, rows, cols, remember) -> None:
    """(rows, cols) to -inf, remembered first."""
    if len(rows):
        r = torch.as_tensor(rows, dtype=torch.long, device=logits.device)
        c = torch.as_tensor(cols, dtype=torch.long, device=logits.device)
        remember(r, c)
        logits[r, c] = float("-inf")


def _allowed_only(params: Sequence[SamplingParams], vocab: int, dev: torch.device):
    """(rows, cols) of every token outside each row's allowed_token_ids."""
    rows, cols = [], []
    for i, p in enumerate(params):
        if p.allowed_token_ids:
            outside = torch.ones(vocab, dtype=torch.bool, device=dev)
            outside[[t for t in p.allowed_token_ids if t < vocab]] = False
            banned = outside.nonzero().flatten()
            rows.append(torch.full_like(banned, i))
            cols.append(banned)
    if not rows:
        return (), ()
    return torch.cat(rows), torch.cat(cols)


def _bad_words(params: Sequence[SamplingParams], outputs, vocab: int):
    """(rows, cols) of vLLM's bad-word bans: a word's last token, where the output so far
    ends with the word's other tokens (a one-token word: always)."""
    rows, cols = [], []
    for i, p in enumerate(params):
        words = p.tokenized.bad_words if p.tokenized is not None else ()
        for word in words:
            prefix = len(word) - 1
            out = outputs[i]
            if prefix > len(out) or word[-1] >= vocab:
                continue
            if prefix == 0 or tuple(out[len(out) - prefix:]) == word[:-1]:
                rows.append(i)
                cols.append(word[-1])
    return rows, cols


def _dry(logits: torch.Tensor, params: Sequence[SamplingParams], prompts, outputs,
         remember) -> None:
    """DRY's penalty (worker/dry.py) subtracted from the rows that use it."""
    rows, cols, amounts = [], [], []
    for i, p in enumerate(params):
        if p.uses_dry:
            tokens, penalty = dry_penalties(
                dry_history(prompts[i], outputs[i], p.dry_penalty_last_n), p)
            rows.append(np.full(len(tokens), i, dtype=np.int64))
            cols.append(tokens)
            amounts.append(penalty)
    if not rows or not sum(len(c) for c in cols):
        return
    dev = logits.device
    r = torch.from_numpy(np.concatenate(rows)).to(dev)
    c = torch.from_numpy(np.concatenate(cols)).to(dev)
    remember(r, c)
    logits[r, c] -= torch.from_numpy(np.concatenate(amounts)).to(dev, logits.dtype)
