"""The runner's short path for steps of plain greedy decodes (worker/greedy_decode.py):
the same tokens as the general path, token for token, on the decode stack (bf16, dense
and GGUF-quantized) and on the layer-by-layer float32 model; taken only by steps whose
every row is one plain greedy decode."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_checkpoint, use_fresh_cache_dir
from gguf_files import write_tiny_gguf
from treadle.config import EngineConfig
from treadle.engine.core import EngineCore
from treadle.request import Request
from treadle.sampling_params import SamplingParams
from treadle.worker import greedy_decode


def _requests(vocab: int) -> list[tuple[list[int], SamplingParams]]:
    generator = torch.Generator().manual_seed(7)
    lengths = torch.randint(2, 40, (9,), generator=generator).tolist()
    prompts = [torch.randint(5, vocab, (n,), generator=generator).tolist() for n in lengths]
    params = [SamplingParams(max_tokens=5 + 3 * i, temperature=0.0, ignore_eos=True)
              for i in range(9)]
    # Rows that read or change their logits keep their steps on the general path: a
    # penalty, logprobs, a min_tokens ban while it holds, a sampled row.
    params[1] = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                               repetition_penalty=1.3)
    params[2] = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, logprobs=1)
    params[3] = SamplingParams(max_tokens=9, temperature=0.0, min_tokens=4, ignore_eos=True)
    params[4] = SamplingParams(max_tokens=8, temperature=0.8, seed=11, ignore_eos=True)
    return list(zip(prompts, params))


def _run(core: EngineCore, short_path: bool, requests, tag: str) -> tuple[list, list]:
    """Tokens per request, and the row counts of the steps the short path ran."""
    runner = core.executor.worker.runner
    runner.greedy_decode = short_path
    taken = []
    run = greedy_decode.run

    def counting(runner_, scheduler_output, states):
        taken.append(len(states))
        return run(runner_, scheduler_output, states)

    greedy_decode.run = counting
    try:
        for i, (prompt, params) in enumerate(requests):
            core.add_request(Request(f"{tag}-{i}", prompt, params))
        got: dict[str, list[int]] = {}
        while core.has_unfinished_requests():
            for out in core.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
    finally:
        greedy_decode.run = run
    return [got[f"{tag}-{i}"] for i in range(len(requests))], taken


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("greedy-decode")
    dense = make_tiny_checkpoint(root / "dense", "llama", hidden_size=256, rope_scaling=None)
    (root / "gguf").mkdir()
    gguf = write_tiny_gguf(dense, root / "gguf" / "tiny.gguf", "llama",
                           {"self_attn": "Q8_0", "mlp.": "Q4_0"})
    return {"dense": dense, "gguf": str(gguf)}


@pytest.mark.parametrize("case", ["bf16-dense", "bf16-gguf", "float32"])
def test_short_path_gives_the_general_paths_tokens(case, models, tmp_path, monkeypatch):
    use_fresh_cache_dir(tmp_path / "cache", monkeypatch)
    options = {"bf16-dense": dict(model=models["dense"], dtype="bfloat16"),
               "bf16-gguf": dict(model=models["gguf"], dtype="bfloat16",
                                 quantization="gguf"),
               "float32": dict(model=models["dense"], dtype="float32")}[case]
    core = EngineCore(EngineConfig.from_options(
        kv_cache_memory="64MiB", distributed_executor_backend="uni",
        enable_prefix_caching=False, max_num_batched_tokens=64, **options))
    try:
        requests = _requests(250)
        general, none_taken = _run(core, False, requests, "general")
        short, taken = _run(core, True, requests, "short")
    finally:
        core.shutdown()
    assert none_taken == []
    assert short == general
    assert [len(t) for t in short] == [p.max_tokens for _, p in requests]
    # The short path ran the all-greedy decode steps (several rows, then the longest
    # requests alone), never a step with a prompt chunk or a row that is not plain greedy.
    assert taken and max(taken) >= 2 and min(taken) == 1
    assert sum(taken) < sum(p.max_tokens for _, p in requests)


def test_steps_that_do_not_qualify(models, tmp_path, monkeypatch):
    """A sampled row, a penalty or a prompt chunk in the step keeps it off the short path."""
    use_fresh_cache_dir(tmp_path / "cache", monkeypatch)
    core = EngineCore(EngineConfig.from_options(
        model=models["dense"], dtype="float32", kv_cache_memory="64MiB",
        distributed_executor_backend="uni"))
    try:
        sampled = [([5, 6, 7], SamplingParams(max_tokens=6, temperature=0.7, seed=1,
                                              ignore_eos=True))]
        _, taken = _run(core, True, sampled, "sampled")
        assert taken == []
        greedy = [([5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))]
        _, taken = _run(core, True, greedy, "greedy")
        assert taken == [1] * 5  # every step after the prompt's
    finally:
        core.shutdown()
