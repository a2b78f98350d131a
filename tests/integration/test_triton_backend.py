"""The `triton` attention backend (worker/cuda/triton_attention.py) against the
`reference` backend on the steps of test_attention_backends, and the engine's greedy
tokens with it against the reference backend's. On CPU under triton's interpreter."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the triton extra is not installed "
                                     "(pip install -e '.[triton]')")

from test_attention_backends import (BLOCK_SIZE, NUM_BLOCKS, STEPS, make_step,  # noqa: E402
                                     rotary_for)

from treadle import LLM, SamplingParams  # noqa: E402
from treadle.layers.rotary import RotaryInputs  # noqa: E402
from treadle.layers.attention import AttentionLayer  # noqa: E402
from treadle.worker.attention_backends import make_attention_backend  # noqa: E402
from treadle.worker.kv_cache import KVCacheSpec  # noqa: E402
from treadle.worker.cpu.platform import CPU  # noqa: E402
from treadle.worker.device import get_platform  # noqa: E402

pytestmark = pytest.mark.triton
PLATFORM = get_platform("auto")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 64), (8, 1, 128), (3, 3, 24)])
@pytest.mark.parametrize("case", sorted(STEPS))
def test_triton_backend_matches_reference(dtype, heads, kv_heads, head_dim, case):
    rng = np.random.default_rng(zlib.crc32(f"{heads}-{kv_heads}-{head_dim}-{case}".encode()))
    step, positions = make_step(rng, STEPS[case])
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    heads_first = torch.randn(2, kv_heads, NUM_BLOCKS, BLOCK_SIZE, head_dim,
                              generator=gen).to(dtype)
    qk = torch.randn(step.num_tokens, heads + kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(step.num_tokens, kv_heads, head_dim, generator=gen).to(dtype)
    rotary = rotary_for(positions, head_dim, dtype)
    layer = AttentionLayer(heads, kv_heads, head_dim, head_dim ** -0.5)

    reference = make_attention_backend("reference", CPU, kv_heads, head_dim, dtype)
    ref_cache = heads_first.clone()
    ref_out = layer(qk, value, ref_cache, reference.build_metadata(step, torch.device("cpu")),
                    rotary)

    triton = make_attention_backend("triton", PLATFORM, kv_heads, head_dim, dtype)
    assert triton.name == "triton" and triton.kv_layout == "blocks_first"
    device = PLATFORM.device
    cache = heads_first.permute(0, 2, 3, 1, 4).contiguous().to(device)
    assert cache.shape == KVCacheSpec(1, kv_heads, head_dim, dtype,
                                      "blocks_first").shape(NUM_BLOCKS, BLOCK_SIZE)
    rotary = RotaryInputs(rotary.cos.to(device), rotary.sin.to(device))
    out = layer(qk.to(device), value.to(device), cache, triton.build_metadata(step, device),
                rotary)
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(cache.cpu().permute(0, 3, 1, 2, 4), ref_cache, atol=0, rtol=0)
    torch.testing.assert_close(out.float().cpu(), ref_out.float(), **tol)


def test_triton_backend_refused_on_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        make_attention_backend("triton", CPU, 2, 64, torch.float32)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_engine_tokens_with_triton_equal_reference(tmp_path, kv_cache_dtype):
    """With fp8_e4m3 the Triton kernels read and write fp8 rows as the reference does."""
    from conftest import make_tiny_checkpoint

    model_dir = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 7, 20)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    tokens = {}
    for backend in ("reference", "triton"):
        llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=64, block_size=4,
                  max_num_batched_tokens=16, attention_backend=backend,
                  kv_cache_dtype=kv_cache_dtype, device=PLATFORM.name)
        assert llm.engine.info.attention_backend == backend
        cache = llm.engine.executor.worker.runner.kv_caches[0]
        assert (cache.dtype == torch.uint8) == (kv_cache_dtype == "fp8_e4m3")
        out = llm.generate(prompts, params, use_tqdm=False)
        tokens[backend] = [list(o.outputs[0].token_ids) for o in out]
    assert tokens["triton"] == tokens["reference"]

