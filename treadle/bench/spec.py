"""`treadle bench spec` (python -m treadle.bench.spec): speculative decoding on a real model.

Owns two workloads, the systems compared and the run: a copy-heavy workload (edit a given
text of 300-800 tokens with typos put in, or summarize it; texts are documentation of
Python's standard library, so the run needs no download) and a chat workload (short
questions), each served with speculation off, `ngram`, `draft` and `self`, at several
numbers of concurrent requests (a closed loop: a new request starts when one ends),
side by side in one process: every system's engine is loaded once, then in each repeat
every system's closed loop runs at once, the engines taking one step each in turn (the
order rotates each repeat), each timed over its own steps (`--interleave runs`: one
system's whole run after another, as rounds 1-8 measured). Reported per run: output
tokens/s, its ratio to speculation off (of the medians, and paired by repeat), the
acceptance rate and mean accepted length, proposer time, and the load average. The draft
model of `draft` is the target's first `draft_layers` layers with its embedding, final
norm and LM head, written once as a checkpoint of its own (there is no smaller model of
the same family here); `self` runs the same layers out of the target itself. Greedy
decoding, prefix caching off (repeats would otherwise hit the cache), EOS honoured.
It measures; nothing here is a target or a constant result.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import random
import shutil
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

from treadle.bench.lockstep import run_closed_loop, run_lockstep
from treadle.measure.report import environment, format_table, write_json

logger = logging.getLogger(__name__)

SYSTEMS = ("off", "ngram", "draft", "self")
_TEXT_MODULES = ("argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses",
                 "datetime", "decimal", "difflib", "email", "enum", "fractions",
                 "functools", "heapq", "http.client", "inspect", "itertools", "json",
                 "logging", "mailbox", "multiprocessing", "os", "pathlib", "pickle",
                 "queue", "random", "re", "sched", "shutil", "socket", "sqlite3",
                 "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap",
                 "threading", "timeit", "tkinter", "turtle", "typing", "unittest",
                 "urllib.request", "uuid", "warnings", "weakref", "xml.dom.minidom",
                 "zipfile", "zoneinfo", "bisect", "calendar", "cmd", "codecs", "copy",
                 "doctest", "ftplib", "gzip", "hashlib", "imaplib", "ipaddress", "locale",
                 "optparse", "pdb", "pprint", "selectors", "shelve", "smtplib", "ssl",
                 "struct", "tokenize", "trace", "wave")
_EDIT = ("Correct the spelling mistakes in the following text and return the full corrected "
         "text.", "Proofread the following documentation. Return it in full with the typos "
         "fixed.", "Fix the typos in the following text and return the whole corrected text.")
_SUMMARIZE = ("Summarize the following documentation in a few sentences.",)
_TOPICS = ("photosynthesis", "the water cycle", "black holes", "the French revolution",
           "machine learning", "compound interest", "the immune system", "volcanoes",
           "the internet", "climate change", "the Roman empire", "electric cars",
           "vaccines", "the stock market", "plate tectonics", "honey bees")
_QUESTIONS = ("Explain {} in simple terms.", "What are three interesting facts about {}?",
              "Write a short paragraph about {} for a school newsletter.",
              "Why does {} matter? Answer briefly.")


def _texts() -> list[str]:
    """Prose from the standard library's documentation: each module's docstring followed
    by its public functions' and classes' docstrings."""
    import importlib

    texts = []
    for name in _TEXT_MODULES:
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module this Python lacks (tkinter)
            continue
        parts = [inspect.getdoc(module) or ""]
        with warnings.catch_warnings():  # typing.io and the like warn when touched
            warnings.simplefilter("ignore", DeprecationWarning)
            for attr in sorted(dir(module)):
                obj = getattr(module, attr, None)
                if attr.startswith("_") or not (inspect.isfunction(obj)
                                                or inspect.isclass(obj)):
                    continue
                doc = inspect.getdoc(obj)
                if doc and len(doc) > 80:
                    parts.append(doc)
        texts.append("\n\n".join(p for p in parts if p))
    return texts


def _typos(text: str, rng: random.Random, rate: float = 0.05) -> str:
    """Swap two inner letters of about `rate` of the longer words."""
    words = text.split(" ")
    for i, w in enumerate(words):
        if len(w) > 4 and w.isalpha() and rng.random() < rate:
            j = rng.randrange(1, len(w) - 2)
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def copy_workload(tokenizer, num_requests: int, seed: int = 0,
                  min_tokens: int = 300, max_tokens: int = 800) -> list[list[int]]:
    """Chat prompts asking to edit (3 in 4) or summarize a text of min..max tokens."""
    rng = random.Random(seed)
    texts = _texts()
    prompts = []
    for i in range(num_requests):
        words = texts[i % len(texts)].split(" ")
        target = rng.randrange(min_tokens, max_tokens)
        lo, hi = 1, len(words)
        while lo < hi:  # the longest prefix of whole words within `target` tokens
            mid = (lo + hi + 1) // 2
            if len(tokenizer.encode(" ".join(words[:mid]))) <= target:
                lo = mid
            else:
                hi = mid - 1
        text = " ".join(words[:lo])
        if i % 4 == 3:
            instruction = _SUMMARIZE[0]
        else:
            instruction, text = _EDIT[i % len(_EDIT)], _typos(text, rng)
        messages = [{"role": "user", "content": f"{instruction}\n\n{text}"}]
        prompts.append(tokenizer.apply_chat_template(messages, tokenize=True,
                                                     add_generation_prompt=True))
    return [list(p if isinstance(p, list) else p["input_ids"]) for p in prompts]


def chat_workload(tokenizer, num_requests: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for i in range(num_requests):
        question = _QUESTIONS[i % len(_QUESTIONS)].format(_TOPICS[rng.randrange(len(_TOPICS))])
        messages = [{"role": "user", "content": question}]
        p = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        prompts.append(list(p if isinstance(p, list) else p["input_ids"]))
    return prompts


def _weight_files(model_dir: Path) -> list[Path]:
    """A Hugging Face checkpoint's safetensors files: the shards its index names, or its
    model.safetensors (the checkpoint format's convention, as the engine's loader reads it)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"no model.safetensors or sharded index in {model_dir}")
    return [single]


def describe_costs(costs) -> str:
    """The measured speculation costs an engine reports (its `info.spec_costs`: per row
    count, the verification step's seconds per token count; the draft pass; the draft's
    catch-up), in one line for the result."""
    parts = []
    for rows, tokens, seconds in zip(costs.step_rows, costs.step_tokens, costs.step_seconds):
        parts.append(f"{rows} rows: " + ", ".join(f"{t} tok {s * 1e3:.1f} ms"
                                                   for t, s in zip(tokens, seconds)))
    if costs.draft_rows:
        parts.append("draft pass: " + ", ".join(f"{r} rows {s * 1e3:.1f} ms" for r, s in
                                                zip(costs.draft_rows, costs.draft_seconds)))
    if costs.catchup_seconds_per_token:
        parts.append(f"draft catch-up: {costs.catchup_seconds_per_token * 1e6:.1f} us/token")
    return "; ".join(parts)


def truncated_checkpoint(model_dir: str, num_layers: int, out_dir: Path) -> str:
    """The checkpoint's first `num_layers` layers with its embedding, final norm and LM
    head, as a checkpoint of its own (written once)."""
    from safetensors.torch import load_file, save_file

    out = Path(out_dir) / f"{Path(model_dir).name}-first{num_layers}"
    if (out / "model.safetensors").exists():
        return str(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("generation_config.json",):
        if (Path(model_dir) / name).exists():
            shutil.copy(Path(model_dir) / name, tmp / name)
    kept = {}
    for path in _weight_files(Path(model_dir)):
        for key, tensor in load_file(str(path)).items():
            if key.startswith("model.layers.") and int(key.split(".")[2]) >= num_layers:
                continue
            kept[key] = tensor
    save_file(kept, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tmp.rename(out)
    return str(out)


def _speculative_config(system: str, args, draft_dir: str | None) -> dict | None:
    k = {"num_speculative_tokens": args.num_speculative_tokens, "adaptive": args.adaptive}
    if system == "off":
        return None
    if system == "ngram":
        return {"method": "ngram", **k}
    if system == "draft":
        return {"method": "draft", "model": draft_dir, **k}
    return {"method": "self", "draft_layers": args.draft_layers, **k}


def run(args) -> dict:
    from treadle import LLM

    concurrency = [int(c) for c in args.concurrency.split(",")]
    num_requests = {c: n for c, n in zip(concurrency, map(int, args.requests.split(",")))}
    systems = args.systems.split(",")
    for s in systems:
        if s not in SYSTEMS:
            raise ValueError(f"--systems: {s!r} is not one of {', '.join(SYSTEMS)}")
    from treadle.engine.core import resolve_checkpoint

    # A .gguf file (the default SmolLM2 among them) is converted to a checkpoint in the
    # run's dtype first: the draft is cut out of that checkpoint.
    model_dir = str(resolve_checkpoint(args.model, dtype=args.dtype))
    draft_dir = None
    if "draft" in systems:
        draft_dir = truncated_checkpoint(model_dir, args.draft_layers, Path(args.draft_dir))
    engine_options = dict(dtype=args.dtype, num_threads=args.num_threads,
                          kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=False,
                          max_num_seqs=max(concurrency))
    llms, load_s, costs = {}, {}, {}
    for system in systems:
        t0 = time.perf_counter()
        llms[system] = LLM(model=model_dir, speculative_config=_speculative_config(
            system, args, draft_dir), **engine_options)
        load_s[system] = time.perf_counter() - t0
        info = llms[system].engine.info
        if info.spec_costs is not None:
            costs[system] = describe_costs(info.spec_costs)
    tokenizer = llms[systems[0]].tokenizer
    workloads = {}
    for name in args.workloads.split(","):
        maker = {"copy": copy_workload, "chat": chat_workload}[name]
        workloads[name] = maker(tokenizer, max(num_requests.values()), seed=args.seed)
    runs: list[dict] = []
    for name, prompts in workloads.items():
        for c in concurrency:
            subset = prompts[:num_requests[c]]
            for llm in llms.values():  # warm every engine on this shape once, untimed
                run_closed_loop(llm, subset[:min(c, 2)], 8, c)
            for repeat in range(args.repeats):
                order = systems[repeat % len(systems):] + systems[:repeat % len(systems)]
                if args.interleave == "steps":
                    results = run_lockstep({s: llms[s] for s in order}, subset,
                                           args.max_tokens, c)
                else:
                    results = {s: run_closed_loop(llms[s], subset, args.max_tokens, c)
                               for s in order}
                for system in order:
                    result = results[system]
                    result.update(workload=name, concurrency=c, system=system,
                                  repeat=repeat, num_requests=len(subset))
                    runs.append(result)
                    logger.info("%s c=%d %s repeat %d: %.1f tok/s, acceptance %.2f", name, c,
                                system, repeat, result["output_tokens_per_s"],
                                result["acceptance_rate"])
    return {"benchmark": "spec", "model": args.model, "model_dir": model_dir,
            "engine_options": engine_options,
            "args": vars(args), "environment": environment(), "load_s": load_s,
            "spec_costs": costs, "summary": summarize(runs), "runs": runs}


def summarize(runs: list[dict]) -> list[dict]:
    """Per workload, concurrency and system: medians over the repeats, the ratio of the
    median output tokens/s to speculation off's, and the median (and range) of the
    ratios paired by repeat (the runs that shared the same minutes of the machine)."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["workload"], r["concurrency"], r["system"]), []).append(r)
    rows = []
    for (workload, c, system), rs in groups.items():
        tps = statistics.median(r["output_tokens_per_s"] for r in rs)
        off = groups.get((workload, c, "off"))
        base = statistics.median(r["output_tokens_per_s"] for r in off) if off else None
        off_by_repeat = {r["repeat"]: r["output_tokens_per_s"] for r in off or ()}
        paired = [r["output_tokens_per_s"] / off_by_repeat[r["repeat"]] for r in rs
                  if r["repeat"] in off_by_repeat]
        rows.append({"workload": workload, "concurrency": c, "system": system,
                     "repeats": len(rs), "output_tok_s": round(tps, 2),
                     "vs_off": round(tps / base, 3) if base else None,
                     "vs_off_paired": round(statistics.median(paired), 3) if paired else None,
                     "paired_range": ([round(min(paired), 3), round(max(paired), 3)]
                                      if paired else None),
                     "acceptance": round(statistics.median(r["acceptance_rate"] for r in rs), 3),
                     "mean_acc_len": round(statistics.median(r["mean_accepted_length"]
                                                             for r in rs), 2),
                     "out_tokens": statistics.median(r["output_tokens"] for r in rs),
                     "propose_s": round(statistics.median(r["propose_s"] for r in rs), 2),
                     "load": round(statistics.median(r["load_average"][0] for r in rs), 1)})
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="as `serve --model` (checkpoint folder or .gguf file); the "
                             "default model, SmolLM2-135M-Instruct, when not given")
    parser.add_argument("--workloads", default="copy,chat")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--concurrency", default="1,8,64")
    parser.add_argument("--requests", default="4,16,64",
                        help="requests per run at each concurrency, in the same order")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--interleave", choices=("steps", "runs"), default="steps",
                        help="steps: every system's closed loop runs at once, one engine "
                             "step each in turn (the machine's drift then moves all "
                             "systems together); runs: one system's run after another")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                        help="the adaptive per-request k (--no-adaptive: always the most)")
    parser.add_argument("--draft-layers", type=int, default=4,
                        help="layers of the truncated draft and of self")
    parser.add_argument("--draft-dir", default=str(Path.home() / ".cache" / "treadle-bench"),
                        help="where the truncated draft checkpoint is written")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--kv-cache-memory", default="1280MiB")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="JSON result path")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="treadle bench spec", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return report(run(args), args.output)


def report(result: dict[str, Any], output: str | None) -> int:
    print(format_table(result["summary"], ["workload", "concurrency", "system", "repeats",
                                           "output_tok_s", "vs_off", "vs_off_paired",
                                           "paired_range", "acceptance",
                                           "mean_acc_len", "out_tokens", "propose_s", "load"]))
    if output:
        print(f"wrote {write_json(output, result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
