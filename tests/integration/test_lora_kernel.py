"""The C LoRA kernel (kernels/lora_bf16.c through worker/cpu/native_lora.py) against the
torch path on the same weights, at every kernel ISA level this CPU executes (AVX-512 and
AVX2 builds: the AVX2 run is the twin that any x86-64 test machine has): fused targets of
several parts, odd ranks, column counts that are not a multiple of the vector width,
several segments of different adapters and sizes, a segment long enough for the torch
path, strided input rows, and an engine run whose greedy tokens equal the torch path's."""

from __future__ import annotations

import pytest
import torch

from treadle.lora import LoRARequest
from treadle.worker.lora.layers import TorchLoRAOps
from treadle.worker.cpu.native_lora import NativeLoRAOps
from treadle.worker.lora.weights import AdapterWeights, PartWeights, TargetWeights

@pytest.fixture(scope="module")
def lib(level_kernels, kernel_level):
    if NativeLoRAOps.load(level_kernels.lib, 1) is None:
        pytest.skip(f"the {kernel_level} build has no vector unit (neither AVX-512 nor AVX2)")
    return level_kernels.lib


def adapter(seed: int, in_features: int, parts: list[tuple[int, int, int]]) -> AdapterWeights:
    """One target (index 0): parts of (first column, last column, rank); weights in bf16
    precision (so both paths start from the same values) stored as fp32, as the manager
    keeps them under a bf16 model."""
    g = torch.Generator().manual_seed(seed)
    a_rows, built, r0 = [], [], 0
    for c0, c1, rank in parts:
        a_rows.append((torch.randn(rank, in_features, generator=g) * 0.1).bfloat16().float())
        b = (torch.randn(c1 - c0, rank, generator=g) * 0.1).bfloat16().float()
        built.append(PartWeights((c0, c1), (r0, r0 + rank), b))
        r0 += rank
    lora = LoRARequest(f"a{seed}", seed + 1, "/nonexistent")
    return AdapterWeights(lora, {0: TargetWeights(torch.cat(a_rows), tuple(built))})


@pytest.mark.parametrize("k, parts", [
    (576, [(0, 576, 16), (576, 768, 16), (768, 960, 16)]),   # q/k/v of the benchmark model
    (64, [(0, 37, 3), (37, 100, 1)]),                          # odd ranks, ragged columns
    (1536, [(0, 576, 8)]),                                      # down_proj
    (100, [(0, 3072, 5), (3072, 6144, 7)]),                     # gate/up, K not a multiple
])
def test_kernel_matches_the_torch_path(lib, k, parts):
    out_features = parts[-1][1]
    adapters = [adapter(seed, k, parts) for seed in range(3)]
    # segments: 1, 5 (more than one task of 4 rows), 3 rows, then one of 70 (torch path)
    bounds = [(adapters[0], 0, 1), (adapters[1], 1, 6), (adapters[2], 6, 9),
              (adapters[0], 9, 79)]
    rows = 80  # row 79 has no adapter: it must stay the base output
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(rows, k + 16, generator=g).bfloat16()
    x = wide[:, 8:8 + k]  # strided rows
    base = torch.randn(rows, out_features, generator=g).bfloat16()

    expected = base.clone()
    TorchLoRAOps().apply_layer(0, x, expected, bounds)
    ops = NativeLoRAOps.load(lib, 1)
    got = base.clone()
    ops.prepare(bounds)
    ops.apply_layer(0, x, got, bounds)

    assert torch.equal(got[79], base[79])
    # The torch path rounds the input rows' product in fp32 too: both are one bf16
    # rounding of the same fp32 sum, apart from summation order.
    torch.testing.assert_close(got.float(), expected.float(), rtol=2 ** -7, atol=1e-5)
    # ...and the kernel really added the terms (not a copy of the base).
    assert (got[:79] != base[:79]).float().mean() > 0.5


def test_segments_over_the_kernel_limit_are_refused(lib):
    ops = NativeLoRAOps.load(lib, 1)
    too_wide = adapter(0, 16, [(0, 8, ops.max_stacked_rank + 1)])
    with pytest.raises(ValueError, match="stacked rank"):
        ops.prepare([(too_wide, 0, 1)])


def test_engine_greedy_tokens_equal_the_torch_path(tmp_path_factory):
    """At the auto ISA level (the kernel tests above cover every level)."""
    from conftest import make_tiny_checkpoint
    from lora_adapters import make_adapter
    from treadle import LLM, SamplingParams

    root = tmp_path_factory.mktemp("lora-kernel")
    base_dir = make_tiny_checkpoint(root / "base", "llama", seed=3)
    paths = [make_adapter(base_dir, root / f"a{i}", rank, 30 + i)
             for i, rank in enumerate((4, 8))]
    loras = [LoRARequest(f"l{i}", i + 1, p) for i, p in enumerate(paths)]
    prompts = [[5 + i, 9, 17, 33 + i, 2 * i + 40] for i in range(6)]
    requests = [loras[i % 2] if i % 3 else None for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def run(native: bool) -> list[list[int]]:
        llm = LLM(model=base_dir, dtype="bfloat16", enable_lora=True, max_loras=2,
                  max_lora_rank=8, num_kv_blocks=128)
        lora = llm.engine.executor.worker.lora
        assert lora.ops_name == "C"
        if not native:
            lora.step.ops = TorchLoRAOps()
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                           lora_request=requests, use_tqdm=False)
        llm.engine.shutdown()
        assert [o.error for o in out] == [None] * len(out)
        return [o.outputs[0].token_ids for o in out]

    # The manager rounds the adapters to bf16 for the kernel, the torch path then computes
    # with the same values in fp32: the two differ in summation order only.
    assert run(True) == run(False)
