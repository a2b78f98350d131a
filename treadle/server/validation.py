"""What a request's tokens and sampling fields must satisfy before admission.

Owns the checks against the engine's limits (treadle/engine/limits.py `EngineLimits`: the
vocabulary, the context, the whole KV cache) and the translation of a body's sampling
fields into SamplingParams, each failure an APIError (400) naming the field and the
limit. Pure functions of the limits and the request: no engine, no I/O, no state. The
OpenAPI schema (server/openapi.py) publishes the same bounds from the same limits.
"""

from __future__ import annotations

from treadle.engine.limits import EngineLimits
from treadle.sampling_params import SamplingParams
from treadle.server import protocol
from treadle.server.admission import NeverAdmissible, request_max_tokens
from treadle.server.errors import APIError
from treadle.structured import StructuredSpec


def check_vocab(limits: EngineLimits, prompt_ids: list[int]) -> None:
    """400 for a prompt token id outside the vocabulary."""
    vocab = limits.vocab_size
    bad = next((t for t in prompt_ids if t >= vocab), None)
    if bad is not None:
        raise APIError(400, f"prompt: token id {bad} is outside the vocabulary [0, {vocab})",
                       "prompt")


def check_lengths(limits: EngineLimits, prompt_ids: list[int], requested: int | None,
                  default: int | None) -> int:
    """max_tokens for this prompt: the requested or default count, within the context
    and the whole KV cache (a 400 naming the field otherwise; the engine core's rule,
    server/admission.py request_max_tokens)."""
    try:
        return request_max_tokens(limits, len(prompt_ids), requested, default)
    except NeverAdmissible as exc:
        raise APIError(400, str(exc), exc.param) from None


def extension_params(body: protocol.SamplerExtensions) -> dict:
    """vLLM's and llama.cpp's sampling fields as SamplingParams arguments
    (dry_penalty_last_n -1, llama.cpp's "the whole context", is None there)."""
    args = dict(allowed_token_ids=body.allowed_token_ids, bad_words=body.bad_words,
                spaces_between_special_tokens=body.spaces_between_special_tokens,
                cache_salt=body.cache_salt, dry_multiplier=body.dry_multiplier,
                dry_base=body.dry_base, dry_allowed_length=body.dry_allowed_length,
                dry_penalty_last_n=None if body.dry_penalty_last_n == -1
                else body.dry_penalty_last_n,
                xtc_probability=body.xtc_probability, xtc_threshold=body.xtc_threshold)
    if body.dry_sequence_breakers is not None:
        args["dry_sequence_breakers"] = list(body.dry_sequence_breakers)
    return args


def truncate_prompt(limits: EngineLimits, prompt_ids: list[int],
                    truncate_prompt_tokens: int | None) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last N tokens (-1: max_model_len); a
    400 when N is over max_model_len."""
    if truncate_prompt_tokens is None:
        return prompt_ids
    keep = limits.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    if keep > limits.max_model_len:
        raise APIError(400, f"truncate_prompt_tokens: {keep} is over max_model_len "
                       f"{limits.max_model_len}", "truncate_prompt_tokens")
    return prompt_ids[-keep:]


def sampling_params(limits: EngineLimits, body: protocol.SamplingFields, max_tokens: int,
                    logprobs: int | None, prompt_logprobs: int | None = None,
                    structured: StructuredSpec | None = None,
                    skip_special_tokens: bool | None = None) -> SamplingParams:
    """The body's sampling fields as SamplingParams; a 400 naming the field when one is
    out of range or names a token id outside the vocabulary."""
    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
            top_k=body.top_k, min_p=body.min_p, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty, seed=body.seed, n=body.n,
            stop=body.stop_list(), stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
            logit_bias={int(k): v for k, v in (body.logit_bias or {}).items()} or None,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=(body.skip_special_tokens if skip_special_tokens is None
                                 else skip_special_tokens),
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            structured_outputs=structured, speculative=body.speculative,
            **extension_params(body))
    except ValueError as exc:
        message = str(exc)
        raise APIError(400, message, message.split(" ", 1)[0]) from None
    error = params.token_id_error(limits.vocab_size)
    if error is not None:
        raise APIError(400, error, error.split(" ", 1)[0])
    return params
