"""Tiny random checkpoints of every supported family, made by transformers in the test run."""

from __future__ import annotations

import pytest
import torch

FAMILIES = {
    "llama": dict(cls="LlamaConfig", extra={"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128}}),
    "mistral": dict(cls="MistralConfig", extra={"sliding_window": None,
                                                "tie_word_embeddings": True}),
    "qwen2": dict(cls="Qwen2Config", extra={"rope_scaling": {"rope_type": "linear",
                                                             "factor": 2.0}}),
    "qwen3": dict(cls="Qwen3Config", extra={"head_dim": 24}),
}


def make_tiny_checkpoint(path, family: str, vocab_size: int = 512, seed: int = 0) -> str:
    import transformers

    spec = FAMILIES[family]
    config = getattr(transformers, spec["cls"])(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.2, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
        **spec["extra"])
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session", params=sorted(FAMILIES))
def tiny_checkpoint(request, tmp_path_factory):
    """(family, checkpoint dir) for each supported family."""
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return request.param, make_tiny_checkpoint(path, request.param)
