"""Multi-LoRA offline, fp32, against PEFT: three adapters of different ranks (one rsLoRA)
on a tiny Llama; a mixed batch (each request a random adapter or none), with chunked
prefill and preemption in play, gives the same greedy tokens as transformers running
PEFT's merged model of each adapter; so does eviction with max_loras=2 and all three in
use; adapters that do not fit the model are refused with the reason."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from lora_adapters import MODULES, make_adapter
from treadle import LLM, LoRARequest, SamplingParams

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

ADAPTERS = [  # (rank, lora_alpha, use_rslora, target modules)
    (2, 5.0, False, MODULES),
    (4, 6.0, True, MODULES),
    (8, 8.0, False, ["q_proj", "v_proj", "down_proj"]),
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(base dir, adapter dirs, prompts, reference tokens per adapter index or None)."""
    from conftest import make_tiny_checkpoint
    root = tmp_path_factory.mktemp("lora")
    base_dir = make_tiny_checkpoint(root / "base", "llama")
    paths = [make_adapter(base_dir, root / f"a{i}", spec[0], 20 + i, *spec[1:])
             for i, spec in enumerate(ADAPTERS)]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(2, 70))] for _ in range(12)]
    references = {}
    for key, path in [(None, None)] + list(enumerate(paths)):
        model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        if path is not None:
            model = peft.PeftModel.from_pretrained(model, path).merge_and_unload()
        model.eval()
        outs = []
        for prompt in prompts:
            with torch.no_grad():
                ids = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS,
                                     min_new_tokens=MAX_TOKENS, do_sample=False)
            outs.append(ids[0, len(prompt):].tolist())
        references[key] = outs
    return base_dir, paths, prompts, references


def run(llm: LLM, prompts, loras, choice):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                        use_tqdm=False,
                        lora_request=[None if c is None else loras[c] for c in choice])
    assert [o.error for o in outs] == [None] * len(outs)
    return [o.outputs[0].token_ids for o in outs]


def lora_stats(llm: LLM):
    worker = getattr(llm.engine.executor, "worker", None)
    return None if worker is None else worker.lora.stats


def test_the_adapters_change_the_outputs(setup):
    """Otherwise the comparisons below would prove nothing."""
    _, _, prompts, references = setup
    for i in range(len(ADAPTERS)):
        assert sum(a != b for a, b in zip(references[i], references[None])) >= len(prompts) // 2


@pytest.mark.parametrize("max_loras, kv_blocks, batched_tokens", [
    (3, 512, 512),  # everything resident, no pressure
    (3, 14, 24),    # chunked prefill and preemption
    (2, 512, 48),   # three adapters in use, two slots: eviction
])
def test_a_mixed_batch_matches_peft_merged_models(setup, max_loras, kv_blocks, batched_tokens):
    base_dir, paths, prompts, references = setup
    llm = LLM(model=base_dir, dtype="float32", enable_lora=True, max_loras=max_loras,
              max_cpu_loras=max_loras, max_lora_rank=8, block_size=8,
              num_kv_blocks=kv_blocks, max_num_batched_tokens=batched_tokens,
              max_num_seqs=6, preemption_mode="recompute", admission_lookahead_tokens=0,
              kv_watermark=0.0)
    loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    rng = random.Random(max_loras * 1000 + kv_blocks)
    choice = [rng.choice([None, 0, 1, 2]) for _ in prompts]
    choice[:4] = [None, 0, 1, 2]  # every adapter and the base model at least once
    outputs = run(llm, prompts, loras, choice)
    expected = [references[c][k] for k, c in enumerate(choice)]
    assert outputs == expected
    stats = llm.get_stats()
    if kv_blocks == 14:
        assert stats["num_preemptions"] > 0
    manager = lora_stats(llm)
    if manager is not None and max_loras == 2:
        assert manager.num_slot_evictions > 0
    # Again, with the adapters resident or in the host cache: the same tokens.
    assert run(llm, prompts, loras, choice) == expected
    llm.engine.shutdown()


def test_prefix_caching_never_crosses_adapters(setup):
    """The same prompt under two adapters and the base model, prefix caching on, one
    after the other: each gets its own model's tokens (a shared block would leak one
    adapter's KV into another's)."""
    base_dir, paths, prompts, references = setup
    llm = LLM(model=base_dir, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              block_size=4, enable_prefix_caching=True)
    loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    k = max(range(len(prompts)), key=lambda i: len(prompts[i]))  # many full blocks
    hits = []
    for c in [0, 1, None, 0]:
        before = llm.get_stats()["prefix_cache_hit_tokens"]
        assert run(llm, [prompts[k]], loras, [c]) == [references[c][k]]
        hits.append(llm.get_stats()["prefix_cache_hit_tokens"] - before)
    assert hits[:3] == [0, 0, 0]  # another adapter's (or the base model's) blocks: no hit
    assert hits[3] >= 4 * (len(prompts[k]) // 4 - 1)  # the same adapter's: hit
    llm.engine.shutdown()


def test_adapters_that_do_not_fit_are_refused_with_the_reason(setup, tmp_path):
    base_dir, paths, prompts, _ = setup
    llm = LLM(model=base_dir, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=4)
    wrong_shape = Path(tmp_path / "wide")
    wrong_shape.mkdir()
    from safetensors.torch import save_file
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
               torch.zeros(2, 65),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight":
               torch.zeros(64, 2)}, str(wrong_shape / "adapter_model.safetensors"))
    (wrong_shape / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 2, "target_modules": ["q_proj"]}))
    requests = [LoRARequest("big", 1, paths[2]),           # rank 8 > max_lora_rank 4
                LoRARequest("wide", 2, str(wrong_shape)),  # 65 inputs, the model has 64
                LoRARequest("none", 3, str(tmp_path / "missing")),
                LoRARequest("ok", 4, paths[0])]
    outs = llm.generate([{"prompt_token_ids": prompts[0]}] * 4,
                        SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False,
                        lora_request=requests)
    errors = [o.error for o in outs]
    assert "rank 8" in errors[0] and "max_lora_rank" in errors[0]
    assert "q_proj" in errors[1] and "64" in errors[1]
    assert "does not exist" in errors[2]
    assert errors[3] is None
    llm.engine.shutdown()
    plain = LLM(model=base_dir, dtype="float32")
    out, = plain.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=1),
                          use_tqdm=False, lora_request=requests[3])
    assert "enable_lora is off" in out.error
    with pytest.raises(ValueError, match="LoRARequest"):
        plain.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=1),
                       use_tqdm=False, lora_request="a0")
    plain.engine.shutdown()


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2),
                                      dict(pipeline_parallel_size=2)])
def test_adapters_split_like_their_layers_under_tp_and_pp(setup, parallel):
    """Tensor parallelism splits each adapter like its base layer (B's rows for q/k/v and
    gate/up, A's columns for o and down, the partial terms summed by the layer's
    all-reduce); pipeline parallelism gives each stage its layers' part: the same tokens
    as PEFT's merged models."""
    base_dir, paths, prompts, references = setup
    llm = LLM(model=base_dir, dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=8,
              num_kv_blocks=256, **parallel)
    loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    choice = [None, 0, 1, 2, 2, 0][:len(prompts)]
    outputs = run(llm, prompts[:len(choice)], loras, choice)
    assert outputs == [references[c][k] for k, c in enumerate(choice)]
    llm.engine.shutdown()


@pytest.mark.parametrize("method", ["ngram", "draft", "self"])
def test_speculative_decoding_with_adapters_stays_lossless(setup, method):
    """Speculation and adapters together: the proposer drafts without the adapters (the
    base model as the draft, or the base layers of the first layer for `self`, or prompt
    lookup), verification runs the target with each row's adapter, so a mixed batch under
    chunking and preemption still gives PEFT's merged models' greedy tokens, with some
    proposals accepted and some rolled back."""
    base_dir, paths, prompts, references = setup
    speculative = {"ngram": {"method": "ngram", "prompt_lookup_min": 1},
                   "draft": {"method": "draft", "model": base_dir},
                   "self": {"method": "self", "draft_layers": 1}}[method]
    llm = LLM(model=base_dir, dtype="float32", enable_lora=True, max_loras=2,
              max_cpu_loras=3, max_lora_rank=8, block_size=8, num_kv_blocks=20,
              max_num_batched_tokens=32, max_num_seqs=6, preemption_mode="recompute",
              admission_lookahead_tokens=0, kv_watermark=0.0, num_threads=1,
              speculative_config={**speculative, "num_speculative_tokens": 3,
                                  "adaptive": False})
    loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    choice = [None, 0, 1, 2] * (len(prompts) // 4)
    outputs = run(llm, prompts, loras, choice)
    assert outputs == [references[c][k] for k, c in enumerate(choice)]
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0
    assert stats["spec_num_drafts"] > 0 and stats["spec_num_accepted_tokens"] > 0
    assert stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    assert llm.engine.scheduler.kv.pool.num_free_blocks == llm.engine.num_kv_blocks
    llm.engine.shutdown()


class _EagerGraphs:
    """Stands in for the GPU's DecodeGraphs (worker/cuda/decode_graphs.py needs triton): it
    accepts the steps DecodeGraphs accepts (decodes only) and replays one by running the
    model eagerly, counting replays."""

    def __init__(self, runner, model) -> None:
        self.runner, self.model, self.num_replays = runner, model, 0

    def accepts(self, step) -> bool:
        return step.num_single_token_rows == len(step.query_lens)

    def run(self, input_ids, positions, step):
        self.num_replays += 1
        meta = self.runner.attention.build_metadata(step, self.runner.device)
        return self.model(torch.from_numpy(input_ids), torch.from_numpy(positions),
                          self.runner.kv_caches, meta)


def test_steps_with_adapter_rows_never_replay_decode_graphs(setup):
    """Decode graphs are captured without adapter terms: a step with an adapter row runs
    eagerly (the adapters' tokens stay PEFT's), a step of base-model rows replays."""
    base_dir, paths, prompts, references = setup
    llm = LLM(model=base_dir, dtype="float32", enable_lora=True, max_loras=3,
              max_lora_rank=8, num_kv_blocks=256)
    worker = llm.engine.executor.worker
    graphs = worker.runner.decode_graphs = _EagerGraphs(worker.runner, worker.model)
    loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    choice = [0, 1, 2, 0]
    assert run(llm, prompts[:4], loras, choice) == [references[c][k]
                                                    for k, c in enumerate(choice)]
    assert graphs.num_replays == 0
    assert run(llm, prompts[:4], loras, [None] * 4) == references[None][:4]
    assert graphs.num_replays > 0
    llm.engine.shutdown()


def test_an_adapter_that_cannot_be_loaded_fails_its_requests_alone(setup, tmp_path):
    """The adapter's files passed the check when registered (its header) but its data is
    gone when the worker loads it: its requests end with the reason, the engine and the
    other requests of the same steps go on (before, the load error took the engine down)."""
    import shutil
    base_dir, paths, prompts, references = setup
    broken = tmp_path / "truncated"
    shutil.copytree(paths[0], broken)
    weights = broken / "adapter_model.safetensors"
    header_size = 8 + int.from_bytes(weights.read_bytes()[:8], "little")
    with open(weights, "r+b") as f:  # the header stays readable, the tensors' bytes go
        f.truncate(header_size + 16)
    llm = LLM(model=base_dir, dtype="float32", enable_lora=True, max_loras=2)
    loras = [LoRARequest("broken", 1, str(broken)), LoRARequest("ok", 2, paths[1])]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]],
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                        use_tqdm=False, lora_request=[loras[0], None, loras[1], loras[0]])
    for i in (0, 3):
        assert outs[i].outputs[0].finish_reason == "error"
        assert "adapter 'broken'" in outs[i].error and "could not be loaded" in outs[i].error
    assert outs[1].error is None and outs[1].outputs[0].token_ids == references[None][1]
    assert outs[2].error is None and outs[2].outputs[0].token_ids == references[1][2]
    again, = llm.generate([{"prompt_token_ids": prompts[5]}],
                          SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                          use_tqdm=False)
    assert again.outputs[0].token_ids == references[None][5]
    llm.engine.shutdown()
