"""The Llama-family model and loader against transformers, on tiny random checkpoints (CPU).

Each checkpoint is made by transformers itself (save_pretrained); treadle loads it, runs a
prefill and greedy decode steps through the paged attention (the torch backend, with a
hand-built step geometry), and its logits must match transformers' eager forward on the
same tokens.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from treadle.layers.attention import AttentionStep
from treadle.layers.rotary import RotaryEmbedding
from treadle.models.llama import LlamaForCausalLM
from treadle.models.loader import iterate_weights, load_model, resolve_dtype, safetensors_files
from treadle.models.registry import SUPPORTED_ARCHITECTURES, resolve_model_class
from treadle.worker.attention.torch_backend import TorchBackend
from treadle.worker.cpu.platform import auto_dtype

ATOL = 1e-4
NUM_BLOCKS = 24

BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=256, max_position_embeddings=512,
            initializer_range=0.2)

CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "llama_bias": ("LlamaConfig", "LlamaForCausalLM",
                   dict(attention_bias=True, mlp_bias=True, num_hidden_layers=3)),
    "llama_linear": ("LlamaConfig", "LlamaForCausalLM",
                     dict(rope_parameters={"rope_type": "linear", "factor": 4.0,
                                           "rope_theta": 10000.0})),
    "llama3": ("LlamaConfig", "LlamaForCausalLM",
               dict(rope_parameters={"rope_type": "llama3", "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 16,
                                     "rope_theta": 500000.0})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=4096)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, num_hidden_layers=3)),
}


def make_checkpoint(path: Path, case: str, **save_kwargs) -> Path:
    config_name, model_name, overrides = CASES[case]
    config = getattr(transformers, config_name)(**{**BASE, **overrides})
    torch.manual_seed(zlib.crc32(case.encode()))  # hash() of a str changes per process
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():  # init leaves norms at 1 and biases at 0: make them count
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(path, **save_kwargs)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {case: make_checkpoint(root / case, case) for case in CASES}


def hf_logits(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return ref(torch.tensor([token_ids])).logits[0].float()


def new_kv_caches(model: LlamaForCausalLM, block_size: int) -> list[torch.Tensor]:
    shape = (2, model.num_kv_heads, NUM_BLOCKS, block_size, model.head_dim)
    return [torch.zeros(shape, dtype=model.dtype) for _ in range(model.num_layers)]


class Sequence:
    """One request's tokens and its blocks; blocks are contiguous from `first_block`."""

    def __init__(self, token_ids: list[int], block_size: int, first_block: int = 0):
        self.token_ids = list(token_ids)
        self.block_size = block_size
        self.first_block = first_block

    def blocks(self, num_tokens: int) -> np.ndarray:
        return np.arange(math.ceil(num_tokens / self.block_size)) + self.first_block

    def slots(self, positions: np.ndarray) -> np.ndarray:
        return positions + self.first_block * self.block_size


def run_rows(model, kv_caches, rows: list[tuple[Sequence, int, int]]) -> torch.Tensor:
    """One step over tokens [start, end) of each (seq, start, end), rows in batch order
    (single-token rows first): the logits of every token."""
    block_size = rows[0][0].block_size
    q_lens = np.array([end - start for _, start, end in rows], dtype=np.int64)
    starts = np.array([start for _, start, _ in rows], dtype=np.int64)
    table = np.zeros((len(rows), max(math.ceil(end / block_size) for _, _, end in rows)),
                     dtype=np.int64)
    for i, (seq, _, end) in enumerate(rows):
        blocks = seq.blocks(end)
        table[i, :len(blocks)] = blocks
    positions = np.concatenate([np.arange(start, end) for _, start, end in rows])
    slots = np.concatenate([seq.slots(np.arange(start, end)) for seq, start, end in rows])
    step = AttentionStep(q_lens, np.cumsum(q_lens) - q_lens, starts, table, slots,
                         int(np.count_nonzero(q_lens == 1)), block_size, NUM_BLOCKS)
    meta = TorchBackend(model.num_kv_heads).build_metadata(step, torch.device("cpu"))
    input_ids = [t for seq, start, end in rows for t in seq.token_ids[start:end]]
    with torch.no_grad():
        hidden = model(torch.tensor(input_ids), torch.from_numpy(positions), kv_caches, meta)
        return model.compute_logits(hidden)


def run_prefill(model, kv_caches, seq: Sequence) -> torch.Tensor:
    return run_rows(model, kv_caches, [(seq, 0, len(seq.token_ids))])


def run_decode(model, kv_caches, seq: Sequence) -> torch.Tensor:
    n = len(seq.token_ids)
    return run_rows(model, kv_caches, [(seq, n - 1, n)])[0]


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, BASE["vocab_size"], (n,),
                         generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("block_size", [4])
@pytest.mark.parametrize("case", list(CASES))
def test_prefill_and_decode_match_transformers(checkpoints, case, block_size):
    model, config = load_model(checkpoints[case], "float32")
    assert isinstance(model, LlamaForCausalLM) and not model.training
    assert all(not p.requires_grad for p in model.parameters())
    kv_caches = new_kv_caches(model, block_size)
    seq = Sequence(prompt(40), block_size)
    logits = run_prefill(model, kv_caches, seq)
    assert logits.dtype == torch.float32 and logits.shape == (40, BASE["vocab_size"])
    torch.testing.assert_close(logits, hf_logits(checkpoints[case], seq.token_ids),
                               atol=ATOL, rtol=0)
    decoded = []
    next_token = int(logits[-1].argmax())
    for _ in range(3):
        seq.token_ids.append(next_token)
        step_logits = run_decode(model, kv_caches, seq)
        decoded.append(step_logits)
        next_token = int(step_logits.argmax())
    ref = hf_logits(checkpoints[case], seq.token_ids)
    torch.testing.assert_close(torch.stack(decoded), ref[-3:], atol=ATOL, rtol=0)


def test_attributes_follow_config(checkpoints):
    model, config = load_model(checkpoints["qwen3"], "float32")
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (3, 2, 32)
    assert (model.vocab_size, model.max_position_embeddings) == (256, 512)
    assert model.sliding_window is None and config["model_type"] == "qwen3"
    mistral, _ = load_model(checkpoints["mistral"], "float32")
    assert mistral.sliding_window == 4096
    for case in ("llama", "llama_tied", "qwen2"):
        model, _ = load_model(checkpoints[case], "float32")
        ref = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[case])
        assert model.num_parameters == sum(p.numel() for p in ref.parameters())
        assert model.tie_word_embeddings == (case != "llama")


def test_mixed_batch_of_prefill_chunks_and_decodes(checkpoints):
    """Two requests in one flat batch: a chunked prefill beside a prefill, then a decode."""
    model, _ = load_model(checkpoints["llama_bias"], "float32")
    block_size = 4
    kv_caches = new_kv_caches(model, block_size)
    a = Sequence(prompt(18, seed=1), block_size, first_block=0)
    b = Sequence(prompt(23, seed=2), block_size, first_block=8)
    # Step 1: all of a's prompt, then the first 10 tokens of b's.
    logits = run_rows(model, kv_caches, [(a, 0, 18), (b, 0, 10)])
    a.token_ids.append(int(logits[17].argmax()))
    # Step 2: a's decode, then the rest of b's prompt.
    logits = run_rows(model, kv_caches, [(a, 18, 19), (b, 10, 23)])
    torch.testing.assert_close(logits[0], hf_logits(checkpoints["llama_bias"], a.token_ids)[-1],
                               atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1:], hf_logits(checkpoints["llama_bias"], b.token_ids)[10:],
                               atol=ATOL, rtol=0)


def test_sharded_checkpoint_matches_single_file(checkpoints, tmp_path):
    sharded = make_checkpoint(tmp_path / "sharded", "qwen2", max_shard_size="50KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model, _ = load_model(sharded, "float32")
    seq = Sequence(prompt(40), 16)
    logits = run_prefill(model, new_kv_caches(model, 16), seq)
    torch.testing.assert_close(logits, hf_logits(sharded, seq.token_ids), atol=ATOL, rtol=0)

    missing = sorted(set(index["weight_map"].values()))[1]
    (sharded / missing).unlink()
    with pytest.raises(FileNotFoundError, match=missing):
        load_model(sharded, "float32")


def test_missing_files_are_named(checkpoints, tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "config.json")):
        load_model(tmp_path, "float32")
    (tmp_path / "config.json").write_text((checkpoints["llama"] / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="model.safetensors.*model.safetensors.index.json"):
        load_model(tmp_path, "float32")


def test_unsupported_architecture(checkpoints, tmp_path):
    config = json.loads((checkpoints["llama"] / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(tmp_path, "float32")
    assert set(SUPPORTED_ARCHITECTURES) == {"LlamaForCausalLM", "MistralForCausalLM",
                                            "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                            "Gemma3ForCausalLM"}
    assert resolve_model_class(["Foo", "Qwen3ForCausalLM"]) is LlamaForCausalLM


def test_bfloat16_is_close_to_float32(checkpoints):
    fp32, _ = load_model(checkpoints["qwen3"], "float32")
    bf16, _ = load_model(checkpoints["qwen3"], "bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    seq = Sequence(prompt(40), 16)
    ref = run_prefill(fp32, new_kv_caches(fp32, 16), seq)
    out = run_prefill(bf16, new_kv_caches(bf16, 16), seq)
    assert out.dtype == torch.float32
    # The relative error over all logits: the largest single-element error is a tail
    # statistic that moved from 1.7% to 6% of the largest logit across 30 random inits.
    assert (out - ref).norm() < 0.05 * ref.norm()
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


def test_resolve_dtype():
    assert resolve_dtype("float32") is torch.float32
    assert resolve_dtype("bfloat16") is torch.bfloat16
    assert resolve_dtype("auto", auto_dtype) in (torch.float32, torch.bfloat16)
    with pytest.raises(ValueError, match="float16"):
        resolve_dtype("float16")


def test_rope_settings_old_and_new_config_forms():
    head_dim, max_pos = 16, 64
    new = {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}}
    old = {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 5000.0}
    a = RotaryEmbedding(new, head_dim, max_pos, torch.float32).cos_sin_cache
    b = RotaryEmbedding(old, head_dim, max_pos, torch.float32).cos_sin_cache
    assert torch.equal(a, b)
    plain = RotaryEmbedding({"rope_theta": 5000.0}, head_dim, max_pos, torch.float32)
    # Linear scaling at position 2p equals no scaling at position p.
    torch.testing.assert_close(a[20], plain.cos_sin_cache[10])
    with pytest.raises(ValueError, match="'yarnish'"):
        RotaryEmbedding({"rope_parameters": {"rope_type": "yarnish"}}, head_dim, max_pos,
                        torch.float32)


def test_load_weights_names_unexpected_and_missing(checkpoints):
    model, _ = load_model(checkpoints["llama"], "float32")
    model.load_weights(model.state_dict().items())  # treadle's own (fused) names load too
    hf_weights = dict(iterate_weights(safetensors_files(checkpoints["llama"]), torch.float32))
    extra = {**hf_weights, "model.layers.2.mlp.up_proj.weight": torch.zeros(128, 64)}
    with pytest.raises(ValueError, match=r"unexpected.*layers\.2\.mlp\.up_proj"):
        model.load_weights(extra.items())
    bad_shape = {**hf_weights, "model.norm.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match="model.norm.weight"):
        model.load_weights(bad_shape.items())
    del hf_weights["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"never loaded.*layers\.1\.self_attn\.qkv_proj"):
        model.load_weights(hf_weights.items())
