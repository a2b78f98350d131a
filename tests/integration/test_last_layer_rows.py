"""A step carries only its sampling positions past the last layer's attention
(LlamaForCausalLM.forward's keep_rows; ModelRunner._keeps_rows): prefill chunks that end
mid-prompt, prompts that end, decodes and proposals in one step give the same tokens and
logprobs as with every row carried to the end, bit for bit where the packed GEMM runs
(its rows are independent of how many there are) and to the kernels' rounding elsewhere;
the next steps read the same keys and values. Steps that need every row (prompt
logprobs) keep them all."""

from __future__ import annotations

import torch

from conftest import make_tiny_checkpoint

from treadle.config import EngineConfig
from treadle.engine.core import EngineCore
from treadle.request import Request
from treadle.sampling_params import SamplingParams


def _run(core, tag, requests):
    for i, (prompt, params) in enumerate(requests):
        core.add_request(Request(f"{tag}-{i}", prompt, params))
    got: dict[str, list] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            logprobs = out.new_logprobs or [None] * len(out.new_token_ids)
            got.setdefault(out.request_id, []).extend(
                (t, lp and lp.token_ids, lp and lp.logprobs)
                for t, lp in zip(out.new_token_ids, logprobs))
    return [got[f"{tag}-{i}"] for i in range(len(requests))]


def test_last_layer_on_sampled_rows_only(kernel_level, tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("keep-rows"), "llama",
                                hidden_size=256)
    core = EngineCore(EngineConfig.from_options(
        model=path, dtype="bfloat16", kv_cache_memory="64MiB", kernel_isa=kernel_level,
        distributed_executor_backend="uni", enable_prefix_caching=False,
        max_num_batched_tokens=96))  # long prompts take several chunks
    worker = core.executor.worker
    model = worker.model
    kept = []  # (rows computed, rows kept) per forward pass that kept fewer
    forward = model.forward

    def recording(*args, keep_rows=None, **kwargs):
        out = forward(*args, keep_rows=keep_rows, **kwargs)
        if keep_rows is not None:
            kept.append((args[1].shape[0], out.shape[0]))
        return out

    generator = torch.Generator().manual_seed(5)
    lengths = [150, 7, 90, 33, 260, 12]
    requests = [(torch.randint(5, 250, (n,), generator=generator).tolist(),
                 SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3))
                for n in lengths]
    model.forward = recording
    pruned = _run(core, "a", requests)
    assert kept and all(n_kept < n for n, n_kept in kept)
    model.forward = forward
    model.keeps_rows = False  # every row to the end of the last layer
    whole = _run(core, "b", requests)
    vnni = worker.layer_ops is not None and worker.layer_ops.vnni
    if vnni:
        assert pruned == whole
    else:  # the dot-product kernel may take the few kept rows where a GEMM took them all
        for a, b in zip(pruned, whole):
            assert a[0][0] == b[0][0]
            torch.testing.assert_close(torch.tensor(a[0][2]), torch.tensor(b[0][2]),
                                       atol=0.05, rtol=0)
    # Prompt logprobs read every prompt row: those steps keep them all.
    model.keeps_rows = True
    kept.clear()
    model.forward = recording
    _run(core, "c", [(requests[0][0], SamplingParams(max_tokens=2, temperature=0.0,
                                                      prompt_logprobs=1))])
    assert not kept
