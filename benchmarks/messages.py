"""What the step messages cost to cross a process boundary, against what a step costs.

Builds the messages of a steady decode step with N running requests through the real
scheduler (requests prefilled and decoding, each with its block table held by the
worker already), and of the step that first admits them (prompts travel then), and
times pickling them both ways (dumps + loads: what the `mp` executor's socket adds on
top of the copy itself). With --measure-step it also times decode steps of the demo
model at N requests in-process and through the `mp` executor, side by side.

    python benchmarks/messages.py --requests 256 --measure-step
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time

from treadle.config import CacheConfig, SchedulerConfig
from treadle.core.outputs import ModelRunnerOutput
from treadle.core.scheduler import Scheduler
from treadle.request import Request
from treadle.sampling_params import SamplingParams


def _round_trip_us(message, repeats: int) -> tuple[float, int]:
    """Median microseconds of pickle.dumps + pickle.loads, and the pickled size."""
    times = []
    data = b""
    for _ in range(repeats):
        t0 = time.perf_counter()
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(data)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6, len(data)


def step_messages(num_requests: int, prompt_len: int = 512, repeats: int = 50) -> dict:
    """Pickle costs of the admitting step and of a steady decode step."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=num_requests * prompt_len,
                                      max_num_seqs=num_requests),
                      CacheConfig(block_size=16, enable_prefix_caching=False),
                      num_kv_blocks=num_requests * (prompt_len // 16 + 8),
                      max_model_len=prompt_len + 64)
    params = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.8, top_p=0.95)
    for i in range(num_requests):
        sched.add_request(Request(str(i), [3 + (i * 7919 + j) % 40000 for j in range(prompt_len)],
                                  params))
    first = sched.schedule()
    result = {"num_requests": num_requests, "prompt_len": prompt_len}

    def answer(out) -> ModelRunnerOutput:
        return ModelRunnerOutput({s.request_id: [11] for s in out.scheduled if s.sample})

    result["admit_step_us"], result["admit_step_bytes"] = _round_trip_us(first, repeats)
    sched.update_from_output(first, answer(first))
    decode = sched.schedule()
    assert all(s.is_decoding and s.new_request is None for s in decode.scheduled)
    result["decode_step_us"], result["decode_step_bytes"] = _round_trip_us(decode, repeats)
    runner_out = answer(decode)
    result["runner_output_us"], result["runner_output_bytes"] = _round_trip_us(runner_out,
                                                                               repeats)
    result["decode_round_trip_us"] = result["decode_step_us"] + result["runner_output_us"]
    return result


def decode_step_ms(num_requests: int, executor: str, steps: int = 8) -> float:
    """Median decode-step milliseconds of the demo model (bf16) at num_requests."""
    from treadle.config import EngineConfig
    from treadle.engine.core import EngineCore

    core = EngineCore(EngineConfig.from_options(
        dtype="bfloat16", max_num_seqs=num_requests, max_num_batched_tokens=4096,
        kv_cache_memory="2GiB", distributed_executor_backend=executor))
    params = SamplingParams(max_tokens=steps + 4, ignore_eos=True, temperature=0.0)
    for i in range(num_requests):
        core.add_request(Request(str(i), [3 + (i * 31 + j) % 40000 for j in range(16)], params))
    while any(not r.is_decoding or not r.output_token_ids
              for r in core.scheduler.requests.values()):
        core.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = core.step()
        times.append(time.perf_counter() - t0)
        assert len(out) == num_requests
    core.shutdown()
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--measure-step", action="store_true",
                        help="also time decode steps of the demo model, uni and mp")
    args = parser.parse_args()
    report = step_messages(args.requests, repeats=args.repeats)
    if args.measure_step:
        for executor in ("uni", "mp", "uni", "mp"):  # alternating: drift hits both
            report.setdefault(f"decode_step_ms_{executor}", []).append(
                round(decode_step_ms(args.requests, executor), 2))
        uni = statistics.median(report["decode_step_ms_uni"])
        report["round_trip_share_of_decode_step"] = report["decode_round_trip_us"] / 1e3 / uni
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
