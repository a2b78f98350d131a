"""How long `treadle serve` takes to answer, and what it holds in memory at rest.

Starts `treadle serve` (the default model unless `--model`) from a source tree on a free
port, times it from the process start to the first 200 from /health, reads the server's
resident memory (VmRSS) 3 s later and after one chat request, and stops it with SIGTERM.
`--fresh` starts from an empty cache folder (the model fetched, converted and quantized
there; the C kernels linked from the usual cache unless `--build-kernels`), then starts
again on it: the first and the second start of a new machine. `--compare TREE` alternates
the runs with another source tree (e.g. an older commit unpacked with `git archive`), as
the machine's load moves between them. Numbers: README.md ("Run it"), docs/memory.md.

    python benchmarks/start_time.py --fresh --repeats 2
    python benchmarks/start_time.py --repeats 3 --compare /tmp/base
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def _rss_mib(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) / 1024


def one_start(tree: Path, cache: Path, args: list[str], log: Path) -> dict:
    """Start, time until healthy, measure memory, ask once, stop."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(tree), "TREADLE_CACHE_DIR": str(cache),
           "PYTHONUNBUFFERED": "1"}
    for name in ("TREADLE_KV_CACHE_MEMORY", "TREADLE_SWAP_SPACE"):  # the defaults, measured
        env.pop(name, None)
    base = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        start = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "treadle.cli", "serve", "--port",
                                 str(port), *args], stdout=out, stderr=subprocess.STDOUT,
                                env=env, cwd=tempfile.gettempdir())
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {proc.returncode}: see {log}")
                try:
                    if httpx.get(base + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            start_s = time.monotonic() - start
            time.sleep(3)
            at_rest = _rss_mib(proc.pid)
            answer = httpx.post(base + "/v1/chat/completions", timeout=900, json={
                "temperature": 0, "max_tokens": 16,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]})
            after = _rss_mib(proc.pid)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    return {"start_s": start_s, "rss_at_rest_mib": at_rest, "rss_after_one_mib": after,
            "answer": answer.json()["choices"][0]["message"]["content"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", default=str(ROOT), help="source tree to run")
    parser.add_argument("--compare", default=None, help="another tree, run in turn")
    parser.add_argument("--cache-dir", default=None,
                        help="TREADLE_CACHE_DIR to start on (default: the usual one)")
    parser.add_argument("--fresh", action="store_true",
                        help="first start on an empty cache folder, then the next ones on it")
    parser.add_argument("--build-kernels", action="store_true",
                        help="with --fresh: the kernels built too (else linked from the cache)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--logs", default=tempfile.gettempdir())
    parser.add_argument("serve_args", nargs="*", help="after --: options for treadle serve")
    args = parser.parse_args()
    from treadle.paths import cache_dir
    cache = Path(args.cache_dir) if args.cache_dir else cache_dir()
    trees = [("tree", Path(args.tree))] + ([("compare", Path(args.compare))]
                                          if args.compare else [])
    runs = []
    if args.fresh:
        cache = Path(tempfile.mkdtemp(prefix="treadle-fresh-cache-"))
        if not args.build_kernels:
            (cache / "kernels").symlink_to(cache_dir() / "kernels", target_is_directory=True)
        runs.append(("first", trees[0][1]))
    runs += [(f"{name} #{i + 1}", tree) for i in range(args.repeats) for name, tree in trees]
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    for label, tree in runs:
        log = Path(args.logs) / f"start-{label.replace(' ', '').replace('#', '')}.log"
        r = one_start(tree, cache, args.serve_args, log)
        print(f"{label:>12}: start {r['start_s']:6.1f} s, resident {r['rss_at_rest_mib']:6.0f} MiB "
              f"at rest, {r['rss_after_one_mib']:6.0f} MiB after one request "
              f"({r['answer']!r}; log {log})", flush=True)
    if args.fresh:
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
