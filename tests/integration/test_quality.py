"""Perplexity through treadle and transformers agree (tiny models, fp32, the shipped text in
windows); the windowing scores every token once; the comparison helpers."""

from __future__ import annotations

import pytest
import torch

from treadle.bench import quality
from treadle.models.demo import write_demo_model
from conftest import use_fresh_cache_dir

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.05)


def test_windows_score_every_token_once_with_context():
    for n, window, stride in ((10, 4, 2), (2498, 1024, 512), (100, 100, 50), (7, 16, 8),
                              (1000, 256, 255)):
        spans = quality.windows(n, window, stride)
        scored = [p for _, end, start in spans for p in range(start, end)]
        assert scored == list(range(1, n))
        for start, end, score_from in spans:
            assert end - start <= window and start < score_from <= end
            if start:  # later windows keep window - stride tokens of context
                assert score_from - start >= window - stride
    for window, stride in ((4, 5), (4, 4), (1, 1), (4, 0)):
        with pytest.raises(ValueError, match="stride"):
            quality.windows(10, window, stride)


@pytest.mark.parametrize("source", ["checkpoint", "gguf"])
def test_perplexity_treadle_and_transformers_agree(source, tmp_path, monkeypatch):
    use_fresh_cache_dir(tmp_path / "cache", monkeypatch)
    if source == "checkpoint":
        model = str(write_demo_model(tmp_path / "tiny", seed=2, config_overrides=TINY))
    else:
        from gguf_files import write_tiny_gguf
        from test_gguf import tiny_hf
        model = str(write_tiny_gguf(tiny_hf(tmp_path / "hf", "llama"), tmp_path / "t.gguf",
                                    "llama", {"mlp.": "Q8_0"}))
    result = quality.run_perplexity(model, window=200, stride=100)
    treadle_ppl = result["systems"]["treadle"]["perplexity"]
    hf_ppl = result["systems"]["transformers"]["perplexity"]
    assert result["num_tokens"] > 2000 and result["num_windows"] > 10  # the text, in windows
    assert result["systems"]["treadle"]["num_scored"] == result["num_tokens"] - 1
    assert abs(result["relative_difference"]) < 5e-3
    assert abs(treadle_ppl / hf_ppl - 1) < 1e-4  # fp32: far tighter than the 0.5% bar
    if source == "gguf":
        assert "GGUF t.gguf" in result["systems"]["transformers"]["loaded"]


def test_comparison_helpers():
    assert quality.greedy_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == {
        "first_divergence": 2, "fraction_equal": 0.75, "length_a": 4, "length_b": 4}
    assert quality.greedy_agreement([1, 2], [1, 2, 3])["first_divergence"] is None
    logits = torch.randn(5, 11)
    assert quality.mean_kl_divergence(logits, logits) == pytest.approx(0.0, abs=1e-12)
    assert quality.mean_kl_divergence(logits, logits + 3.0) == pytest.approx(0.0, abs=1e-9)
    assert quality.mean_kl_divergence(logits, torch.zeros(5, 11)) > 0
    assert quality.perplexity([0.0, 0.0]) == 1.0
