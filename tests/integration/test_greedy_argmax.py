"""The LM head without its bf16 logits. Greedy steps without logits at all
(LlamaForCausalLM.greedy_tokens, the packed GEMM's argmax): an engine gives the same tokens
with it as through the logits and the sampler, takes it only on steps whose every sampling
position is greedy with nothing that reads or changes the logits, and never where the
packed GEMM does not run (there the test checks that the engine declines it and still
decodes as before). Sampled steps: float32 logits straight from the packed GEMM give the
same seeded tokens and logprobs as widening its bf16 output."""

from __future__ import annotations

import torch

from conftest import make_tiny_checkpoint

from treadle.config import EngineConfig
from treadle.engine.core import EngineCore
from treadle.request import Request
from treadle.sampling_params import SamplingParams


def _run(core: EngineCore, tag: str, requests: list[tuple[list[int], SamplingParams]]):
    for i, (prompt, params) in enumerate(requests):
        core.add_request(Request(f"{tag}-{i}", prompt, params))
    got: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    return [got[f"{tag}-{i}"] for i in range(len(requests))]


def test_greedy_steps_without_logits_give_the_sampler_s_tokens(kernel_level, tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("greedy"), "llama", hidden_size=256)
    core = EngineCore(EngineConfig.from_options(
        model=path, dtype="bfloat16", kv_cache_memory="64MiB", kernel_isa=kernel_level,
        distributed_executor_backend="uni", enable_prefix_caching=False))
    worker = core.executor.worker
    model = worker.model
    taken = []  # rows of the steps the argmax took
    fused = model.greedy_tokens

    def counting(hidden: torch.Tensor):
        out = fused(hidden)
        if out is not None:
            taken.append(hidden.shape[0])
        return out

    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 250, (int(n),), generator=generator).tolist()
               for n in torch.randint(3, 60, (12,), generator=generator)]
    greedy = [SamplingParams(max_tokens=6 + 2 * i, temperature=0.0, ignore_eos=True,
                             seed=i) for i in range(12)]
    # One request that reads its logits (logprobs) and one that changes them (a
    # penalty) keep the steps they run in on the sampler; the others' later steps are
    # all plain greedy.
    greedy[1] = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2)
    greedy[2] = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                               repetition_penalty=1.3)
    requests = list(zip(prompts, greedy))

    model.greedy_tokens = counting
    with_argmax = _run(core, "a", requests)
    vnni = worker.layer_ops is not None and worker.layer_ops.vnni
    if vnni:
        assert taken and max(taken) == 10, "steps after the two requests end take it"
    else:
        assert not taken, "without the packed GEMM the model declines every step"
    model.greedy_tokens = lambda hidden: None  # every step through the logits
    through_logits = _run(core, "b", requests)
    assert with_argmax == through_logits
    # A sampled request in the batch: no step is plain greedy while it runs.
    taken.clear()
    model.greedy_tokens = counting
    mixed = requests[:3] + [(prompts[3], SamplingParams(max_tokens=30, temperature=1.0,
                                                        seed=7, ignore_eos=True))]
    _run(core, "c", mixed)
    assert not taken


def test_float_logits_from_the_gemm_sample_as_the_widened_bf16_ones(kernel_level,
                                                                     tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("float-logits"), "llama",
                                hidden_size=256)
    core = EngineCore(EngineConfig.from_options(
        model=path, dtype="bfloat16", kv_cache_memory="64MiB", kernel_isa=kernel_level,
        distributed_executor_backend="uni", enable_prefix_caching=False))
    worker = core.executor.worker
    kernel = worker.model.lm_head_kernel
    calls = []
    as_float = getattr(kernel, "float_output", None)
    if as_float is not None:
        def counting(hidden):
            out = as_float(hidden)
            calls.append(out is not None)
            return out
        kernel.float_output = counting
    generator = torch.Generator().manual_seed(4)
    requests = [(torch.randint(5, 250, (int(n),), generator=generator).tolist(),
                 SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=i,
                                logprobs=3, ignore_eos=True))
                for i, n in enumerate(torch.randint(3, 60, (6,), generator=generator))]

    def run(tag):
        for i, (prompt, params) in enumerate(requests):
            core.add_request(Request(f"{tag}-{i}", prompt, params))
        got = {}
        while core.has_unfinished_requests():
            for out in core.step():
                got.setdefault(out.request_id, []).extend(
                    (t, lp.token_ids, lp.logprobs)
                    for t, lp in zip(out.new_token_ids, out.new_logprobs))
        return [got[f"{tag}-{i}"] for i in range(len(requests))]

    direct = run("a")
    vnni = worker.layer_ops is not None and worker.layer_ops.vnni
    assert (any(calls) if vnni else not any(calls))
    if kernel is not None:
        kernel.float_output = lambda hidden: None  # the bf16 logits, widened by torch
    assert run("b") == direct
