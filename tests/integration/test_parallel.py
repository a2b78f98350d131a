"""Tensor and pipeline parallelism on CPU with gloo (ranks in child processes): greedy
fp32 tokens equal one rank's for every family, with chunked prefill and preemption in
play; a rank reads only its slices of the checkpoint; a rank that dies or hangs stops the
engine at once and leaves no process behind; torchrun-style launching; a served engine
whose worker dies answers 503 and exits non-zero."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from conftest import make_tiny_checkpoint
from server_fixtures import running_server
from treadle import LLM, SamplingParams
from treadle.executor import WorkerDiedError
from treadle.models.loader import build_model, safetensors_files
from treadle.layers.parallel import ParallelContext
from treadle.worker.parallel_state import layer_partition

PROMPTS = [{"prompt_token_ids": [3 + (7 * i + 11 * j) % 500 for j in range(5 + 3 * i)]}
           for i in range(16)]
OPTIONS = dict(dtype="float32", block_size=4, num_kv_blocks=40, max_num_batched_tokens=32,
               max_num_seqs=6, preemption_mode="recompute", admission_lookahead_tokens=0,
               kv_watermark=0.0)
"""40 blocks of 4 tokens for 16 prompts of up to 50 + 12 tokens: preemption happens."""


def generate(path: str, **options) -> list[list[int]]:
    llm = LLM(model=path, **OPTIONS, **options)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0,
                                                ignore_eos=True), use_tqdm=False)
    preemptions = llm.get_stats()["num_preemptions"]
    llm.engine.shutdown()
    return [o.outputs[0].token_ids for o in outs], preemptions


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("par")
    return {family: make_tiny_checkpoint(root / family, family)
            for family in ("llama", "mistral", "qwen2", "qwen3")}


@pytest.fixture(scope="module")
def single_rank(checkpoints):
    return {family: generate(path, distributed_executor_backend="uni")
            for family, path in checkpoints.items()}


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_tensor_parallel_matches_one_rank(checkpoints, single_rank, family):
    tokens, preemptions = generate(checkpoints[family], tensor_parallel_size=2)
    assert single_rank[family][1] > 0  # preemption was in play
    assert tokens == single_rank[family][0]


@pytest.mark.parametrize("family, options", [
    ("llama", dict(pipeline_parallel_size=2)),
    ("qwen3", dict(pipeline_parallel_size=2, pp_layer_partition="1,1")),
    ("qwen2", dict(tensor_parallel_size=2, pipeline_parallel_size=2)),
])
def test_pipeline_parallel_matches_one_rank(checkpoints, single_rank, family, options):
    tokens, _ = generate(checkpoints[family], **options)
    assert tokens == single_rank[family][0]


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_each_rank_reads_only_its_slices(tmp_path, kv_heads):
    """Each rank reads exactly its shard, every slice once: the tensors split over ranks
    are read once in all, the replicated ones (norms, o_proj's bias, a KV head shared by
    both ranks) once per rank."""
    from safetensors import safe_open

    path = make_tiny_checkpoint(tmp_path / "m", "qwen2", num_key_value_heads=kv_heads)
    with safe_open(str(safetensors_files(path)[0]), "pt") as f:
        sizes = {n: 4 * int(torch.tensor(f.get_slice(n).get_shape()).prod()) for n in f.keys()}
    read = []
    for rank in range(2):
        model, _, num_bytes = build_model(path, torch.float32,
                                          parallel=ParallelContext(tp_size=2, tp_rank=rank))
        assert num_bytes == 4 * sum(p.numel() for p in model.parameters())
        read.append(num_bytes)
    replicated = sum(size for name, size in sizes.items()
                     if "norm" in name or name.endswith("o_proj.bias")
                     or (kv_heads == 1 and (".k_proj." in name or ".v_proj." in name)))
    assert sum(read) == sum(sizes.values()) + replicated


def test_layer_partition():
    assert layer_partition(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert layer_partition(5, 2, [1, 4]) == [(0, 1), (1, 5)]
    with pytest.raises(ValueError, match="pp_layer_partition"):
        layer_partition(5, 2, [2, 2])


def _children(parent: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"mp_worker" in cmd:
                pids.append(int(entry.name))
    return sorted(pids)


def _alive(pid: int) -> bool:
    try:
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("how", ["kill", "hang"])
def test_a_rank_that_dies_or_hangs_stops_the_engine(checkpoints, how):
    llm = LLM(model=checkpoints["llama"], dtype="float32", num_kv_blocks=512,
              tensor_parallel_size=2, worker_timeout=3)
    pids = _children(os.getpid())
    assert len(pids) == 2
    sig = signal.SIGKILL if how == "kill" else signal.SIGSTOP
    threading.Timer(0.5, os.kill, (pids[1], sig)).start()
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="exited" if how == "kill" else "hung"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 4,
                     SamplingParams(max_tokens=500, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - start < 20
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "a rank outlived the engine"


def test_torchrun_style_launch(checkpoints, single_rank, tmp_path):
    """Two ranks started by hand as torchrun would (RANK, WORLD_SIZE, MASTER_*): rank 1 runs
    `treadle worker`, rank 0 drives from LLM."""
    from treadle.measure.launch import free_port

    port = str(free_port())  # a fixed range could collide with a port another test holds
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
           "TREADLE_DISTRIBUTED_EXECUTOR_BACKEND": "torchrun"}
    flags = ["--model", checkpoints["qwen3"], "--tensor-parallel-size", "2"]
    for key, value in OPTIONS.items():
        flags += [f"--{key.replace('_', '-')}", str(value)]
    worker = subprocess.Popen([sys.executable, "-m", "treadle.cli", "worker", *flags],
                              env={**env, "RANK": "1", "LOCAL_RANK": "1"})
    driver = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r});"
              "from test_parallel import generate;"
              f"print(json.dumps(generate({checkpoints['qwen3']!r}, tensor_parallel_size=2)[0]))")
    try:
        out = subprocess.run([sys.executable, "-c", driver], env={**env, "RANK": "0",
                                                                  "LOCAL_RANK": "0"},
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        import json
        assert json.loads(out.stdout.strip().splitlines()[-1]) == single_rank["qwen3"][0]
        assert worker.wait(timeout=60) == 0  # rank 0's shutdown ends rank 1's loop
    finally:
        if worker.poll() is None:
            worker.kill()


def test_served_tensor_parallel_worker_death_exits_nonzero(checkpoints):
    with running_server(checkpoints["llama"], "--tensor-parallel-size", "2",
                        "--num-kv-blocks", "256") as (base, proc):
        assert httpx.post(base + "/v1/completions", json={
            "model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4}).status_code == 200
        pids = _children(proc.pid)
        assert len(pids) == 2
        os.kill(pids[0], signal.SIGKILL)
        start = time.monotonic()
        while httpx.get(base + "/health", timeout=2).status_code != 503:
            assert time.monotonic() - start < 2, "/health did not turn 503"
            time.sleep(0.05)
        assert proc.wait(timeout=15) != 0
        assert not any(_alive(p) for p in pids)
