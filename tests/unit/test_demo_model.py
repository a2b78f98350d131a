"""Tests of the built-in demo model: tokenizer coverage, checkpoint files, cache."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from treadle.models import demo
from treadle.models.demo import (
    DEMO_CONFIG,
    build_demo_tokenizer,
    demo_model_path,
    write_demo_model,
)

VOCAB_SIZE = 49152
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json", "special_tokens_map.json")
ENGLISH = ("The quick brown fox jumps over the lazy dog. In the morning, we served more "
           "requests than anything we have seen before, and the engine kept running.")


@pytest.fixture(scope="module")
def tokenizer():
    return build_demo_tokenizer()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("tiny") / "model", config_overrides=TINY)


def _tensors(path):
    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


# --- tokenizer ---------------------------------------------------------------------------

def test_vocab_has_exactly_49152_ids_with_special_tokens_first(tokenizer):
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    assert tokenizer.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    assert sorted(vocab.values()) == list(range(VOCAB_SIZE))
    assert [tokenizer.id_to_token(i) for i in range(3)] == [
        "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tokenizer.token_to_id("<|im_start|>") == DEMO_CONFIG["bos_token_id"]
    assert tokenizer.token_to_id("<|im_end|>") == DEMO_CONFIG["eos_token_id"]


def test_every_id_decodes_to_non_empty_text(tokenizer):
    ids = [[i] for i in range(VOCAB_SIZE)]
    with_special = tokenizer.decode_batch(ids, skip_special_tokens=False)
    assert all(isinstance(t, str) and t for t in with_special)
    assert with_special[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    # Ordinary tokens decode to text even with the default skip_special_tokens=True.
    assert all(tokenizer.decode([i]) for i in range(3, VOCAB_SIZE, 97))


def test_merges_build_every_token_beyond_the_byte_alphabet(tokenizer):
    model = json.loads(tokenizer.to_str())["model"]
    vocab, merges = model["vocab"], model["merges"]
    alphabet = [t for t, i in vocab.items() if 3 <= i < 259]
    assert len(alphabet) == 256 and all(len(t) == 1 for t in alphabet)
    results = []
    for left, right in merges:
        assert left in vocab and right in vocab and left + right in vocab
        assert vocab[left] < vocab[left + right] and vocab[right] < vocab[left + right]
        results.append(vocab[left + right])
    assert sorted(results) == list(range(259, VOCAB_SIZE))


@pytest.mark.parametrize("text", [
    ENGLISH,
    "日本語のテキストと中文文本，还有한국어。",
    "emoji 😀👍🏽 👨‍👩‍👧‍👦 🇫🇷 and café, naïve, Ελληνικά, русский",
    "  indented\n\n\tcode() {\r\n    return x**2;  }\x00\x7f",
    "<|im_start|>user\nhi<|im_end|>\n",
])
def test_encode_decode_round_trips(tokenizer, text):
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=64))
def test_encode_decode_round_trips_arbitrary_text(tokenizer, text):
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_english_encodes_to_far_fewer_tokens_than_bytes(tokenizer):
    encoding = tokenizer.encode(ENGLISH)
    assert len(encoding.ids) * 2 <= len(ENGLISH.encode())
    assert "Ġthe" in encoding.tokens  # a whole common word is one token


def test_tokenizer_build_is_fast_and_deterministic(tokenizer):
    start = time.perf_counter()
    again = build_demo_tokenizer()
    assert time.perf_counter() - start < 3.0
    assert again.to_str() == tokenizer.to_str()


# --- checkpoint --------------------------------------------------------------------------

def test_tiny_checkpoint_files_and_weights(tiny_dir):
    assert sorted(p.name for p in tiny_dir.iterdir()) == sorted(FILES)
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config == {**DEMO_CONFIG, **TINY}
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2}
    tensors = _tensors(tiny_dir / "model.safetensors")
    assert "lm_head.weight" not in tensors
    assert len(tensors) == 1 + 9 * TINY["num_hidden_layers"] + 1
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert tensors["model.embed_tokens.weight"].shape == (VOCAB_SIZE, 64)
    assert tensors["model.layers.1.self_attn.q_proj.weight"].shape == (64, 64)
    assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (32, 64)
    assert tensors["model.layers.1.mlp.down_proj.weight"].shape == (64, 128)
    assert torch.all(tensors["model.norm.weight"] == 1)
    assert torch.all(tensors["model.layers.0.input_layernorm.weight"] == 1)
    std = tensors["model.embed_tokens.weight"].float().std().item()
    assert 0.019 < std < 0.021


def test_transformers_loads_tokenizer_and_chat_template(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert len(tok) == VOCAB_SIZE
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    no_prompt = tok.apply_chat_template(messages, tokenize=False)
    assert no_prompt == text.removesuffix("<|im_start|>assistant\n")
    ids = tok(text)["input_ids"]
    assert ids[0] == 1 and ids.count(2) == 2  # specials are single ids, no extra BOS added
    assert tok.decode(ids) == text


def test_transformers_loads_tiny_model_and_runs_forward(tiny_dir):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(tiny_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.bfloat16
    saved = _tensors(tiny_dir / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(model.model.embed_tokens.weight, saved)
    assert torch.equal(model.lm_head.weight, saved)  # tied
    with torch.no_grad():
        logits = model(torch.tensor([[1, 400, 5000, 49151]])).logits
    assert logits.shape == (1, 4, VOCAB_SIZE) and torch.isfinite(logits).all()


def test_same_seed_same_bytes_different_seed_different_weights(tmp_path, tiny_dir):
    again = write_demo_model(tmp_path / "again", config_overrides=TINY)
    other = write_demo_model(tmp_path / "other", seed=1, config_overrides=TINY)
    for name in FILES:
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()


def test_write_refuses_non_empty_target_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        write_demo_model(target, config_overrides=TINY)
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert [p.name for p in target.iterdir()] == ["keep.txt"]


def test_full_size_model_has_smollm2_135m_parameter_count(tmp_path):
    path = write_demo_model(tmp_path / "full")
    assert json.loads((path / "config.json").read_text()) == DEMO_CONFIG
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    assert len(shapes) == 2 + 9 * 30
    assert sum(torch.Size(s).numel() for s in shapes.values()) == 134_515_008
    assert shapes["model.layers.29.self_attn.k_proj.weight"] == [192, 576]
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == [1536, 576]


# --- cache -------------------------------------------------------------------------------

@pytest.fixture
def tiny_writes(monkeypatch):
    """Make demo_model_path write the tiny variant (slowly) and record each write."""
    calls = []

    def write_tiny(out_dir, **kwargs):
        calls.append(out_dir)
        time.sleep(0.2)  # widen the window for a racing caller
        return write_demo_model(out_dir, config_overrides=TINY)

    monkeypatch.setattr(demo, "write_demo_model", write_tiny)
    return calls


def test_demo_model_path_creates_once_then_reuses(tmp_path, tiny_writes, caplog):
    with caplog.at_level("INFO", logger="treadle.models.demo"):
        path = demo_model_path(tmp_path)
    assert path == tmp_path / "demo-model-v1"
    assert all((path / name).is_file() for name in FILES)
    assert "created demo model" in caplog.text and str(path) in caplog.text
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert demo_model_path(str(tmp_path)) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert len(tiny_writes) == 1


def test_demo_model_path_default_cache_dir_from_environment(tmp_path, tiny_writes, monkeypatch):
    monkeypatch.setenv("TREADLE_CACHE_DIR", str(tmp_path / "cache"))
    assert demo_model_path() == tmp_path / "cache" / "demo-model-v1"
    assert (tmp_path / "cache" / "demo-model-v1" / "config.json").is_file()


def test_demo_model_path_concurrent_first_use_writes_once(tmp_path, tiny_writes):
    results, errors = [], []

    def use():
        try:
            results.append(demo_model_path(tmp_path))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=use) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and results == [tmp_path / "demo-model-v1"] * 4
    assert len(tiny_writes) == 1


def test_demo_model_path_replaces_incomplete_directory(tmp_path, tiny_writes):
    broken = tmp_path / "demo-model-v1"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    path = demo_model_path(tmp_path)
    assert (path / "model.safetensors").is_file()
    assert json.loads((path / "config.json").read_text())["hidden_size"] == 64
    assert len(tiny_writes) == 1
