"""A digest of everything the scheduler decides, to check that a speed-up changed nothing.

Runs randomized workloads (every policy; recompute, swap and auto preemption under memory
pressure; shared prefixes; proposed tokens; tenants; aborts) through the production
Scheduler and KVCacheManager with a fake runner and a scripted clock, and hashes every
SchedulerOutput, every EngineCoreOutput and the final statistics. Run it on two commits:
the digests must be equal.

    python benchmarks/scheduler_digest.py            # prints one digest per scenario
    python benchmarks/scheduler_digest.py --no-contiguous-blocks   # block ids as before
                                                     # extents (commits before them)
"""

from __future__ import annotations

import hashlib
import random
import sys

from treadle.config import CacheConfig, SchedulerConfig
from treadle.core.outputs import ModelRunnerOutput
from treadle.core.policy import PreemptionCosts
from treadle.core.scheduler import Scheduler
from treadle.request import Request, RequestStatus
from treadle.sampling_params import SamplingParams


def _requests(rng: random.Random, count: int, shared: list[int], tenants: int) -> list:
    out = []
    for i in range(count):
        prefix = shared[:rng.randrange(0, len(shared) + 1)] if rng.random() < 0.5 else []
        prompt = prefix + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 90))]
        out.append((rng.uniform(0, 4.0), prompt, rng.randrange(1, 60), rng.randrange(0, 3),
                    f"t{rng.randrange(tenants)}" if tenants else None))
    return sorted(out, key=lambda r: r[0])


def run_scenario(policy: str, mode: str, spec: bool, seed: int, num_blocks: int,
                 contiguous: bool = True) -> str:
    rng = random.Random(seed)
    now = [0.0]
    costs = PreemptionCosts(1e6, 1e9, 1000, 1e9) if mode == "auto" else None
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=rng.choice([16, 48, 96]), max_num_seqs=12,
                        preemption_mode=mode, scheduling_policy=policy,
                        tenant_weights="t0=1,t1=3" if policy == "fair" else ""),
        CacheConfig(block_size=4, enable_prefix_caching=True, contiguous_blocks=contiguous),
        num_kv_blocks=num_blocks, max_model_len=4096, num_swap_blocks=24 if mode != "recompute" else 0,
        preemption_costs=costs, clock=lambda: now[0])
    shared = [rng.randrange(3, 500) for _ in range(24)]
    pending = _requests(rng, 60, shared, 2 if policy == "fair" else 0)
    h = hashlib.sha256()
    i = steps = 0
    while i < len(pending) or sched.has_unfinished_requests():
        while i < len(pending) and pending[i][0] <= now[0]:
            t, prompt, max_tokens, priority, tenant = pending[i]
            sched.add_request(Request(str(i), prompt, SamplingParams(max_tokens=max_tokens,
                                                                     ignore_eos=True),
                                      eos_token_id=2, arrival_time=t, priority=priority,
                                      cache_salt=tenant, tenant=tenant))
            i += 1
        if rng.random() < 0.02 and sched.requests:
            victim = rng.choice(sorted(sched.requests))
            sched.finish_request(victim, RequestStatus.FINISHED_ABORTED)
            h.update(f"abort {victim}".encode())
        out = sched.schedule()
        h.update(repr(out).encode())
        sampled, proposals = {}, {}
        for s in out.scheduled:
            if s.sample:
                accepted = rng.randrange(0, len(s.spec_token_ids) + 1)
                sampled[s.request_id] = [7 + j for j in range(accepted + 1)]
                if spec:
                    proposals[s.request_id] = [7] * rng.randrange(0, 4)
        outputs = sched.update_from_output(out, ModelRunnerOutput(sampled, spec_token_ids=proposals))
        h.update(repr(outputs).encode())
        now[0] += 0.05 + 0.001 * out.num_scheduled_tokens
        steps += 1
        if steps > 20000:
            raise RuntimeError("no progress")
    h.update(repr(sched.stats).encode())
    h.update(repr(sched.kv.prefix_stats).encode())
    h.update(repr(sorted(sched.fair_share.counters.items())).encode())
    return h.hexdigest()[:16]


def main() -> int:
    contiguous = "--no-contiguous-blocks" not in sys.argv[1:]
    total = hashlib.sha256()
    for policy in ("fcfs", "priority", "srpt", "fair"):
        for mode in ("recompute", "swap", "auto"):
            for spec in (False, True):
                for seed in range(3):
                    digest = run_scenario(policy, mode, spec, seed, num_blocks=40 + 20 * seed,
                                          contiguous=contiguous)
                    total.update(digest.encode())
                    print(f"{policy:8} {mode:9} spec={int(spec)} seed={seed}: {digest}")
    print("all:", total.hexdigest()[:16])
    return 0


if __name__ == "__main__":
    sys.exit(main())
