"""Where one engine step's time goes, part by part, at a few concurrent requests.

`python benchmarks/step_overhead.py [--model M] [--requests 1,4,16] [--prompt-len 128]
[--output-len 128] [engine options as key=value]`

Runs `LLM.generate` on N requests decoding together (after a warm-up run) with timers
wrapped around the engine's parts (monkeypatched here, never in the engine): the
scheduler (`schedule`, `update_from_output`), the runner's input preparation, the
decode stack's one C call and the LM head (argmax or logits), the sampler, the rest of
the model's forward call
(embedding, rotary tables), the rest of the runner, and the output processing. Per step:
each part's wall milliseconds and its thread CPU milliseconds (on a busy machine the wall
time of a Python part includes time its thread sat descheduled; the CPU time does not),
and what is left of the step outside them ("other": the driver, the trace, glue). A
benchmark beside the engine; it may reach into internals.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict
from contextlib import contextmanager

PARTS = [
    ("schedule", "treadle.core.scheduler", "Scheduler", "schedule"),
    ("update", "treadle.core.scheduler", "Scheduler", "update_from_output"),
    ("prepare", "treadle.worker.model_runner", "ModelRunner", "prepare"),
    ("runner", "treadle.worker.model_runner", "ModelRunner", "execute"),
    ("prepare", "treadle.worker.greedy_decode", None, "step_inputs"),
    ("model_forward", "treadle.models.llama", "LlamaForCausalLM", "forward"),
    ("decode_stack", "treadle.worker.cpu.decode_stack", "DecodeStack", "__call__"),
    ("lm_head", "treadle.models.llama", "LlamaForCausalLM", "greedy_tokens"),
    ("lm_head", "treadle.models.llama", "LlamaForCausalLM", "compute_logits"),
    ("sample", "treadle.worker.model_runner", "ModelRunner", "_sample"),
    ("output_processing", "treadle.engine.output_processor", "OutputProcessor", "process"),
    ("step", "treadle.engine.driver", "EngineDriver", "step"),
]


@contextmanager
def timed_parts():
    """Wrap every part; yields the list of steps, each {part: [wall_s, cpu_s]} plus the
    step's "tokens" and "rows" (from the scheduler's output)."""
    import importlib

    steps: list[dict] = []
    current: dict = defaultdict(lambda: [0.0, 0.0])
    saved = []
    for name, module, cls, method in PARTS:
        owner = importlib.import_module(module)
        owner = owner if cls is None else getattr(owner, cls)
        original = owner.__dict__[method]

        def wrapper(*args, _original=original, _name=name, **kwargs):
            w0, c0 = time.perf_counter(), time.thread_time()
            result = None
            try:
                result = _original(*args, **kwargs)
                return result
            finally:
                entry = current[_name]
                entry[0] += time.perf_counter() - w0
                entry[1] += time.thread_time() - c0
                if _name == "schedule" and result is not None:
                    current["tokens"] = result.num_scheduled_tokens
                    current["rows"] = len(result.scheduled)
                if _name == "step":
                    steps.append(dict(current))
                    current.clear()

        setattr(owner, method, wrapper)  # a module's function: called by its global name
        saved.append((owner, method, original))
    try:
        yield steps
    finally:
        for owner, method, original in saved:
            setattr(owner, method, original)


def split(steps: list[dict]) -> dict:
    """Per-step milliseconds of each part over decode-only steps (every scheduled request
    one token), and the derived ones: the forward call without the decode stack, the
    runner without the forward pass, its preparation, the logits and sampling, and the
    step outside the engine's parts."""
    decode = [s for s in steps if s.get("rows") and s.get("tokens") == s.get("rows")]
    n = max(1, len(decode))
    names = list(dict.fromkeys(p for p, *_ in PARTS))
    ms = {k: 1e3 * sum(s[k][0] for s in decode if k in s) / n for k in names}
    cpu = {k: 1e3 * sum(s[k][1] for s in decode if k in s) / n for k in names}
    derived = {}
    for d, suffix in ((ms, "ms"), (cpu, "cpu_ms")):
        derived[f"forward_glue_{suffix}"] = d["model_forward"] - d["decode_stack"]
        derived[f"runner_rest_{suffix}"] = (d["runner"] - d["model_forward"] - d["prepare"]
                                            - d["lm_head"] - d["sample"])
        derived[f"other_{suffix}"] = (d["step"] - d["runner"] - d["schedule"] - d["update"]
                                      - d["output_processing"])
    return {"decode_steps": len(decode), "ms": ms, "cpu_ms": cpu, **derived}


def run(model: str | None, requests: list[int], prompt_len: int, output_len: int,
        options: dict, paths: tuple[str, ...] = ("short",), repeats: int = 1) -> list[dict]:
    """Rows per (requests, path, repeat): `paths` "short" (the runner's short path for
    plain greedy decode steps, worker/greedy_decode.py, the default) and "general" (it
    switched off), alternating within each repeat. (overlap_steps is measured by
    overlap_steps.py, each configuration in a process of its own.)"""
    from treadle import LLM, SamplingParams

    llm = LLM(model=model, **options)
    vocab = llm.limits.vocab_size
    rng = random.Random(0)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    rows = []
    runner = llm.engine.executor.worker.runner
    for n in requests:
        llm.generate([{"prompt_token_ids": [11] * prompt_len}],
                     SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
        for repeat in range(repeats):
            for path in (paths if repeat % 2 == 0 else paths[::-1]):
                batch = [{"prompt_token_ids": [rng.randrange(10, vocab - 10)
                                               for _ in range(prompt_len)]} for _ in range(n)]
                runner.greedy_decode = path == "short"
                steps_before = llm.get_stats()["num_steps"]
                with timed_parts() as steps:
                    t0 = time.perf_counter()
                    llm.generate(batch, params, use_tqdm=False)
                    wall = time.perf_counter() - t0
                num_steps = llm.get_stats()["num_steps"] - steps_before
                rows.append({"requests": n, "path": path, "repeat": repeat,
                             "steps": num_steps, "wall_s": wall, **split(steps)})
    runner.greedy_decode = True
    llm.engine.shutdown()
    return rows


def workload_parser(description: str) -> argparse.ArgumentParser:
    """The arguments this script shares with overlap_steps.py: the model, the request
    counts and lengths, and engine options as key=value (`engine_options`)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", default="1,4,16")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("options", nargs="*", help="engine options as key=value")
    return parser


def engine_options(items: list[str]) -> dict:
    """key=value items as engine options (digits as ints)."""
    options = {}
    for item in items:
        key, _, value = item.partition("=")
        options[key] = int(value) if value.isdigit() else value
    return options


def main() -> None:
    parser = workload_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--paths", default="short",
                        help="short, general or short,general (alternating)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--output", default=None, help="JSON file for the rows")
    args = parser.parse_args()
    options = engine_options(args.options)
    rows = run(args.model, [int(n) for n in args.requests.split(",")], args.prompt_len,
               args.output_len, options, tuple(args.paths.split(",")), args.repeats)
    parts = list(dict.fromkeys(p for p, *_ in PARTS)) + ["forward_glue", "runner_rest", "other"]
    for row in rows:
        print(f"{row['requests']} requests, {row['path']} path, repeat {row['repeat']}: "
              f"{row['steps']} steps in {row['wall_s']:.3f} s "
              f"({1e3 * row['wall_s'] / max(row['steps'], 1):.3f} ms a step), "
              f"{row['decode_steps']} of them decode-only; per decode step, wall ms / "
              "thread CPU ms:")
        for part in parts:
            wall = row["ms"].get(part, row.get(f"{part}_ms"))
            cpu = row["cpu_ms"].get(part, row.get(f"{part}_cpu_ms"))
            if wall is not None:
                print(f"  {part:>18}: {wall:7.3f} / {cpu:7.3f}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
