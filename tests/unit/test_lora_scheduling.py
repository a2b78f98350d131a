"""LoRA in the engine core without a model: the scheduler never runs more distinct adapters
in one step than the worker has slots, a request whose adapter is not resident is
admitted once a slot frees (bounded like any head-of-line bypass), the prefix-cache hash
chain is keyed by adapter, and the adapter registry keeps ids meaning one adapter."""

from __future__ import annotations

import json
import random

import pytest

from treadle.config import CacheConfig, SchedulerConfig
from treadle.core.kv.hashing import root_hash
from treadle.core.kv.manager import KVCacheManager
from treadle.core.outputs import ModelRunnerOutput
from treadle.core.scheduler import Scheduler
from treadle.engine.lora_registry import LoRARegistry
from treadle.lora import LoRAError, LoRARequest
from treadle.request import Request, RequestStatus
from treadle.sampling_params import SamplingParams


def lora(i: int) -> LoRARequest:
    return LoRARequest(f"a{i}", i, f"/adapters/a{i}")


def make_scheduler(max_loras: int, num_blocks=256, max_tokens=48, max_seqs=8,
                   max_head_bypasses=16, policy="fcfs"):
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=max_tokens, max_num_seqs=max_seqs,
                        preemption_mode="recompute", max_head_bypasses=max_head_bypasses,
                        scheduling_policy=policy, kv_watermark=0.0,
                        admission_lookahead_tokens=0),  # let memory pressure preempt
        CacheConfig(block_size=4, enable_prefix_caching=True),
        num_kv_blocks=num_blocks, max_model_len=4096, max_loras=max_loras)


def request(rid: str, adapter: int | None, prompt_len: int, max_tokens: int,
            arrival: float = 0.0, seed: int = 0) -> Request:
    rng = random.Random(seed)
    return Request(rid, [rng.randrange(3, 500) for _ in range(prompt_len)],
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_id=2,
                   arrival_time=arrival, lora_request=None if adapter is None else lora(adapter))


def fake_runner(output) -> ModelRunnerOutput:
    """Samples token 7 wherever a request reaches its last token."""
    return ModelRunnerOutput(sampled_token_ids={s.request_id: [7] for s in output.scheduled
                                                if s.sample})


def step_adapters(scheduler: Scheduler, output) -> set[int]:
    return {scheduler.requests[s.request_id].lora_int_id for s in output.scheduled
            if scheduler.requests[s.request_id].lora_int_id is not None}


@pytest.mark.parametrize("max_loras, policy, num_blocks", [
    (1, "fcfs", 256), (2, "fcfs", 256), (3, "priority", 256), (2, "fcfs", 40)])
def test_a_step_never_runs_more_adapters_than_slots(max_loras, policy, num_blocks):
    """Random adapters (or none), arrivals over time, chunked prefill, and with 40 blocks
    preemption: every step's distinct adapters fit the slots, and every request ends."""
    rng = random.Random(max_loras * 100 + num_blocks)
    scheduler = make_scheduler(max_loras, num_blocks=num_blocks, policy=policy)
    pending = [request(f"r{i}", rng.choice([None, 1, 2, 3, 4, 5]), rng.randrange(1, 60),
                       rng.randrange(1, 20), arrival=float(i), seed=i) for i in range(60)]
    for r in pending:
        r.priority = rng.randrange(0, 3)
    finished, peak, steps = set(), 0, 0
    while pending or scheduler.has_unfinished_requests():
        for _ in range(rng.randrange(0, 4)):
            if pending:
                scheduler.add_request(pending.pop(0))
        output = scheduler.schedule()
        in_step = step_adapters(scheduler, output)
        running = {r.lora_int_id for r in scheduler.running} - {None}
        assert len(in_step) <= max_loras and len(running) <= max_loras
        peak = max(peak, len(in_step))
        for out in scheduler.update_from_output(output, fake_runner(output)):
            if out.finished:
                finished.add(out.request_id)
        steps += 1
        assert steps < 5000, "the scheduler stopped making progress"
    assert len(finished) == 60
    assert peak == max_loras  # the bound was reached, not merely never approached
    if num_blocks == 40:
        assert scheduler.stats.num_preemptions > 0
    assert scheduler.kv.pool.num_free_blocks == num_blocks


def test_a_request_whose_adapter_is_not_resident_is_admitted_once_a_slot_frees():
    """One slot, held by adapter 1: a request of adapter 2 waits while adapter-1 requests
    keep arriving; smaller requests behind it pass it at most max_head_bypasses times, then
    nothing behind it starts, adapter 1's requests drain, and it runs."""
    bypasses = 3
    scheduler = make_scheduler(1, max_head_bypasses=bypasses, max_seqs=16)
    scheduler.add_request(request("first", 1, 8, 6, arrival=0.0))
    scheduler.add_request(request("other-adapter", 2, 8, 4, arrival=0.5))
    admitted_at = None
    passed = 0
    for step in range(200):
        scheduler.add_request(request(f"x{step}", 1, 4, 6, arrival=1.0 + step, seed=step))
        output = scheduler.schedule()
        ids = {s.request_id for s in output.scheduled}
        passed += sum(1 for s in output.scheduled if s.new_request is not None
                      and s.request_id.startswith("x") and admitted_at is None)
        if "other-adapter" in ids and admitted_at is None:
            admitted_at = step
            assert step_adapters(scheduler, output) == {2}
        scheduler.update_from_output(output, fake_runner(output))
        if admitted_at is not None and step > admitted_at + 10:
            break
    assert admitted_at is not None, "the request of the other adapter starved"
    assert passed == bypasses  # exactly the bound of requests started past it
    assert scheduler.stats.num_head_bypasses >= bypasses


def test_base_model_requests_are_never_held_back_by_adapters():
    scheduler = make_scheduler(1)
    scheduler.add_request(request("a", 1, 8, 30))
    scheduler.add_request(request("b", 2, 8, 30))
    scheduler.add_request(request("base", None, 8, 30))
    output = scheduler.schedule()
    assert {s.request_id for s in output.scheduled} == {"a", "base"}
    assert scheduler.requests["b"].status == RequestStatus.WAITING
    assert output.scheduled[0].new_request.lora_request in (lora(1), None)
    by_id = {s.request_id: s.new_request.lora_request for s in output.scheduled}
    assert by_id == {"a": lora(1), "base": None}  # the adapter travels once, with the data


# ----- prefix cache keyed by adapter -----------------------------------------------------

def test_block_hashes_differ_by_adapter_and_agree_within_one():
    kv = KVCacheManager(64, 4, enable_prefix_caching=True)
    tokens = list(range(3, 3 + 17))

    def hashes(rid, adapter, salt=None):
        r = Request(rid, tokens, SamplingParams(max_tokens=4), cache_salt=salt,
                    lora_request=None if adapter is None else lora(adapter))
        return kv._block_hashes(r, 4)

    base, one, one_again, two = hashes("b", None), hashes("x", 1), hashes("y", 1), hashes("z", 2)
    assert one == one_again
    assert not set(base) & set(one) and not set(one) & set(two) and not set(base) & set(two)
    assert hashes("s", 1, salt="tenant") != one  # tenant salt and adapter both count
    assert root_hash(None) != root_hash(None, 1) != root_hash(None, 2)
    assert root_hash("\x00lora:1") != root_hash("", 1)


def test_prefix_hits_never_cross_adapters():
    """Blocks cached by a request of adapter 1 are hit by another of adapter 1, never by
    the base model's or adapter 2's, with the very same tokens."""
    scheduler = make_scheduler(2)
    scheduler.add_request(request("first", 1, 33, 2, seed=9))
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        scheduler.update_from_output(out, fake_runner(out))
    hits = {}
    for rid, adapter in (("same", 1), ("other", 2), ("base", None)):
        r = request(rid, adapter, 33, 2, seed=9)
        hits[rid] = scheduler.kv.get_computed_blocks(r)[1]
    assert hits == {"same": 32, "other": 0, "base": 0}


# ----- the registry ------------------------------------------------------------------------

SHAPES = {"q_proj": (8, 8), "k_proj": (8, 4), "v_proj": (8, 4), "o_proj": (8, 8),
          "gate_proj": (8, 16), "up_proj": (8, 16), "down_proj": (16, 8)}


def write_adapter(path, rank=2, modules=("q_proj", "down_proj"), shapes=SHAPES, layers=2):
    """A PEFT folder written without torch (the safetensors header is all the check reads;
    the data is zeros)."""
    import struct

    path.mkdir(parents=True, exist_ok=True)
    header, offset = {}, 0
    for layer in range(layers):
        for module in modules:
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            fan_in, fan_out = shapes[module]
            for which, shape in (("A", [rank, fan_in]), ("B", [fan_out, rank])):
                size = 4 * shape[0] * shape[1]
                header[f"base_model.model.model.layers.{layer}.{block}.{module}.lora_{which}"
                       ".weight"] = {"dtype": "F32", "shape": shape,
                                     "data_offsets": [offset, offset + size]}
                offset += size
    raw = json.dumps(header).encode()
    (path / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw
                                                     + bytes(offset))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
         "target_modules": list(modules), "bias": "none"}))
    return str(path)


def test_registry_keeps_an_id_to_one_adapter(tmp_path):
    registry = LoRARegistry(SHAPES, num_layers=2, max_lora_rank=4)
    a = write_adapter(tmp_path / "a")
    b = write_adapter(tmp_path / "b", rank=4)
    spec = registry.add(LoRARequest("a", 1, a))
    assert spec.max_rank == 2 and spec.target_modules == ["q_proj", "down_proj"]
    assert spec.modules[(1, "down_proj")].scaling == 2.0
    registry.add(LoRARequest("a", 1, a))  # the same again: a no-op
    with pytest.raises(LoRAError, match="lora_int_id 1 already means adapter 'a'"):
        registry.add(LoRARequest("b", 1, b))
    with pytest.raises(LoRAError, match="adapter name 'a' is already lora_int_id 1"):
        registry.add(LoRARequest("a", 2, b))
    assert registry.remove("a") == LoRARequest("a", 1, a)
    with pytest.raises(LoRAError, match="already means"):  # even after it was removed
        registry.add(LoRARequest("b", 1, b))
    assert registry.new_id() == 2
    registry.add(LoRARequest("b", 5, b))
    assert registry.new_id() == 6 and [r.lora_name for r in registry.list()] == ["b"]
    assert "rank 4" not in (registry.check(LoRARequest("b", 5, b)) or "")


@pytest.mark.parametrize("make, message", [
    (lambda p: write_adapter(p, rank=8), "has rank 8, above max_lora_rank=4"),
    (lambda p: write_adapter(p, shapes=SHAPES | {"q_proj": (16, 16)}),
     r"adapter is for a base layer of \(in 16, out 16\), the model's q_proj is \(in 8, out 8\)"),
    (lambda p: write_adapter(p, layers=3), "is for layer 2, but the model has 2 layers"),
    (lambda p: write_adapter(p.parent / "nowhere") and str(p / "missing"), "does not exist"),
])
def test_adapters_that_do_not_fit_are_refused_naming_why(tmp_path, make, message):
    registry = LoRARegistry(SHAPES, num_layers=2, max_lora_rank=4)
    path = make(tmp_path / "x")
    error = registry.check(LoRARequest("x", 1, path))
    assert error is not None and error.startswith("lora_request: ")
    assert pytest.importorskip("re").search(message, error), error
    assert registry.get("x") is None


def test_unsupported_peft_features_are_refused(tmp_path):
    registry = LoRARegistry(SHAPES, num_layers=2, max_lora_rank=4)
    path = tmp_path / "dora"
    write_adapter(path)
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps(config | {"use_dora": True}))
    assert "use_dora=True is not supported" in registry.check(LoRARequest("d", 1, str(path)))
    (path / "adapter_config.json").write_text(json.dumps(config | {"target_modules": ["lm_head"]}))
    assert "target_modules ['lm_head'] are not supported" in registry.check(
        LoRARequest("d", 1, str(path)))
