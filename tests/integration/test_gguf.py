"""GGUF checkpoints: treadle's greedy tokens equal transformers' on the same GGUF file
(transformers reading it with gguf_file=), for quantized tensors and llama's q/k
permutation; the converted checkpoint is cached; unsupported files fail with their name."""

from __future__ import annotations

import json
from pathlib import Path
import random

import numpy as np
import pytest
import torch

from gguf_files import llama_cpp_permute, write_tiny_gguf
from treadle import LLM, SamplingParams
from treadle.models import gguf_convert, gguf_reader
from treadle.models.resolve import resolve_model, served_model_name
from conftest import use_fresh_cache_dir

PROMPT_LENGTHS = [1, 3, 9, 17, 40, 70]


def tiny_hf(path, family: str, hidden: int = 64, inter: int = 128, head_dim=None,
            vocab: int = 512, seed: int = 0, **extra) -> str:
    import transformers

    cls = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}[family]
    if head_dim:
        extra["head_dim"] = head_dim
    config = getattr(transformers, cls)(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=family == "qwen3", rope_theta=10000.0, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    model.save_pretrained(path)
    return str(path)


def prompts(vocab: int = 512, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def hf_greedy(model, batch, max_tokens: int) -> list[list[int]]:
    model.generation_config.eos_token_id = None
    out = []
    with torch.inference_mode():
        for prompt in batch:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_tokens, pad_token_id=0)
            out.append(gen[0, len(prompt):].tolist())
    return out


def treadle_greedy(model: str, batch, max_tokens: int, **options) -> list[list[int]]:
    llm = LLM(model=model, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=48,
              **options)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


CASES = {
    # llama: the q/k permutation, with q and k themselves quantized (rows permuted as blocks)
    "llama-q8_0-q4_0-q4_1-f16-bf16": ("llama", dict(hidden=64, inter=128), {
        "self_attn.q": "Q8_0", "self_attn.k": "Q8_0", "self_attn.v": "Q4_0",
        "self_attn.o": "Q4_1", "mlp.gate": "Q5_0", "mlp.up": "Q5_1", "mlp.down": "F16",
        "embed": "BF16"}),
    # K-quants need rows of 256 values
    "qwen2-k-quants": ("qwen2", dict(hidden=256, inter=512), {
        "mlp.up": "Q4_K", "mlp.gate": "Q3_K", "mlp.down": "Q5_K", "self_attn.v": "Q6_K",
        "self_attn.o": "Q2_K", "self_attn.q": "Q8_0"}),
    # head_dim 128: transformers' GGUF loader ignores qwen3.attention.key_length and takes
    # Qwen3Config's default (treadle reads it: see the conversion test, head_dim 24)
    "qwen3-q8_0-tied": ("qwen3", dict(hidden=64, inter=128, head_dim=128), {"mlp.": "Q8_0"}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def gguf_case(request, tmp_path_factory):
    family, dims, types = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    hf_dir = tiny_hf(root / "hf", family, **dims)
    (root / "gguf").mkdir()
    path = write_tiny_gguf(hf_dir, root / "gguf" / "tiny.gguf", family, types)
    return request.param, path


def test_greedy_tokens_equal_transformers_on_the_same_gguf(gguf_case, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    use_fresh_cache_dir(tmp_path / "cache", monkeypatch)
    name, path = gguf_case
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                     dtype=torch.float32).eval()
    batch = prompts()
    expected = hf_greedy(reference, batch, 24)
    assert treadle_greedy(str(path), batch, 24) == expected
    # A directory holding the one file is the same model, from the same cached conversion.
    assert treadle_greedy(str(path.parent), batch, 24) == expected
    assert len(list((tmp_path / "cache" / "gguf").iterdir())) == 2  # one key dir + its lock


def test_llama_permutation_is_undone_exactly(tmp_path, monkeypatch):
    """An all-F32 llama GGUF (q/k permuted as llama.cpp does) is the original HF model."""
    from transformers import AutoModelForCausalLM

    use_fresh_cache_dir(tmp_path / "cache", monkeypatch)
    hf_dir = tiny_hf(tmp_path / "hf", "llama")
    path = write_tiny_gguf(hf_dir, tmp_path / "tiny.gguf", "llama")
    converted = resolve_model(str(path), dtype="float32")
    original = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    from safetensors.torch import load_file
    ours = load_file(str(converted / "model.safetensors"))
    for name, value in original.state_dict().items():
        if name == "lm_head.weight" and name not in ours:
            continue
        assert torch.equal(ours[name], value), name
    batch = prompts()
    assert treadle_greedy(str(path), batch, 16) == hf_greedy(original, batch, 16)


def test_a_bf16_checkpoint_written_as_gguf_is_the_same_model(tmp_path, monkeypatch):
    """The GGUF writer reads bf16 checkpoints (the demo writer's, as
    benchmarks/make_issue51_files.py gives it the 1B shape with a vocabulary larger than
    the demo tokenizer's): an all-F32 file of a bf16 demo-shaped checkpoint converts back
    to its exact values, with a tokenizer of the config's vocabulary size."""
    from safetensors.torch import load_file

    from treadle.models.demo import write_demo_model

    use_fresh_cache_dir(tmp_path / "cache", monkeypatch)
    ckpt = write_demo_model(tmp_path / "bf16", seed=3, config_overrides={
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 50000})
    original = load_file(str(ckpt / "model.safetensors"))
    assert original["model.embed_tokens.weight"].dtype == torch.bfloat16
    path = write_tiny_gguf(ckpt, tmp_path / "demo.gguf", "llama")
    converted = resolve_model(str(path), dtype="float32")
    ours = load_file(str(converted / "model.safetensors"))
    assert set(original) <= set(ours)
    for name, value in original.items():
        assert torch.equal(ours[name], value.float()), name
    vocab = json.loads((converted / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(vocab) == 50000


def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path, monkeypatch):
    """Llama 3.x GGUFs carry llama3 rope scaling as a rope_freqs tensor of divisors."""
    from transformers import AutoModelForCausalLM

    use_fresh_cache_dir(tmp_path / "cache", monkeypatch)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
               "rope_theta": 10000.0}
    hf_dir = tiny_hf(tmp_path / "hf", "llama", hidden=256, inter=128, rope_scaling=scaling)
    path = write_tiny_gguf(hf_dir, tmp_path / "l3.gguf", "llama")
    config = json.loads((resolve_model(str(path), dtype="float32") / "config.json").read_text())
    assert config["rope_scaling"] == {k: v for k, v in scaling.items() if k != "rope_theta"}
    original = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    batch = prompts()  # up to 70 tokens: past original_max_position_embeddings
    assert treadle_greedy(str(path), batch, 16) == hf_greedy(original, batch, 16)


def test_unpermute_inverts_llama_cpp_permute_on_rows_and_blocks():
    rng = np.random.default_rng(0)
    for heads, rows in ((4, 64), (2, 32), (9, 576)):
        w = rng.standard_normal((rows, 8)).astype(np.float32)
        assert np.array_equal(gguf_reader.unpermute_rows(llama_cpp_permute(w, heads), heads), w)
    blocks = rng.integers(0, 255, size=(32, 34), dtype=np.uint8)  # Q8_0 rows: whole blocks
    assert np.array_equal(gguf_reader.unpermute_rows(llama_cpp_permute(blocks, 4), 4), blocks)


def test_conversion_is_cached_and_config_tokenizer_come_from_metadata(tmp_path, monkeypatch,
                                                                      caplog):
    use_fresh_cache_dir(tmp_path / "cache", monkeypatch)
    hf_dir = tiny_hf(tmp_path / "hf", "qwen3", head_dim=24)
    path = write_tiny_gguf(hf_dir, tmp_path / "m.gguf", "qwen3", {"mlp.": "Q8_0"})
    with caplog.at_level("INFO", logger="treadle.models.gguf_convert"):
        first = resolve_model(str(path), dtype="float32")
        second = resolve_model(str(path), dtype="float32")
    assert first == second and first.name == "m"
    assert sum("converting" in r.message for r in caplog.records) == 1
    assert served_model_name(str(path), first) == "m"
    config = json.loads((first / "config.json").read_text())
    original = json.loads((tmp_path / "hf" / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"):
        assert config[key] == original[key], key
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["tie_word_embeddings"]
    source = json.loads((first / gguf_convert.SOURCE_FILE).read_text())
    assert source["tensor_types"]["Q8_0"] == 6 and source["sha256"] == \
        gguf_convert.file_sha256(path)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(first))
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # bfloat16 is its own conversion, stored in bfloat16
    bf16 = resolve_model(str(path), dtype="bfloat16")
    assert bf16 != first and json.loads((bf16 / "config.json").read_text())["torch_dtype"] \
        == "bfloat16"


def test_raw_tensors_keep_quantized_blocks_for_later_use(tmp_path):
    hf_dir = tiny_hf(tmp_path / "hf", "llama")
    path = write_tiny_gguf(hf_dir, tmp_path / "m.gguf", "llama", {"mlp.up": "Q8_0"})
    gguf = gguf_reader.open_gguf(path)
    raws = {r.hf_name: r for r in gguf_reader.raw_tensors(gguf)}
    up = raws["model.layers.0.mlp.up_proj.weight"]
    assert up.tensor_type == "Q8_0" and up.shape == (128, 64)
    assert up.data.dtype == np.uint8 and up.data.shape == (128, 2 * 34)  # 2 blocks per row
    assert gguf_reader.dequantize(up, torch.float32).shape == (128, 64)


def test_unsupported_architecture_and_tensor_type_are_named(tmp_path):
    from gguf import GGMLQuantizationType, GGUFWriter

    phi = tmp_path / "phi.gguf"
    writer = GGUFWriter(str(phi), "phi2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'phi2'"):
        resolve_model(str(phi), dtype="float32")

    hf_dir = tiny_hf(tmp_path / "hf", "llama")
    path = write_tiny_gguf(hf_dir, tmp_path / "m.gguf", "llama")
    gguf = gguf_reader.open_gguf(path)
    gguf.reader.tensors[3] = gguf.reader.tensors[3]._replace(
        tensor_type=GGMLQuantizationType.IQ2_XXS)
    with pytest.raises(ValueError, match="unsupported GGUF tensor type IQ2_XXS"):
        gguf_reader.check_supported(gguf)
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        resolve_model(str(not_gguf), dtype="float32")


def test_file_sha256_reads_a_file_once_until_it_changes(tmp_path, monkeypatch):
    import hashlib
    from types import SimpleNamespace

    reads = []

    def counting_sha256():
        reads.append(1)
        return hashlib.sha256()

    monkeypatch.setattr(gguf_convert, "hashlib", SimpleNamespace(sha256=counting_sha256))
    path = tmp_path / "f.gguf"
    path.write_bytes(b"a" * 10)
    assert gguf_convert.file_sha256(path) == hashlib.sha256(b"a" * 10).hexdigest()
    assert gguf_convert.file_sha256(str(path)) == hashlib.sha256(b"a" * 10).hexdigest()
    assert len(reads) == 1
    path.write_bytes(b"b" * 11)  # another size (and mtime): read again
    assert gguf_convert.file_sha256(path) == hashlib.sha256(b"b" * 11).hexdigest()
    assert len(reads) == 2


def test_a_copy_of_a_converted_gguf_is_its_own_quantization_source(tmp_path, monkeypatch):
    """The conversion cache is keyed by content: a copy of the file elsewhere reuses it,
    and --quantization gguf then reads the copy (the first file may be gone)."""
    import shutil

    from treadle.models.resolve import gguf_source

    use_fresh_cache_dir(tmp_path / "cache", monkeypatch)
    hf_dir = tiny_hf(tmp_path / "hf", "llama")
    first = write_tiny_gguf(hf_dir, tmp_path / "a.gguf", "llama", {"mlp.": "Q8_0"})
    checkpoint = resolve_model(str(first), dtype="float32")
    assert gguf_source(str(checkpoint)) == first.resolve()
    (tmp_path / "copy").mkdir()
    copy = Path(shutil.copy(first, tmp_path / "copy" / "a.gguf"))
    first.unlink()
    assert gguf_source(str(checkpoint)) is None  # the recorded file is gone
    assert resolve_model(str(copy), dtype="float32") == checkpoint  # same content: reused
    assert gguf_source(str(checkpoint)) == copy.resolve()
