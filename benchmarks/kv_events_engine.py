"""KV events' cost to a whole engine: the same offline run on two engines of one model in
one process, events off and on (published on an ipc:// socket nobody reads), alternating
runs; output tokens per second, medians and the ratio on/off.

    python benchmarks/kv_events_engine.py MODEL_DIR [--prompts 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

from treadle import LLM, SamplingParams


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)
    rng = random.Random(0)
    system = [rng.randrange(3, 400) for _ in range(128)]
    prompts = [system + [rng.randrange(3, 400) for _ in range(rng.randrange(32, 256))]
               for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    folder = tempfile.mkdtemp()
    engines = {"off": LLM(args.model, dtype=args.dtype),
               "on": LLM(args.model, dtype=args.dtype,
                         kv_events_endpoint=f"ipc://{folder}/kv",
                         kv_events_replay_endpoint=f"ipc://{folder}/replay")}
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for repeat in range(args.repeats):
        for name in (("off", "on") if repeat % 2 == 0 else ("on", "off")):
            llm = engines[name]
            llm.reset_prefix_cache()
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
    for name, values in rates.items():
        print(f"{name:4s} {statistics.median(values):8.1f} output tok/s  {values}")
    ratios = [on / off for on, off in zip(rates["on"], rates["off"])]
    print(f"on/off median ratio {statistics.median(ratios):.3f}")
    print("events published:", engines["on"].engine.kv_events.publisher.num_sent)
    for llm in engines.values():
        llm.engine.shutdown()


if __name__ == "__main__":
    main()
