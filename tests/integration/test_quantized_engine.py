"""--quantization in the engine (worker/cpu/quantized_linears.py): a GGUF file's blocks or
int8 weights made at load run the model's linears and LM head on the C quantized
kernels; layers the kernels cannot hold stay dense and are named; wrong uses are errors
naming the option."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import make_tiny_checkpoint, use_fresh_cache_dir
from gguf_files import write_tiny_gguf
from test_gguf import prompts, tiny_hf
from treadle.config import EngineConfig
from treadle.engine.core import EngineCore
from treadle.request import Request
from treadle.sampling_params import SamplingParams
from treadle.worker.cpu.linear_kernels import DenseLinearKernel
from treadle.worker.cpu.native_quant import QuantKernels
from treadle.worker.cpu.quantized_linears import QuantizedLinearKernel, resolve_mode

# q/k/v of one format fuse; Q5_0 has no kernel: it runs as Q8_0 blocks made at load.
TYPES = {"self_attn.q": "Q8_0", "self_attn.k": "Q8_0", "self_attn.v": "Q8_0",
         "self_attn.o": "Q4_0", "mlp.gate": "Q4_1", "mlp.up": "Q4_1", "mlp.down": "Q5_0",
         "embed": "Q8_0", "lm_head": "Q8_0"}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant-engine")
    hf_dir = tiny_hf(root / "hf", "llama", hidden=64, inter=128)
    (root / "gguf").mkdir()
    return write_tiny_gguf(hf_dir, root / "gguf" / "tiny.gguf", "llama", TYPES)


def _core(model, **options) -> EngineCore:
    return EngineCore(EngineConfig.from_options(model=str(model), kv_cache_memory="32MiB",
                                                distributed_executor_backend="uni",
                                                enable_prefix_caching=False, **options))


def _logprobs(core: EngineCore, batch, max_tokens: int = 6):
    """Per request, per step: (greedy token, {token: logprob} of the top 5)."""
    for i, prompt in enumerate(batch):
        core.add_request(Request(str(i), prompt, SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=5)))
    got: dict[str, list] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            (lp,) = out.new_logprobs
            got.setdefault(out.request_id, []).append(
                (out.new_token_ids[0], dict(zip(lp.token_ids[1:], lp.logprobs[1:]))))
    return [got[str(i)] for i in range(len(batch))]


def _close_to_dense(quantized, dense, tolerance: float) -> None:
    """The first step's top log-probabilities agree within `tolerance` (the integer dot
    products round activations to int8 per 32 values; the dense run is the same file's
    blocks dequantized)."""
    for got, ref in zip(quantized, dense):
        (_, top), (_, ref_top) = got[0], ref[0]
        common = top.keys() & ref_top.keys()
        assert len(common) >= 3
        for token in common:
            assert abs(top[token] - ref_top[token]) < tolerance


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gguf_blocks_run_the_linears_and_other_block_types_run_as_q8_0(tiny_gguf, dtype,
                                                                      tmp_path, monkeypatch):
    use_fresh_cache_dir(tmp_path / "cache", monkeypatch)
    core = _core(tiny_gguf, quantization="gguf", dtype=dtype)
    worker = core.executor.worker
    layer = worker.model.model.layers["0"]
    qkv, o = layer.self_attn.qkv_proj.kernel, layer.self_attn.o_proj.kernel
    gate_up, down = layer.mlp.gate_up_proj.kernel, layer.mlp.down_proj.kernel
    assert isinstance(qkv, QuantizedLinearKernel) and qkv.weight.format.name == "Q8_0"
    assert isinstance(o, QuantizedLinearKernel) and o.weight.format.name == "Q4_0"
    assert isinstance(gate_up, QuantizedLinearKernel) and gate_up.weight.format.name == "Q4_1"
    # Q5_0: no kernel of its own; its decoded weight is requantized to Q8_0 at load
    assert isinstance(down, QuantizedLinearKernel) and down.weight.format.name == "Q8_0"
    assert isinstance(worker.model.lm_head_kernel, QuantizedLinearKernel)
    report = worker.quantized
    assert report.num_quantized == 2 * 4 + 1 and report.dense == ()
    # the quantized layers' dense weights are freed (shape kept)
    assert layer.self_attn.qkv_proj.weight.is_meta and layer.mlp.gate_up_proj.weight.is_meta
    assert layer.mlp.down_proj.weight.is_meta
    assert tuple(layer.self_attn.qkv_proj.weight.shape) == (64 + 2 * 32, 64)
    assert worker.model.lm_head.weight.is_meta  # untied here
    assert report.dropped_bytes == sum(
        linear.weight.numel() * linear.weight.element_size()
        for name, linear in worker.model.named_modules() if getattr(linear, "weight", None)
        is not None and linear.weight.is_meta)
    assert "quantization gguf" in core.info.kernels
    # bf16 decode steps run every layer in one C call, quantized linears included
    # (tests/integration/test_decode_stack.py compares it with the layers bit for bit)
    assert (worker.model.decode_stack is not None) == (dtype == "bfloat16")
    batch = prompts()[:4]
    quantized = _logprobs(core, batch)
    dense = _logprobs(_core(tiny_gguf, quantization="none", dtype=dtype), batch)
    _close_to_dense(quantized, dense, tolerance=0.2)  # as int8's: every layer quantized


def test_int8_is_made_at_load_from_any_checkpoint(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "qwen2")  # q/k/v biases ride along in fp32
    core = _core(path, quantization="int8", dtype="bfloat16")
    layer = core.executor.worker.model.model.layers["0"]
    kernel = layer.self_attn.qkv_proj.kernel
    assert isinstance(kernel, QuantizedLinearKernel) and kernel.weight.format.name == "INT8"
    assert kernel.weight.bias is not None
    assert core.executor.worker.quantized.dense == ()
    batch = [[5 + i, 9, 13, 2 + 3 * i] for i in range(3)]
    _close_to_dense(_logprobs(core, batch),
                    _logprobs(_core(path, quantization="none", dtype="bfloat16"), batch),
                    tolerance=0.2)


def test_none_keeps_dense_kernels_and_auto_quantizes_where_r16_runs(tiny_gguf, tmp_path,
                                                                      monkeypatch):
    use_fresh_cache_dir(tmp_path / "cache", monkeypatch)
    core = _core(tiny_gguf, quantization="none", dtype="bfloat16")
    layer = core.executor.worker.model.model.layers["0"]
    assert isinstance(layer.self_attn.qkv_proj.kernel, DenseLinearKernel)
    assert core.executor.worker.quantized is None
    core = _core(tiny_gguf, quantization="auto", dtype="bfloat16")
    worker = core.executor.worker
    kernels = QuantKernels.load(worker.native.lib) if worker.native is not None else None
    r16 = kernels is not None and kernels.has_r16
    qkv = worker.model.model.layers["0"].self_attn.qkv_proj.kernel
    assert isinstance(qkv, QuantizedLinearKernel) == r16
    assert (worker.quantized is not None) == r16
    # float32, or a checkpoint that is not GGUF: auto stays dense
    core = _core(tiny_gguf, quantization="auto", dtype="float32")
    assert core.executor.worker.quantized is None


def test_auto_rule(tiny_gguf, tmp_path):
    r16 = SimpleNamespace(r16_formats=("Q8_0", "Q4_0", "Q4_1", "INT8"))
    assert resolve_mode("auto", tiny_gguf, r16) == "gguf"  # its q/k/v are Q8_0
    assert resolve_mode("auto", tiny_gguf, SimpleNamespace(r16_formats=())) == "none"
    assert resolve_mode("auto", tiny_gguf, None) == "none"
    assert resolve_mode("auto", None, r16) == "none"
    assert resolve_mode("auto", tiny_gguf, r16, dtype=torch.float32) == "none"
    assert resolve_mode("auto", tiny_gguf, r16, world_size=2) == "none"
    assert resolve_mode("auto", tiny_gguf, r16, lora=True) == "none"
    assert resolve_mode("none", tiny_gguf, r16) == "none"
    assert resolve_mode("int8", None, None) == "int8"
    # a file whose projections are all F32 has nothing to keep quantized
    hf_dir = tiny_hf(tmp_path / "hf", "llama", hidden=64, inter=128)
    plain = write_tiny_gguf(hf_dir, tmp_path / "plain.gguf", "llama", {})
    assert resolve_mode("auto", plain, r16) == "none"


def test_wrong_uses_name_the_option(tmp_path):
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig.from_options(model="demo", quantization="q4")
    path = make_tiny_checkpoint(tmp_path, "llama")
    with pytest.raises(ValueError, match="quantization=gguf needs a GGUF model"):
        _core(path, quantization="gguf")
