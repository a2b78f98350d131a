"""The built-in demo model: a deterministic Hugging Face checkpoint of the benchmark shape.

Owns the demo checkpoint (SmolLM2-135M's shape, random weights from a fixed seed), its
byte-level BPE tokenizer (built from rules, never trained on data, covering all 49152 ids),
and the on-disk cache that creates it once per machine. Every file it writes is
byte-identical for the same seed, so every system under test loads exactly the same model.

It must not download anything, must not depend on the engine (only torch, safetensors,
tokenizers), and must never expose a half-written model directory.
"""

from __future__ import annotations

import fcntl
import heapq
import json
import logging
import os
import pathlib
import shutil
import tempfile
import time
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from treadle.paths import cache_dir as default_cache_dir

logger = logging.getLogger(__name__)

DEMO_MODEL_NAME = "demo-model-v1"
"""Directory name of the demo model in the cache; bump the suffix when its files change."""

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Special tokens at ids 0, 1, 2 (SmolLM2's ids): unk/end of text, bos, eos/pad."""

DEMO_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "initializer_range": 0.02,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML, as SmolLM2 uses it (without SmolLM2's default system prompt)."""

_INIT_STD = 0.02
_LOWER = "etaoinshrdlcumwfgypbvkjxqz"  # English letter-frequency order: a constant, not learned
_UPPER = _LOWER.upper()
_DIGITS = "0123456789"
_SPACE, _NEWLINE = "Ġ", "Ċ"  # byte-level symbols of b" " and b"\n"
_RANK = {c: i for i, c in enumerate(_LOWER)} | {c: i for i, c in enumerate(_UPPER)}
_RANK |= {c: int(c) for c in _DIGITS}


def _byte_alphabet() -> list[str]:
    """The 256 byte-level symbols in byte order (GPT-2's bytes_to_unicode mapping)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return [symbols[byte] for byte in range(256)]


def _build_merges(num_merges: int) -> list[tuple[str, str]]:
    """Return `num_merges` merges in rank order, built from fixed rules.

    Families of tokens grow one symbol at a time by appending a symbol to a stem:
    space-prefixed words ("Ġthe"), words ("the"), capitalized prefixes ("Th", "ĠTh"),
    digit runs ("123", "Ġ12"), plus runs of spaces and newlines. Tokens are chosen level by
    level (shorter first; within a level, most frequent letters first) until the count is
    reached. Ranks then run family by family, so BPE grows one word greedily from its
    start ("Ġt" -> "Ġth" -> "Ġthe") instead of cutting it into unrelated pairs.
    """
    chosen: list[tuple[int, int, int, str, str]] = []  # (family, level, score, left, right)
    chosen += [(0, 1, 0, _SPACE * n, _SPACE) for n in range(1, 16)]
    chosen += [(0, 1, 0, _NEWLINE * n, _NEWLINE) for n in range(1, 4)]
    chosen += [(0, 1, _RANK[u], _SPACE, u) for u in _UPPER]
    # family id (= rank priority): [(score, stem) pairs, symbols to append, levels left]
    families: dict[int, list[Any]] = {
        1: [[(0, _SPACE)], _LOWER, None],  # unbounded: fills the vocabulary up
        2: [[(_RANK[u], _SPACE + u) for u in _UPPER], _LOWER, 1],
        3: [[(_RANK[u], u) for u in _UPPER], _LOWER, 1],
        4: [[(_RANK[c], c) for c in _LOWER], _LOWER, 2],
        5: [[(0, _SPACE)], _DIGITS, 2],
        6: [[(_RANK[d], d) for d in _DIGITS], _DIGITS, 2],
    }
    level = 1
    while len(chosen) < num_merges:
        level += 1
        candidates = heapq.nsmallest(num_merges - len(chosen), (
            (score + _RANK[sym], family, stem, sym)
            for family, (stems, symbols, left) in families.items() if left != 0
            for score, stem in stems for sym in symbols
        ))
        if not candidates:
            raise ValueError(f"rules yield fewer than {num_merges} merges")
        for stems_symbols_left in families.values():
            stems_symbols_left[0] = []
            left = stems_symbols_left[2]
            stems_symbols_left[2] = None if left is None else left - 1
        for score, family, stem, sym in candidates:
            chosen.append((family, level, score, stem, sym))
            families[family][0].append((score, stem + sym))
    return [(left, right) for *_, left, right in sorted(chosen)]


def build_demo_tokenizer() -> Tokenizer:
    """Build the demo byte-level BPE tokenizer: exactly `DEMO_CONFIG["vocab_size"]` ids.

    Ids 0..2 are the special tokens, 3..258 the byte-level alphabet (so any text
    round-trips), the rest tokens made by deterministic merges (see `_build_merges`).
    """
    vocab_size = DEMO_CONFIG["vocab_size"]
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *_byte_alphabet()])}
    merges = _build_merges(vocab_size - len(vocab))
    for left, right in merges:
        vocab[left + right] = len(vocab)
    assert len(vocab) == vocab_size, "merge rules produced a duplicate token"
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in SPECIAL_TOKENS])
    return tokenizer


def _parameter_shapes(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """HF Llama parameter names and shapes, in the fixed order weights are drawn."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    num_heads, num_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // num_heads
    shapes = [("model.embed_tokens.weight", (config["vocab_size"], hidden))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (num_heads * head_dim, hidden)),
            (p + "self_attn.k_proj.weight", (num_kv_heads * head_dim, hidden)),
            (p + "self_attn.v_proj.weight", (num_kv_heads * head_dim, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, num_heads * head_dim)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
            (p + "input_layernorm.weight", (hidden,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
        ]
    shapes.append(("model.norm.weight", (hidden,)))
    if not config.get("tie_word_embeddings", False):
        shapes.append(("lm_head.weight", (config["vocab_size"], hidden)))
    return shapes


def _random_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Normal(0, 0.02) matrices and unit norm weights, drawn in float32, stored in bfloat16."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    weights = {}
    for name, shape in _parameter_shapes(config):
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            values = torch.empty(shape, dtype=torch.float32).normal_(0.0, _INIT_STD,
                                                                     generator=generator)
            weights[name] = values.to(torch.bfloat16)
    return weights


def _write_json(path: pathlib.Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_files(out: pathlib.Path, config: dict[str, Any], seed: int) -> None:
    """Write every file of the checkpoint into the existing directory `out`."""
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json",
                {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]})
    save_file(_random_weights(config, seed), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    build_demo_tokenizer().save(str(out / "tokenizer.json"))
    unk, bos, eos = SPECIAL_TOKENS
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, t in enumerate(SPECIAL_TOKENS)
        },
        "bos_token": bos, "eos_token": eos, "pad_token": eos, "unk_token": unk,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    })
    _write_json(out / "special_tokens_map.json",
                {"bos_token": bos, "eos_token": eos, "pad_token": eos, "unk_token": unk})


def write_demo_model(out_dir: str | os.PathLike[str], *, seed: int = 0,
                     config_overrides: dict[str, Any] | None = None) -> pathlib.Path:
    """Write the demo checkpoint to `out_dir` (which must not exist or be empty); return it.

    `config_overrides` (e.g. fewer layers, a smaller hidden size) change config.json and the
    weight shapes; the tokenizer always has all 49152 ids. The files are written into a
    temporary sibling directory renamed into place at the end, so `out_dir` is either
    absent or complete.
    """
    out = pathlib.Path(out_dir)
    config = {**DEMO_CONFIG, **(config_overrides or {})}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_files(tmp, config, seed)
        os.chmod(tmp, 0o755)  # mkdtemp creates 0o700; make it an ordinary directory
        try:
            os.replace(tmp, out)
        except OSError as exc:
            raise FileExistsError(f"{out} exists and is not empty") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _is_complete(path: pathlib.Path) -> bool:
    return all((path / name).is_file() for name in
               ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"))


def demo_model_path(cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Return `<cache_dir>/demo-model-v1`, writing the demo model there on first use.

    `cache_dir` defaults to `$TREADLE_CACHE_DIR`, else `~/.cache/treadle`. A complete
    directory is reused as is; concurrent first use by several processes is serialized by
    an exclusive lock on `<cache_dir>/demo-model-v1.lock`.
    """
    if cache_dir is None:
        cache_dir = default_cache_dir()
    cache = pathlib.Path(cache_dir).expanduser()
    path = cache / DEMO_MODEL_NAME
    if _is_complete(path):
        return path
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{DEMO_MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if _is_complete(path):  # another process wrote it while we waited
            return path
        if path.exists():  # not one of ours (our writes are atomic): start afresh
            shutil.rmtree(path)
        start = time.perf_counter()
        write_demo_model(path)
        logger.info("created demo model at %s in %.1f s", path, time.perf_counter() - start)
    return path
