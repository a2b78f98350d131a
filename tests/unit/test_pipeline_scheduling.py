"""Pipeline parallelism keeps several step batches in flight: the engine core with a fake
executor of two stages (a step's answer comes back one step after it was submitted).
After the first step two batches are in flight at every step, no request is in two
in-flight batches, outputs equal the one-stage run, aborts of in-flight requests free
their blocks only when the step returns, and every block comes back."""

from __future__ import annotations

import random
from collections import deque

from treadle.config import EngineConfig
from treadle.core.outputs import ModelRunnerOutput, WorkerInfo
from treadle.engine.core import EngineCore
from treadle.executor.base import Executor
from treadle.request import Request
from treadle.sampling_params import SamplingParams


class FakePipelineExecutor(Executor):
    """Stages of a pipeline: a step answers when `stages` steps are queued (or on demand)."""

    def __init__(self, stages: int) -> None:
        super().__init__()
        self.max_in_flight = stages
        self.queue: deque = deque()
        self.in_flight_sizes: list[int] = []
        self.overlaps: list[set[str]] = []

    def load(self) -> WorkerInfo:
        return WorkerInfo(model_dir="/fake", dtype="float32", vocab_size=1000, eos_token_id=2,
                          max_model_len=4096, num_parameters=1, kv_bytes_per_token=1,
                          num_kv_blocks=40, num_swap_blocks=0, preemption_costs=None,
                          attention_backend="fake", kernels="none")

    def initialize_cache(self, kv_config) -> None:
        pass

    def execute_model(self, so):
        raise AssertionError("the core submits and receives")

    def collective_rpc(self, method, *args, **kwargs) -> list:
        raise AssertionError("the core only steps this executor")

    def submit(self, so) -> None:
        ids = {s.request_id for s in so.scheduled}
        for queued in self.queue:
            self.overlaps.append(ids & {s.request_id for s in queued.scheduled})
        self.queue.append(so)
        self.in_flight_sizes.append(len(self.queue))

    def receive(self) -> ModelRunnerOutput:
        so = self.queue.popleft()
        return ModelRunnerOutput({s.request_id: [7 + (s.num_computed_tokens
                                                      + s.num_scheduled_tokens) % 11]
                                  for s in so.scheduled if s.sample})


def make_core(stages: int) -> tuple[EngineCore, FakePipelineExecutor]:
    executor = FakePipelineExecutor(stages)
    config = EngineConfig.from_options(model="/fake", block_size=4, max_num_batched_tokens=24,
                                       max_num_seqs=6, preemption_mode="recompute",
                                       admission_lookahead_tokens=0, kv_watermark=0.0,
                                       distributed_executor_backend="uni")
    return EngineCore(config, executor=executor), executor


def requests(seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    return [Request(f"r{i}", [rng.randrange(3, 900) for _ in range(rng.randrange(2, 30))],
                    SamplingParams(max_tokens=rng.randrange(1, 20), ignore_eos=True))
            for i in range(16)]


def run(core: EngineCore) -> dict[str, list[int]]:
    for r in requests():
        core.add_request(r)
    tokens: dict[str, list[int]] = {}
    steps = 0
    while core.has_unfinished_requests():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps += 1
        assert steps < 2000
    return tokens


def test_two_stages_keep_two_disjoint_batches_in_flight():
    core, executor = make_core(stages=2)
    tokens = run(core)
    one_stage = run(make_core(stages=1)[0])
    assert tokens == one_stage
    assert all(not overlap for overlap in executor.overlaps)  # disjoint batches
    # After the first step, a second batch is in flight whenever there is work for it.
    assert executor.in_flight_sizes[0] == 1 and max(executor.in_flight_sizes) == 2
    busy = executor.in_flight_sizes[1:len(executor.in_flight_sizes) // 2]
    assert busy and all(n == 2 for n in busy)
    assert core.scheduler.kv.pool.num_free_blocks == 40
    core.scheduler.kv.pool.check_invariants()


def test_abort_in_flight_frees_blocks_when_the_step_returns():
    core, executor = make_core(stages=2)
    for r in requests()[:4]:
        core.add_request(r)
    core.step()  # two batches submitted, the first answered
    in_flight = next(iter(executor.queue)).scheduled[0].request_id
    held = core.scheduler.kv.num_held_blocks(in_flight)
    assert held > 0
    free_before = core.scheduler.kv.pool.num_free_blocks
    core.abort_request(in_flight)
    assert core.scheduler.kv.num_held_blocks(in_flight) == held  # still being written
    assert core.scheduler.kv.pool.num_free_blocks == free_before
    while core.has_unfinished_requests():
        core.step()
    assert core.scheduler.kv.pool.num_free_blocks == 40
    core.scheduler.kv.pool.check_invariants()
