"""Benchmark workloads: deterministic lists of token-id requests with arrival times.

Owns the request generators that the benchmarks (treadle/bench) and the simulator
(treadle/sim) share (`synthetic`, `azure_conv`, `shared_prefix`, and the timed replay
of `mixed_priority_workload`), the record of the parameters used (`Workload.description`), so a
result can say exactly what was run, and the JSON file form (`save_workload`,
`load_workload`) that hands one workload to another program, e.g. vLLM's own offline
runner in its own virtual environment (benchmarks/vllm_offline.py). Prompts are random token ids (no text,
no tokenizer); output lengths are forced (generation ignores EOS).
Must not: import torch, load a model, time anything, or read any trace other than
the one it is pointed at. Same arguments -> identical workload, always.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np

#: Token ids below this are avoided in random prompts (pad / bos / eos in most vocabularies).
FIRST_ORDINARY_TOKEN_ID = 3
AZURE_CONV_FILE = "AzureLLMInferenceTrace_conv.csv"
DEFAULT_VOCAB_SIZE = 49152
"""The benchmark model's vocabulary (SmolLM2-135M); used only when the model's is unknown."""
TRACES_DIR_ENV = "TREADLE_TRACES_DIR"


@dataclass(frozen=True)
class WorkloadRequest:
    """One request: prompt token ids, forced output length, arrival (seconds since start)."""

    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float = 0.0


@dataclass
class Workload:
    """A named list of requests plus the parameters that made it (JSON-serializable)."""

    name: str
    requests: list[WorkloadRequest]
    description: dict = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def total_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def total_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)


def save_workload(workload: Workload, path: str | Path) -> Path:
    """Write the workload as JSON: name, description, and per request its prompt token
    ids, max_tokens and arrival_time (the format benchmarks/vllm_offline.py reads)."""
    path = Path(path)
    path.write_text(json.dumps({
        "name": workload.name, "description": workload.description,
        "requests": [{"prompt_token_ids": r.prompt_token_ids, "max_tokens": r.max_tokens,
                      "arrival_time": r.arrival_time} for r in workload.requests]}))
    return path


def load_workload(path: str | Path) -> Workload:
    """A workload written by `save_workload`."""
    data = json.loads(Path(path).read_text())
    try:
        requests = [WorkloadRequest(list(r["prompt_token_ids"]), int(r["max_tokens"]),
                                    float(r.get("arrival_time", 0.0)))
                    for r in data["requests"]]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a workload file (requests[].prompt_token_ids and "
                         f"max_tokens are required): {exc!r}") from None
    return Workload(data.get("name", Path(path).stem), requests,
                    dict(data.get("description") or {}))


def _check_range(name: str, value: tuple[int, int], minimum: int = 1) -> tuple[int, int]:
    low, high = int(value[0]), int(value[1])
    if low < minimum or high < low:
        raise ValueError(f"{name} must be (low, high) with {minimum} <= low <= high, got {value!r}")
    return low, high


def _check_vocab(vocab_size: int) -> None:
    if vocab_size <= FIRST_ORDINARY_TOKEN_ID:
        raise ValueError(f"vocab_size must be > {FIRST_ORDINARY_TOKEN_ID}, got {vocab_size}")


def _model_config_value(model_dir: str | Path, key: str):
    """`key` of a checkpoint folder's config.json, or of the HF config a .gguf file's
    metadata gives (models/gguf_reader.py); None when neither has it."""
    if Path(model_dir).suffix == ".gguf" and Path(model_dir).is_file():
        from treadle.models.gguf_reader import hf_config, open_gguf
        config = hf_config(open_gguf(model_dir))
    else:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            return None
        config = json.loads(path.read_text())
    return config.get(key) or (config.get("text_config") or {}).get(key)


def model_vocab_size(model_dir: str | Path) -> int:
    """The vocabulary size in a Hugging Face checkpoint's config.json or a GGUF file's
    metadata (reading a file, not loading the model), so that a workload draws only ids
    the model has."""
    size = _model_config_value(model_dir, "vocab_size")
    if not isinstance(size, int):
        raise ValueError(f"cannot tell the vocabulary size of {model_dir} (no vocab_size in "
                         "its config.json): pass --vocab-size")
    return size


def model_context_len(model_dir: str | Path) -> int | None:
    """max_position_embeddings in the checkpoint's config.json (None if absent)."""
    length = _model_config_value(model_dir, "max_position_embeddings")
    return length if isinstance(length, int) else None


def check_token_ids(workload: Workload, vocab_size: int) -> None:
    """ValueError if any prompt token id is outside [0, vocab_size) (e.g. a workload file
    made for another model)."""
    for i, request in enumerate(workload.requests):
        bad = next((t for t in request.prompt_token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"workload {workload.name!r}: request {i} has token id {bad}, "
                             f"outside the model's vocabulary [0, {vocab_size})")


def _random_ids(rng: np.random.Generator, length: int, vocab_size: int) -> list[int]:
    return rng.integers(FIRST_ORDINARY_TOKEN_ID, vocab_size, size=length).tolist()


def cap_lengths(prompt_len: int, output_len: int, max_model_len: int | None) -> tuple[int, int]:
    """Fit prompt + output into max_model_len: the prompt is truncated first (down to
    1 token); only then the output, which always keeps at least 1 token."""
    if max_model_len is None:
        return prompt_len, output_len
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2 (1 prompt + 1 output token), got {max_model_len}")
    output_len = max(1, min(output_len, max_model_len - 1))
    prompt_len = max(1, min(prompt_len, max_model_len - output_len))
    return prompt_len, output_len


def synthetic(num_requests: int = 64, prompt_len: tuple[int, int] = (32, 512),
              output_len: tuple[int, int] = (16, 256), num_long: int = 4,
              long_output_len: int = 1024, vocab_size: int = 49152, seed: int = 0,
              max_model_len: int | None = None,
              request_rate: float | None = None) -> Workload:
    """The engine-core workload: uniform prompt / output lengths (inclusive ranges),
    `num_long` requests (picked by the seeded RNG) with `long_output_len` outputs.
    All arrive at 0 unless `request_rate` (requests/s) gives Poisson arrivals."""
    prompt_lo, prompt_hi = _check_range("prompt_len", prompt_len)
    out_lo, out_hi = _check_range("output_len", output_len)
    _check_vocab(vocab_size)
    if not 0 <= num_long <= num_requests:
        raise ValueError(f"num_long must be in [0, num_requests={num_requests}], got {num_long}")
    if num_long and long_output_len < 1:
        raise ValueError(f"long_output_len must be >= 1, got {long_output_len}")
    if request_rate is not None and request_rate <= 0:
        raise ValueError(f"request_rate must be > 0 requests/s, got {request_rate}")
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(prompt_lo, prompt_hi + 1, size=num_requests)
    output_lens = rng.integers(out_lo, out_hi + 1, size=num_requests)
    long_idx = rng.choice(num_requests, size=num_long, replace=False) if num_long else []
    output_lens[long_idx] = long_output_len
    if request_rate is None:
        arrivals = np.zeros(num_requests)
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / request_rate, size=num_requests))
        arrivals -= arrivals[0] if num_requests else 0.0
    requests, num_capped = [], 0
    for p, o, t in zip(prompt_lens.tolist(), output_lens.tolist(), arrivals.tolist()):
        p2, o2 = cap_lengths(p, o, max_model_len)
        num_capped += (p2, o2) != (p, o)
        requests.append(WorkloadRequest(_random_ids(rng, p2, vocab_size), o2, float(t)))
    return Workload("synthetic", requests, {
        "workload": "synthetic", "num_requests": num_requests, "prompt_len": [prompt_lo, prompt_hi],
        "output_len": [out_lo, out_hi], "num_long": num_long, "long_output_len": long_output_len,
        "long_request_indices": sorted(int(i) for i in long_idx), "vocab_size": vocab_size,
        "seed": seed, "max_model_len": max_model_len, "num_capped": num_capped,
        "request_rate": request_rate, "arrivals": "all at 0" if request_rate is None else "poisson",
    })


def default_traces_dir() -> Path:
    """$TREADLE_TRACES_DIR if set, else the project's own benchmarks/traces (the Azure
    conversation trace ships there, with its CC-BY 4.0 attribution in its README)."""
    env = os.environ.get(TRACES_DIR_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "benchmarks" / "traces"


def _parse_timestamp(text: str) -> float:
    """'2023-11-16 18:15:46.6805900' -> POSIX seconds (fraction of any length kept)."""
    whole, _, frac = text.strip().partition(".")
    base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").timestamp()
    return base + (float("0." + frac) if frac else 0.0)


def read_azure_trace(path: str | Path, num_requests: int) -> list[tuple[float, int, int]]:
    """First `num_requests` rows of an Azure LLM inference trace as (seconds, context, generated)."""
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if len(rows) >= num_requests:
                break
            rows.append((_parse_timestamp(row["TIMESTAMP"]), int(row["ContextTokens"]),
                         int(row["GeneratedTokens"])))
    return rows


def azure_conv(path: str | Path | None = None, num_requests: int = 200, token_scale: float = 1.0,
               time_scale: float = 1.0, max_model_len: int = 2048, vocab_size: int = 49152,
               seed: int = 0) -> Workload:
    """Replay the first `num_requests` rows of the Azure conversation trace (2023, CC-BY 4.0,
    from the Splitwise paper). Token counts are multiplied by `token_scale`; arrival gaps are
    divided by `time_scale` (time_scale 2 = twice the real request rate)."""
    if token_scale <= 0 or time_scale <= 0:
        raise ValueError(f"token_scale and time_scale must be > 0, got {token_scale}, {time_scale}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    _check_vocab(vocab_size)
    path = Path(path) if path is not None else default_traces_dir() / AZURE_CONV_FILE
    if not path.is_file():
        raise FileNotFoundError(f"Azure conversation trace not found at {path} "
                                f"(pass path= or set ${TRACES_DIR_ENV})")
    rows = read_azure_trace(path, num_requests)
    rng = np.random.default_rng(seed)
    t0 = rows[0][0] if rows else 0.0
    requests, num_capped = [], 0
    for ts, context, generated in rows:
        p = max(1, round(context * token_scale))
        o = max(1, round(generated * token_scale))
        p2, o2 = cap_lengths(p, o, max_model_len)
        num_capped += (p2, o2) != (p, o)
        requests.append(WorkloadRequest(_random_ids(rng, p2, vocab_size), o2, (ts - t0) / time_scale))
    return Workload("azure-conv", requests, {
        "workload": "azure-conv", "trace": path.name, "num_requests": len(requests),
        "token_scale": token_scale, "time_scale": time_scale, "max_model_len": max_model_len,
        "num_capped": num_capped, "vocab_size": vocab_size, "seed": seed,
        "duration_s": requests[-1].arrival_time if requests else 0.0,
        "attribution": "Azure LLM inference trace 2023 (Patel et al., Splitwise, ISCA 2024), CC-BY 4.0",
    })


def shared_prefix(num_requests: int = 64, num_prefixes: int = 4, prefix_len: int = 512,
                  suffix_len: tuple[int, int] = (16, 64), output_len: int | tuple[int, int] = 32,
                  vocab_size: int = 49152, seed: int = 0) -> Workload:
    """Requests sharing one of `num_prefixes` long system prompts (picked by the seeded RNG),
    each followed by its own random suffix; all arrive at 0."""
    if num_prefixes < 1 or prefix_len < 0:
        raise ValueError(f"need num_prefixes >= 1 and prefix_len >= 0, got {num_prefixes}, {prefix_len}")
    suf_lo, suf_hi = _check_range("suffix_len", suffix_len, minimum=0)
    out_range = (output_len, output_len) if isinstance(output_len, int) else output_len
    out_lo, out_hi = _check_range("output_len", out_range)
    _check_vocab(vocab_size)
    if prefix_len + suf_lo < 1:
        raise ValueError("prefix_len + suffix_len[0] must be >= 1 (empty prompts are not allowed)")
    rng = np.random.default_rng(seed)
    prefixes = [_random_ids(rng, prefix_len, vocab_size) for _ in range(num_prefixes)]
    choice = rng.integers(0, num_prefixes, size=num_requests).tolist()
    suffix_lens = rng.integers(suf_lo, suf_hi + 1, size=num_requests).tolist()
    output_lens = rng.integers(out_lo, out_hi + 1, size=num_requests).tolist()
    requests = [WorkloadRequest(prefixes[c] + _random_ids(rng, s, vocab_size), o)
                for c, s, o in zip(choice, suffix_lens, output_lens)]
    return Workload("shared-prefix", requests, {
        "workload": "shared-prefix", "num_requests": num_requests, "num_prefixes": num_prefixes,
        "prefix_len": prefix_len, "suffix_len": [suf_lo, suf_hi], "output_len": [out_lo, out_hi],
        "prefix_of_request": choice, "vocab_size": vocab_size, "seed": seed,
    })


def multi_turn(num_conversations: int = 8, turns: int = 4, system_len: int = 128,
               user_len: tuple[int, int] = (32, 64), reply_len: int = 32,
               vocab_size: int = 49152, seed: int = 0) -> Workload:
    """Conversations replayed turn by turn: turn t of a conversation sends its whole
    history (its own system prompt, then each earlier user message and reply) and a new
    user message, and asks for a `reply_len`-token reply. The earlier replies are fixed
    random tokens standing in for the model's (a greedy run of a random-weight model
    would not give text worth re-sending), so each turn's prompt extends the previous
    turn's exactly as a client re-sending its history does. Requests are ordered turn 1 of
    every conversation, then turn 2 of every conversation, and so on: replayed at a rate,
    a conversation's next turn comes `num_conversations` requests after the last."""
    if num_conversations < 1 or turns < 1 or system_len < 0 or reply_len < 1:
        raise ValueError("need num_conversations >= 1, turns >= 1, system_len >= 0, "
                         f"reply_len >= 1; got {num_conversations}, {turns}, {system_len}, "
                         f"{reply_len}")
    user_lo, user_hi = _check_range("user_len", user_len)
    _check_vocab(vocab_size)
    rng = np.random.default_rng(seed)
    histories = [_random_ids(rng, system_len, vocab_size) for _ in range(num_conversations)]
    requests, conversation_of = [], []
    for _ in range(turns):
        for c in range(num_conversations):
            histories[c] = histories[c] + _random_ids(
                rng, int(rng.integers(user_lo, user_hi + 1)), vocab_size)
            requests.append(WorkloadRequest(list(histories[c]), reply_len))
            conversation_of.append(c)
            histories[c] = histories[c] + _random_ids(rng, reply_len, vocab_size)
    return Workload("multi-turn", requests, {
        "workload": "multi-turn", "num_conversations": num_conversations, "turns": turns,
        "system_len": system_len, "user_len": [user_lo, user_hi], "reply_len": reply_len,
        "conversation_of_request": conversation_of, "vocab_size": vocab_size, "seed": seed,
    })


@dataclass(frozen=True)
class ReplayRequest:
    """One request of a replay: tokens, forced output length, arrival (s since start)."""

    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float
    priority: int = 0
    tenant: str | None = None
    label: str = ""
    """A class name for summaries, e.g. 'high' or 'background'."""


def mixed_priority_workload(duration_s: float = 40.0, background_rate: float = 2.5,
                            high_rate: float = 0.75,
                            background_prompt: tuple[int, int] = (64, 256),
                            background_output: tuple[int, int] = (32, 128),
                            high_prompt: tuple[int, int] = (32, 96),
                            high_output: tuple[int, int] = (8, 24),
                            background_priority: int = 1, high_priority: int = 0,
                            vocab_size: int = 49152, seed: int = 0) -> list[ReplayRequest]:
    """A low-priority background arriving as a Poisson process at `background_rate`
    requests/s (chosen above the engine's capacity, so it saturates) plus high-priority
    requests at `high_rate`, both for `duration_s` seconds. Lengths are uniform in the
    inclusive ranges; the same arguments give the same workload."""
    rng = np.random.default_rng(seed)
    requests = []
    for label, rate, prompt, output, priority in (
            ("background", background_rate, background_prompt, background_output,
             background_priority),
            ("high", high_rate, high_prompt, high_output, high_priority)):
        t = float(rng.exponential(1.0 / rate))
        while t < duration_s:
            requests.append(ReplayRequest(
                _random_ids(rng, int(rng.integers(prompt[0], prompt[1] + 1)), vocab_size),
                int(rng.integers(output[0], output[1] + 1)), t, priority, None, label))
            t += float(rng.exponential(1.0 / rate))
    return sorted(requests, key=lambda r: r.arrival_time)
