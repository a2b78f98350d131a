"""Gemma 3 on the C kernels: the layer kernels (kernels/norm_bf16.c) give torch's Gemma
numerics, and the Gemma decode stack (worker/cpu/gemma_stack.py) gives the same
log-probabilities, bit for bit, as the model's layers run one by one on those kernels, with
local layers past their window, at every ISA level this CPU runs, dense and quantized;
models it does not cover keep their layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gguf_files import write_tiny_gguf
from test_decode_stack import _core, _Counting, _generate
from test_gemma3 import make_gemma3

from treadle.models.gemma3 import gemma_rms_norm
from treadle.worker.cpu.gemma_stack import GemmaDecodeStack

WINDOW = 8


def _gemma(path, **overrides) -> str:
    """Gemma 3 270M's grouping (4 query heads on 1 KV head, head_dim 256) at a tiny width,
    no softcaps (Gemma 3's own configs have none), a short window and every third layer
    global."""
    settings = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                    query_pre_attn_scalar=256, sliding_window=WINDOW, sliding_window_pattern=3,
                    final_logit_softcapping=None, attn_logit_softcapping=None)
    return make_gemma3(path, **{**settings, **overrides})


def test_the_layer_kernels_give_torchs_gemma_numerics(kernel_level, level_kernels):
    from treadle.worker.cpu.native_linear import NativeLayerOps

    ops = NativeLayerOps.load(level_kernels.lib)
    if ops is None:
        pytest.skip(f"the {kernel_level} build has no vector unit")
    g = torch.Generator().manual_seed(0)
    m, h, i, d = 5, 80, 200, 48  # widths that end in a partial vector
    hidden = torch.randn(m, h, generator=g).bfloat16() * 3
    delta = torch.randn(m, h, generator=g).bfloat16()
    w1, w2 = (torch.randn(h, generator=g).bfloat16() * 0.5 for _ in range(2))
    expected_hidden = hidden + gemma_rms_norm(delta, w1, 1e-6)
    expected = gemma_rms_norm(expected_hidden, w2, 1e-6)
    got = ops.gemma_add_norm(hidden, delta, w1, w2, 1e-6)
    assert torch.equal(hidden, expected_hidden)
    assert (got.float() - expected.float()).abs().max() <= expected.float().abs().max() / 128
    assert (got != expected).float().mean() < 0.01  # a rare last-bit rounding difference
    assert ops.gemma_add_norm(hidden, delta, w1, None, 1e-6) is True  # add only

    qkv = torch.randn(m, 7 * d, generator=g).bfloat16()  # 3 query, 2 KV heads
    qw, kw = torch.randn(d, generator=g).bfloat16(), torch.randn(d, generator=g).bfloat16()
    normed = qkv.clone()
    assert ops.gemma_head_norms(normed, qw, kw, 3, 2, 1e-6)
    q = gemma_rms_norm(qkv[:, :3 * d].view(m, 3, d), qw, 1e-6)
    k = gemma_rms_norm(qkv[:, 3 * d:5 * d].view(m, 2, d), kw, 1e-6)
    assert (normed[:, :3 * d].view(m, 3, d) != q).float().mean() < 0.01
    assert (normed[:, 3 * d:5 * d].view(m, 2, d) != k).float().mean() < 0.01
    assert torch.equal(normed[:, 5 * d:], qkv[:, 5 * d:])  # values untouched

    gate_up = torch.randn(m, 2 * i, generator=g).bfloat16() * 2
    expected = F.gelu(gate_up[:, :i], approximate="tanh") * gate_up[:, i:]
    got = ops.gelu_tanh_mul(gate_up)
    # x / (1 + exp(-2y)) has no cancellation where torch's 0.5 x (1 + tanh y) has (large
    # negative x, outputs ~1e-6): compare against the exact value there.
    x = gate_up[:, :i].double()
    exact = (x * torch.sigmoid(2 * 0.7978845608028654 * (x + 0.044715 * x ** 3))
             * gate_up[:, i:].double())
    assert torch.allclose(got.double(), exact, rtol=2 ** -7, atol=1e-30)
    assert (got != expected)[x > -3].float().mean() < 0.01


def _with_norm_weights(model) -> None:
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # distinct norm weights
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)


@pytest.mark.parametrize("mode", ["dense", "gguf"])
def test_stack_matches_layer_by_layer_bit_for_bit(kernel_level, level_kernels, mode,
                                                  tmp_path_factory):
    base = tmp_path_factory.mktemp(f"gemma-stack-{mode}")
    path = _gemma(base / "hf")
    options = dict(enable_prefix_caching=False, block_size=4)
    if mode == "gguf":  # projections as Q8_0 and Q4_0 blocks (the quantized kernels)
        path = str(write_tiny_gguf(path, base / "tiny.gguf", "gemma3",
                                   {"self_attn.": "Q8_0", "mlp.": "Q4_0"}))
        options["quantization"] = "gguf"
    core = _core(path, kernel_level, **options)
    worker = core.executor.worker
    model = worker.model
    if worker.layer_ops is None:
        pytest.skip(f"the {kernel_level} build has no vector unit")
    assert type(model.decode_stack) is GemmaDecodeStack
    _with_norm_weights(model)
    counting = _Counting(model.decode_stack)
    # 6 requests finishing one after another, contexts from 3 to ~40 tokens: local layers
    # read windows that start mid-block and whose earlier blocks the sliding group freed.
    prompts = [[5 + 7 * i + j for j in range(3 + 6 * i)] for i in range(6)]
    model.decode_stack = counting
    fused = _generate(core, "stack", prompts, max_tokens=6, spread=2)
    model.decode_stack = None
    plain = _generate(core, "layers", prompts, max_tokens=6, spread=2)
    assert counting.ran >= 10, "every all-decode step should run in the stack"
    assert counting.declined >= 1, "the prefill steps are left to the layers"
    assert fused == plain


def test_softcapped_gemma_keeps_its_layers(kernel_level, level_kernels, tmp_path_factory):
    """Attention softcaps (Gemma 2's, not Gemma 3's) are outside the driver: no stack, and
    the model still decodes."""
    path = _gemma(tmp_path_factory.mktemp("gemma-softcap"), attn_logit_softcapping=50.0)
    core = _core(path, kernel_level)
    assert core.executor.worker.model.decode_stack is None
    (tokens,) = _generate(core, "softcap", [[5, 6, 7, 8]], max_tokens=3)
    assert len(tokens) == 3


class _MixedSteps:
    """A decode stack that counts the steps it ran with more kernel rows than requests
    (a short multi-token row's tokens beside decodes)."""

    def __init__(self, stack) -> None:
        self.stack, self.mixed = stack, 0
        self.max_rows = stack.max_rows

    def __call__(self, hidden, rotary, kv_caches, meta, local):
        out = self.stack(hidden, rotary, kv_caches, meta, local)
        if out is not None and hidden.shape[0] > len(meta.step.query_lens):
            self.mixed += 1
        return out


def test_stack_reads_the_sliding_tables_of_each_kernel_row(kernel_level, level_kernels,
                                                           tmp_path_factory):
    """Steps where a short prompt's tokens are decode-kernel rows beside other requests'
    decodes: the local layers read each kernel row's sliding-group table, as the global
    layers read theirs, and match the layers bit for bit. (They read the per-request
    table for every kernel row: a served Gemma 3 270M at 16 streams read past it and
    segfaulted in the decode kernel.)"""
    core = _core(_gemma(tmp_path_factory.mktemp("gemma-mixed") / "hf"), kernel_level,
                 enable_prefix_caching=False, block_size=4)
    model = core.executor.worker.model
    if core.executor.worker.layer_ops is None:
        pytest.skip(f"the {kernel_level} build has no vector unit")
    _with_norm_weights(model)
    # a long prompt first (its window moves past freed blocks), then short ones arriving
    prompts = [[3 + j for j in range(30)]] + [[40 + 5 * i + j for j in range(2 + i)]
                                              for i in range(6)]
    mixed = _MixedSteps(model.decode_stack)
    model.decode_stack = mixed
    fused = _generate(core, "stack", prompts, max_tokens=12, arrive_every=2)
    model.decode_stack = None
    plain = _generate(core, "layers", prompts, max_tokens=12, arrive_every=2)
    assert mixed.mixed >= 3, "steps with a short prompt beside decodes ran in the stack"
    assert fused == plain


def test_local_layers_prefill_on_the_kernel_as_the_reference_attends(kernel_level, level_kernels,
                                                              tmp_path_factory, monkeypatch):
    """Gemma's prompts on the C prefill kernel (head_dim 256; the local layers with their
    window bound over the sliding group's tables, blocks before each window freed): the
    prompt log-probabilities of the reference attention path, to bf16 accuracy, with
    prompts chunked across steps well past the window. (Measured on avx512: 0.063 at
    most from the reference, where the torch path is 0.090 from it.)"""
    if not level_kernels.supports_prefill(torch.bfloat16, 256, WINDOW):
        pytest.skip(f"the {kernel_level} build keeps head_dim 256 on torch's attention "
                    "(AVX-512 BF16 builds; the widening builds are its twins)")
    from treadle import LLM, SamplingParams

    from treadle.worker.cpu.native_linear import onednn_uses_amx

    if onednn_uses_amx():  # else torch's attention takes the prefills (faster on AMX)
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    path = _gemma(tmp_path_factory.mktemp("gemma-prefill"))
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (150, 41, 12)]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)

    def prompt_logprobs(backend):
        llm = LLM(model=path, dtype="bfloat16", max_num_batched_tokens=64, block_size=4,
                  attention_backend=backend, enable_prefix_caching=False,
                  kernel_isa=kernel_level, distributed_executor_backend="uni")
        attention = llm.engine.executor.worker.attention
        assert getattr(attention, "native_window_prefill", False) == (backend == "native")
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        return [torch.tensor([next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]])
                for o in outs]

    native, reference = prompt_logprobs("native"), prompt_logprobs("reference")
    for a, b in zip(native, reference):
        assert torch.allclose(a, b, atol=0.08), (a - b).abs().max()
