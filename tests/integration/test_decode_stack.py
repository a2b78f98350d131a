"""The decode stack (worker/cpu/decode_stack.py, kernels/decode_stack.c): every layer of a
decode step in one C call gives the same log-probabilities, bit for bit, as the model's
layers run one by one on the same kernels, at every ISA level this CPU runs, with dense
and with quantized weights (`--quantization`); and it stays out of the steps and models
it does not cover."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_checkpoint
from gguf_files import write_tiny_gguf

from treadle.config import EngineConfig
from treadle.engine.core import EngineCore
from treadle.request import Request
from treadle.sampling_params import SamplingParams
from treadle.models.quant_weights import choose_path
from treadle.worker.cpu.decode_stack import QUANT_PATH_CODES, DecodeStack
from treadle.worker.cpu.native_linear import WIDENING_GEMM_ROWS
from treadle.worker.cpu.quantized_linears import QuantizedLinearKernel


def _core(path, level, **options) -> EngineCore:
    return EngineCore(EngineConfig.from_options(model=path, dtype="bfloat16",
                                                kv_cache_memory="64MiB", kernel_isa=level,
                                                distributed_executor_backend="uni", **options))


class _Counting:
    """Wraps a stack, counting the steps it ran and the ones it left to the layers."""

    def __init__(self, stack: DecodeStack) -> None:
        self.stack, self.ran, self.declined, self.max_rows_ran = stack, 0, 0, 0

    def __call__(self, *args):
        out = self.stack(*args)
        if out is None:
            self.declined += 1
        else:
            self.ran += 1
            self.max_rows_ran = max(self.max_rows_ran, out.shape[0])
        return out


def _generate(core: EngineCore, tag: str, prompts, max_tokens: int = 10, spread: int = 0,
              arrive_every: int = 0):
    """Greedy tokens and top log-probabilities per prompt; request i asks for max_tokens +
    i * spread tokens (the batch then shrinks one request at a time). arrive_every > 0:
    request i is added before step i * arrive_every instead of all at once (a short prompt
    is then a multi-token row beside the earlier requests' decodes)."""
    pending = list(enumerate(prompts))

    def arrive(step: int) -> None:
        while pending and pending[0][0] * arrive_every <= step:
            i, prompt = pending.pop(0)
            core.add_request(Request(f"{tag}-{i}", prompt, SamplingParams(
                max_tokens=max_tokens + i * spread, temperature=0.0, ignore_eos=True,
                logprobs=5)))

    got: dict[str, list] = {}
    arrive(0)
    step = 0
    while pending or core.has_unfinished_requests():
        for out in core.step():
            (lp,) = out.new_logprobs
            got.setdefault(out.request_id, []).append(
                (out.new_token_ids[0], lp.token_ids, lp.logprobs))
        step += 1
        arrive(step)
    return [got[f"{tag}-{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_stack_matches_layer_by_layer_bit_for_bit(kernel_level, level_kernels, family,
                                                  tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(f"stack-{family}"), family,
                                hidden_size=256)  # head_dim 64: the kernels' vector path
    # No prefix caching: the second run would otherwise prefill less of each prompt.
    core = _core(path, kernel_level, enable_prefix_caching=False)
    model = core.executor.worker.model
    if core.executor.worker.layer_ops is None:
        pytest.skip(f"the {kernel_level} build has no vector unit")
    assert model.decode_stack is not None, "a plain bf16 model on cpu-native gets a stack"
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # distinct norm weights (a fresh checkpoint's are all ones)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
    counting = _Counting(model.decode_stack)
    # 24 requests finishing one after another: steps of 24 down to 1 rows, on both linear
    # kernels of each level (with AMX the tile kernel from 4 rows, dot products below;
    # without bf16 arithmetic the widening GEMM from WIDENING_GEMM_ROWS, dot products below).
    prompts = [[5 + 7 * i + j for j in range(9 + 3 * i)] for i in range(24)]
    model.decode_stack = counting
    fused = _generate(core, "stack", prompts, max_tokens=4, spread=2)
    model.decode_stack = None
    plain = _generate(core, "layers", prompts, max_tokens=4, spread=2)
    assert counting.ran >= 9, "every all-decode step should run in the stack"
    # As many rows as the level's linears give the stack: past WIDENING_GEMM_ROWS without
    # bf16 arithmetic, to the AMX tile kernel's last row with AMX, and MAX_ROWS (16) where
    # vdpbf16ps runs without AMX (oneDNN takes more rows there, outside the stack).
    assert counting.max_rows_ran == min(counting.stack.max_rows, len(prompts))
    layer_ops = core.executor.worker.layer_ops
    if layer_ops.gemm_rows is not None or layer_ops.amx_rows is not None:
        assert counting.max_rows_ran >= WIDENING_GEMM_ROWS
    assert counting.declined >= 1, "the prefill steps are left to the layers"
    assert fused == plain


# Each projection in its own format, so that every format's paths run in one model; the
# down projection stays F32, which gguf mode keeps dense (the stack mixes both kinds).
_GGUF_TYPES = {"self_attn.q": "Q8_0", "self_attn.k": "Q8_0", "self_attn.v": "Q8_0",
               "self_attn.o": "Q4_0", "mlp.gate": "Q4_1", "mlp.up": "Q4_1"}
# The same projections as Q4_K blocks (random: gguf-py cannot quantize K types)
_GGUF_K_TYPES = {name: "Q4_K" for name in _GGUF_TYPES}


@pytest.mark.parametrize("mode", ["gguf", "gguf-q4k", "int8"])
def test_quantized_stack_matches_layer_by_layer_bit_for_bit(kernel_level, level_kernels, mode,
                                                            tmp_path_factory):
    base = tmp_path_factory.mktemp(f"stack-quant-{mode}")
    path = make_tiny_checkpoint(base / "hf", "llama", hidden_size=256, intermediate_size=512)
    if mode.startswith("gguf"):
        types = _GGUF_K_TYPES if mode == "gguf-q4k" else _GGUF_TYPES
        path = str(write_tiny_gguf(path, base / "tiny.gguf", "llama", types))
    core = _core(path, kernel_level, enable_prefix_caching=False,
                 quantization=mode.split("-")[0])
    worker = core.executor.worker
    model = worker.model
    if worker.layer_ops is None:
        pytest.skip(f"the {kernel_level} build has no vector unit")
    layer = model.model.layers["0"]
    kinds = [type(linear.kernel) for linear in (layer.self_attn.qkv_proj,
                                                layer.self_attn.o_proj, layer.mlp.down_proj)]
    assert kinds[:2] == [QuantizedLinearKernel] * 2
    assert (kinds[2] is QuantizedLinearKernel) == (mode == "int8")
    stack = model.decode_stack
    assert stack is not None, "quantized linears on the same library's kernels get a stack"
    counting = _Counting(stack)
    # 36 requests finishing one after another: steps of 36 down to 1 rows, so that each
    # format crosses its paths (with AMX: dot at 1, 2 (and 4) rows, else amx_dot, amx
    # from 33).
    prompts = [[5 + 3 * i + j for j in range(3 + i % 5)] for i in range(36)]
    rows = min(stack.max_rows, len(prompts))
    kernels = layer.self_attn.qkv_proj.kernel.weight.kernels
    paths = {choose_path(kernels, fmt, m) for fmt in ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "INT8")
             for m in range(1, rows + 1)}
    assert paths <= set(QUANT_PATH_CODES)
    # Two paths or more where the level has them within the stack's rows (AMX: dot, amx_dot,
    # amx; AVX2: r16, gemm); with AVX-512 VNNI and no AMX r16 takes every row count.
    assert len(paths) >= 2 or (paths == {"r16"} and kernels.has_vnni and not kernels.has_amx)
    model.decode_stack = counting
    fused = _generate(core, "stack", prompts, max_tokens=2, spread=1)
    model.decode_stack = None
    plain = _generate(core, "layers", prompts, max_tokens=2, spread=1)
    # one all-decode step per row count, from 36 rows down; those within max_rows are ours
    assert counting.ran >= rows - 1, "the all-decode steps within its rows run in the stack"
    assert fused == plain


def test_stack_declines_rows_past_the_linear_kernel(kernel_level, level_kernels,
                                                    tmp_path_factory):
    """More decode rows than the C linear kernel takes run layer by layer (oneDNN)."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("stack-rows"), "llama")
    core = _core(path, kernel_level)
    model = core.executor.worker.model
    if model.decode_stack is None:
        pytest.skip(f"no stack at {kernel_level}")
    counting = _Counting(model.decode_stack)
    counting.stack.max_rows = 2
    model.decode_stack = counting
    _generate(core, "rows", [[3 + i, 4, 5] for i in range(3)], max_tokens=4)
    assert counting.ran == 0 and counting.declined > 0


@pytest.mark.parametrize("case", ["qwen3-qk-norms", "int8-cache", "torch-attention",
                                  "lora", "float32"])
def test_models_and_setups_it_does_not_cover_get_none(kernel_level, level_kernels, case,
                                                      tmp_path_factory):
    base = tmp_path_factory.mktemp(f"stack-{case}")
    options: dict = {}
    family = "llama"
    if case == "qwen3-qk-norms":
        family = "qwen3"
    elif case == "int8-cache":
        options["kv_cache_dtype"] = "int8"
    elif case == "torch-attention":
        options["attention_backend"] = "torch"
    elif case == "lora":
        options.update(enable_lora=True, max_lora_rank=8)
    path = make_tiny_checkpoint(base, family)
    if case == "float32":
        core = EngineCore(EngineConfig.from_options(model=path, dtype="float32",
                                                    kv_cache_memory="64MiB",
                                                    kernel_isa=kernel_level))
    else:
        core = _core(path, kernel_level, **options)
    assert core.executor.worker.model.decode_stack is None
    # ... and the engine still decodes there.
    (tokens,) = _generate(core, case, [[5, 6, 7, 8]], max_tokens=3)
    assert len(tokens) == 3


def test_switching_the_layer_kernels_off_drops_the_stack(kernel_level, level_kernels,
                                                         tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("stack-off"), "llama")
    core = _core(path, kernel_level)
    worker = core.executor.worker
    if worker.layer_ops is None:
        pytest.skip(f"the {kernel_level} build has no vector unit")
    assert worker.model.decode_stack is not None
    worker.set_layer_kernels(False)
    assert worker.model.decode_stack is None
    worker.set_layer_kernels(True)
    assert isinstance(worker.model.decode_stack, DecodeStack)
