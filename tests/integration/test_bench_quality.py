"""`treadle bench quality`: the comparison's arithmetic, and one small run of every
configuration end to end (on a tiny random model: its figures mean nothing, the real
figures come from SmolLM2; what is checked is that every path scores the same tokens)."""

from __future__ import annotations

import numpy as np
import pytest

from treadle.bench.quantized_quality import compare, configurations, run_quality
from treadle.models.demo import write_demo_model

TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=512, initializer_range=0.2)


def test_compare_is_top1_agreement_and_mean_kl():
    rng = np.random.default_rng(0)
    p = rng.normal(size=(7, 50)).astype(np.float32)
    q = rng.normal(size=(7, 50)).astype(np.float32)
    lp = p - np.log(np.exp(p).sum(1, keepdims=True))
    lq = q - np.log(np.exp(q).sum(1, keepdims=True))
    same = compare(lp.astype(np.float16), lp.astype(np.float16))
    assert same == {"top1_agreement": 1.0, "mean_kl": pytest.approx(0.0, abs=1e-6)}
    other = compare(lp.astype(np.float16), lq.astype(np.float16), block=3)
    expected_kl = float((np.exp(lp) * (lp - lq)).sum(1).mean())
    assert other["mean_kl"] == pytest.approx(expected_kl, rel=2e-3)
    assert other["top1_agreement"] == np.mean(lp.argmax(1) == lq.argmax(1))
    with_inf = lq.copy()
    with_inf[:, 0] = -np.inf  # float16 underflow: clamped, never an infinite KL
    assert np.isfinite(compare(lp.astype(np.float16), with_inf.astype(np.float16))["mean_kl"])


def test_every_configuration_scores_the_same_tokens(tmp_path):
    model = write_demo_model(tmp_path / "m", seed=2, config_overrides=TINY)
    text = tmp_path / "text.txt"
    text.write_text("the river runs past the mill and the mill turns slowly " * 30)
    assert "GGUF kernels, bf16" not in configurations(64, is_gguf=False)
    result = run_quality(str(model), texts=[text], window=64, min_tokens=100)
    rows = result["rows"]
    assert list(rows) == list(configurations(64, is_gguf=False))
    assert result["num_scored"] >= 100
    for name, row in list(rows.items())[1:]:
        assert 0.0 <= row["top1_agreement"] <= 1.0 and row["mean_kl"] >= 0.0, name
    assert rows["bf16"]["mean_kl"] < 0.05  # bf16 against float32 on the same weights
    with pytest.raises(ValueError, match="fewer than"):
        run_quality(str(model), texts=[text], window=64, min_tokens=10_000)
