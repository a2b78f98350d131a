"""The weight cache (worker/cpu/weight_cache.py): the quantized linears made from a GGUF
file at the first start are read back at the next one, which neither parses the GGUF
file nor repacks a weight, and runs bit for bit the same."""

from __future__ import annotations

import pytest
import torch

from conftest import use_fresh_cache_dir
from gguf_files import write_tiny_gguf
from test_gguf import prompts, tiny_hf
from test_quantized_engine import TYPES, _core, _logprobs
from treadle.worker.cpu import quantized_linears, weight_cache
from treadle.worker.cpu.native_quant import QuantKernels


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """test_quantized_engine's file: q/k/v Q8_0, o Q4_0, gate/up Q4_1, down Q5_0 (Q8_0 made at
    load)."""
    root = tmp_path_factory.mktemp("weight-cache")
    hf_dir = tiny_hf(root / "hf", "llama", hidden=64, inter=128)
    (root / "gguf").mkdir()
    return write_tiny_gguf(hf_dir, root / "gguf" / "tiny.gguf", "llama", TYPES)


def _no(what: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"{what} ran although the weight cache holds the weights")
    return refuse


def _cache_files(tiny_gguf, dtype: str) -> list:
    from treadle.models.gguf_convert import conversion_dir
    return sorted(conversion_dir(tiny_gguf, getattr(torch, dtype)).glob("quantized-*"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_second_start_reads_the_cache_and_runs_the_same(tiny_gguf, tmp_path, monkeypatch,
                                                          dtype):
    use_fresh_cache_dir(tmp_path / "cache", monkeypatch)
    batch = prompts()[:3]
    first = _core(tiny_gguf, quantization="gguf", dtype=dtype)
    (path,) = _cache_files(tiny_gguf, dtype)
    expected = _logprobs(first, batch)
    made = first.executor.worker.quantized
    monkeypatch.setattr(quantized_linears, "_gguf_rows", _no("reading the GGUF file"))
    monkeypatch.setattr(QuantKernels, "r16_pack", _no("r16 packing"))
    second = _core(tiny_gguf, quantization="gguf", dtype=dtype)
    again = second.executor.worker.quantized
    assert (again.num_quantized, again.dense, again.formats, again.quantized_bytes) == (
        made.num_quantized, made.dense, made.formats, made.quantized_bytes)
    assert _logprobs(second, batch) == expected
    assert _cache_files(tiny_gguf, dtype) == [path]


def test_auto_knows_the_file_from_its_cache(tiny_gguf, tmp_path, monkeypatch):
    use_fresh_cache_dir(tmp_path / "cache", monkeypatch)
    first = _core(tiny_gguf, quantization="auto", dtype="bfloat16")
    if first.executor.worker.quantized is None:
        pytest.skip("auto keeps this CPU's linears dense (no r16 kernel): nothing is cached "
                    "(test_a_second_start_reads_the_cache_and_runs_the_same runs here)")
    monkeypatch.setattr(quantized_linears, "_has_quantized_linears",
                        _no("reading the GGUF file's tensor types"))
    monkeypatch.setattr(quantized_linears, "_gguf_rows", _no("reading the GGUF file"))
    assert _core(tiny_gguf, quantization="auto", dtype="bfloat16").executor.worker.quantized


def test_a_cache_that_does_not_fit_is_remade(tiny_gguf, tmp_path, monkeypatch, caplog):
    use_fresh_cache_dir(tmp_path / "cache", monkeypatch)
    batch = prompts()[:2]
    expected = _logprobs(_core(tiny_gguf, quantization="gguf", dtype="bfloat16"), batch)
    (path,) = _cache_files(tiny_gguf, "bfloat16")
    cached = weight_cache.CachedWeights.read(path)
    name = next(iter(cached.layers))
    layers = {n: q for n, q in ((n, cached.get(n, (cached.layers[n]["out_features"],
                                                    cached.layers[n]["in_features"]), None,
                                                None)) for n in cached.layers)}
    del layers[name]  # a cache missing a layer the model has
    weight_cache.write(path, "gguf", layers, sorted(cached.dense))
    assert _logprobs(_core(tiny_gguf, quantization="gguf", dtype="bfloat16"), batch) == expected
    assert "does not fit this model" in caplog.text
    path.write_bytes(b"not a safetensors file")
    assert _logprobs(_core(tiny_gguf, quantization="gguf", dtype="bfloat16"), batch) == expected
    assert weight_cache.CachedWeights.read(path) is not None  # written again whole
