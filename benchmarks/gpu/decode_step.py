"""Decode and prefill steps of a Llama-3.2-1B-shaped layer stack on treadle's GPU pieces.

A stack of 16 Llama layers (hidden 2048, 32 heads / 8 KV heads of 64, MLP 8192, tied
vocabulary of 49152; random bf16 weights from a fixed seed) written with torch matmuls
and treadle's Triton kernels (K/V write, split-K decode attention, paged prefill), its
decode step captured by treadle's CudaGraphRunner (worker/cuda/cuda_graphs.py) at a few batch
sizes. It prints
- the decode step at batch 1, 64 and 256, eager and by graph replay, against the HBM
  floor (weights + the KV bytes the step reads, over 4.8 TB/s and over the device copy
  rate measured in the same run);
- the prefill step's model FLOPs utilization (2 x parameters x tokens / time) against the
  bf16 matmul rate measured in the same run and against 790 TFLOP/s;
- a check that graph replay, padded batches included, gives the eager step's tokens.

It is not treadle's engine (no scheduler, sampler or loader: engine_check.py measures
that once the CUDA platform lands); it shows what the kernels and the graph runner give.

    python benchmarks/gpu/decode_step.py --json decode_step.json
    python benchmarks/gpu/decode_step.py --smoke   # CPU: tiny shapes, triton's interpreter,
                                                   # graphs replayed by call; checks the
                                                   # script, its timings mean nothing
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

SMOKE = "--smoke" in sys.argv  # known before triton defines the kernels
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from treadle.worker.cuda.cuda_graphs import CudaGraphRunner, ReplayByCall, StaticInput  # noqa: E402
from treadle.worker.cuda.triton import (choose_num_splits, decode_attention,  # noqa: E402
                                   prefill_attention, write_kv)

HBM_BYTES_PER_S = 4.8e12
BF16_FLOPS = 790e12
SHAPE = dict(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, head_dim=64,
             vocab=49152, rope_theta=500000.0)
if SMOKE:
    SHAPE = dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16,
                 vocab=256, rope_theta=10000.0)
DEVICE = "cpu" if SMOKE else "cuda"


def bench(fn, rep_ms: int = 100) -> float:
    """Seconds per call: triton's do_bench on a GPU; the median of 3 calls in a smoke run."""
    if DEVICE == "cuda":
        from triton.testing import do_bench
        return do_bench(fn, rep=rep_ms) / 1e3
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class LayerStack:
    """Weights, KV caches and the forward pass of the benchmark stack (bf16, on CUDA)."""

    def __init__(self, num_blocks: int, block_size: int, max_blocks: int, seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        s = SHAPE
        self.block_size, self.max_blocks, self.dtype = block_size, max_blocks, dtype
        gen = torch.Generator(device=DEVICE).manual_seed(seed)

        def weight(*shape):
            return (torch.randn(*shape, generator=gen, device=DEVICE) * 0.02).to(dtype)

        h, d = s["hidden"], s["head_dim"]
        qkv_out = (s["heads"] + 2 * s["kv_heads"]) * d
        self.embed = weight(s["vocab"], h)
        self.layers = [{"qkv": weight(qkv_out, h), "o": weight(h, s["heads"] * d),
                        "gate_up": weight(2 * s["intermediate"], h),
                        "down": weight(h, s["intermediate"])} for _ in range(s["layers"])]
        cache = (num_blocks, block_size, s["kv_heads"], d)
        self.kv = [torch.randn((2, *cache), generator=gen, device=DEVICE).to(dtype)
                   for _ in range(s["layers"])]
        inv_freq = 1.0 / s["rope_theta"] ** (torch.arange(0, d, 2, device=DEVICE) / d)
        angles = torch.arange(max_blocks * block_size, device=DEVICE)[:, None] * inv_freq
        self.cos, self.sin = angles.cos(), angles.sin()
        self.scale = d ** -0.5
        self.splits: dict[int, int] = {}

    @property
    def num_params(self) -> int:
        """Parameters of the matmuls a token runs through (the tied embedding once)."""
        return self.embed.numel() + sum(w.numel() for layer in self.layers
                                        for w in layer.values())

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.embed.element_size()

    def kv_bytes_read(self, num_seqs: int, seq_len: int) -> int:
        s = SHAPE
        return (2 * s["layers"] * num_seqs * seq_len * s["kv_heads"] * s["head_dim"]
                * self.embed.element_size())

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)

    def forward(self, tokens, positions, slot_mapping, attend) -> torch.Tensor:
        s = SHAPE
        n, d = tokens.shape[0], s["head_dim"]
        x = self.embed[tokens]
        for layer, kv in zip(self.layers, self.kv):
            qkv = self._norm(x) @ layer["qkv"].T
            q, k, v = qkv.split([s["heads"] * d, s["kv_heads"] * d, s["kv_heads"] * d], -1)
            q = self._rope(q.view(n, s["heads"], d), positions)
            k = self._rope(k.view(n, s["kv_heads"], d), positions)
            write_kv(k, v.reshape(n, s["kv_heads"], d), kv[0], kv[1], slot_mapping)
            x = x + attend(q, kv[0], kv[1]).view(n, -1) @ layer["o"].T
            gate, up = (self._norm(x) @ layer["gate_up"].T).chunk(2, -1)
            x = x + (F.silu(gate) * up) @ layer["down"].T
        return self._norm(x)

    def decode(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Greedy next tokens of a batch of one-token requests (a graph-capturable step)."""
        num_seqs = inputs["tokens"].shape[0]
        splits = self.splits.get(num_seqs, 1)

        def attend(q, k_cache, v_cache):
            return decode_attention(q, k_cache, v_cache, inputs["block_tables"],
                                    inputs["seq_lens"], self.scale, num_splits=splits)

        hidden = self.forward(inputs["tokens"], inputs["positions"], inputs["slot_mapping"],
                              attend)
        return (hidden @ self.embed.T).argmax(-1)

    def prefill(self, tokens, positions, slot_mapping, block_tables, query_start_loc,
                seq_lens) -> torch.Tensor:
        def attend(q, k_cache, v_cache):
            return prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc,
                                     seq_lens, self.scale)

        hidden = self.forward(tokens, positions, slot_mapping, attend)
        last = hidden[query_start_loc[1:].long() - 1]
        return (last @ self.embed.T).argmax(-1)


def decode_batch(stack: LayerStack, num_seqs: int, seq_len: int, gen) -> dict[str, torch.Tensor]:
    """num_seqs requests at context seq_len, each over its own random blocks."""
    bs, width = stack.block_size, stack.max_blocks
    used = math.ceil(seq_len / bs)
    pool = stack.kv[0].shape[1]
    tables = torch.zeros(num_seqs, width, dtype=torch.int32, device=DEVICE)
    tables[:, :used] = torch.randperm(pool, device=DEVICE, generator=gen)[
        :num_seqs * used].view(num_seqs, used).to(torch.int32)
    pos = seq_len - 1
    return {"tokens": torch.randint(3, SHAPE["vocab"], (num_seqs,), device=DEVICE, generator=gen),
            "positions": torch.full((num_seqs,), pos, device=DEVICE),
            "slot_mapping": tables[:, pos // bs].long() * bs + pos % bs,
            "seq_lens": torch.full((num_seqs,), seq_len, dtype=torch.int32, device=DEVICE),
            "block_tables": tables}


# what is measured: graph sizes, the decode contexts, the prefill batches, the rate probes
PLAN = dict(sizes=[1, 4, 64, 256], decode=[(1, 1024), (64, 1024), (256, 1024), (64, 4096)],
            checks=[3, 50, 64, 256], prefill=[(4, 2048), (1, 8192)], copy_bytes=1 << 30,
            matmul=8192)
if SMOKE:
    PLAN = dict(sizes=[1, 4, 8], decode=[(1, 40), (8, 40), (4, 100)], checks=[3, 8],
                prefill=[(2, 24), (1, 50)], copy_bytes=1 << 20, matmul=128)


def measure_rates() -> tuple[float, float]:
    """Device-copy bytes/s (read + write) and bf16 matmul FLOP/s, measured now."""
    src = torch.empty(PLAN["copy_bytes"], dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    copy_rate = 2 * src.numel() / bench(lambda: dst.copy_(src))
    m = PLAN["matmul"]
    a = torch.randn(m, m, device=DEVICE, dtype=torch.bfloat16)
    return copy_rate, 2 * m**3 / bench(lambda: a @ a)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run (see above)")
    args = parser.parse_args()
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("decode_step: no CUDA GPU (--smoke runs on CPU)")
        return 2
    torch.manual_seed(0)
    if DEVICE == "cuda":
        props = torch.cuda.get_device_properties(0)
        name, num_sms = props.name, props.multi_processor_count
    else:
        name, num_sms = "cpu (smoke run: timings mean nothing)", 132
    copy_rate, matmul_rate = measure_rates()

    bs, sizes = args.block_size, PLAN["sizes"]
    max_len = max(n for _, n in PLAN["decode"])
    max_blocks = math.ceil(max(max_len, max(n for _, n in PLAN["prefill"])) / bs)
    num_blocks = max(b * math.ceil(n / bs) for b, n in PLAN["decode"] + PLAN["prefill"]) + 1
    stack = LayerStack(num_blocks, bs, max_blocks)
    stack.splits = {size: choose_num_splits(size, SHAPE["kv_heads"], max_len, num_sms)
                    for size in sizes}
    specs = [StaticInput("tokens", (), torch.int64, 0),
             StaticInput("positions", (), torch.int64, 0),
             StaticInput("slot_mapping", (), torch.int64, -1),
             StaticInput("seq_lens", (), torch.int32, 0),
             StaticInput("block_tables", (max_blocks,), torch.int32, 0)]
    runner = CudaGraphRunner(stack.decode, specs, sizes, DEVICE,
                             capture=ReplayByCall() if SMOKE else None)
    runner.capture_all()
    print(f"{name}: copy {copy_rate / 1e12:.2f} TB/s, bf16 matmul "
          f"{matmul_rate / 1e12:.0f} TFLOP/s (measured now); stack of "
          f"{stack.num_params / 1e9:.2f} B parameters ({stack.weight_bytes / 1e9:.2f} GB); "
          f"graphs at {sizes}, decode splits {stack.splits}")

    gen = torch.Generator(device=DEVICE).manual_seed(1)
    checks = []
    for num_seqs in PLAN["checks"]:
        # graph replay of a padded batch == the eager step over the same padded rows (the
        # same kernels at the same shapes: bitwise equal), and the padding rows inert
        batch = decode_batch(stack, num_seqs, PLAN["decode"][0][1], gen)
        size = runner.padded_size(num_seqs)
        padded = {spec.name: torch.cat([batch[spec.name], torch.full(
            (size - num_seqs, *spec.row_shape), spec.pad_value, dtype=spec.dtype,
            device=DEVICE)]) for spec in specs}
        eager = stack.decode(padded)[:num_seqs]
        graph = runner.run(batch)
        checks.append({"num_seqs": num_seqs, "padded_to": size,
                       "tokens_equal": bool(torch.equal(eager, graph))})
    print("graph replay vs eager tokens:", checks)

    rows = []
    for num_seqs, seq_len in PLAN["decode"]:
        batch = decode_batch(stack, num_seqs, seq_len, gen)
        t_eager = bench(lambda: stack.decode(batch))
        t_graph = bench(lambda: runner.run(batch))
        floor_bytes = stack.weight_bytes + stack.kv_bytes_read(num_seqs, seq_len)
        rows.append({"num_seqs": num_seqs, "seq_len": seq_len,
                     "num_splits": stack.splits[runner.padded_size(num_seqs)],
                     "eager_ms": t_eager * 1e3, "graph_ms": t_graph * 1e3,
                     "floor_ms": floor_bytes / HBM_BYTES_PER_S * 1e3,
                     "floor_copy_ms": floor_bytes / copy_rate * 1e3,
                     "graph_over_floor": t_graph / (floor_bytes / HBM_BYTES_PER_S)})
    print("\ndecode step (HBM floor: weights + KV read over 4.8 TB/s; copy: over the "
          "measured copy rate)")
    for r in rows:
        print(f"  batch {r['num_seqs']:>3} ctx {r['seq_len']:>5} splits {r['num_splits']:>2}: "
              f"eager {r['eager_ms']:7.3f} ms, graph {r['graph_ms']:7.3f} ms, floor "
              f"{r['floor_ms']:.3f} ms (copy-rate floor {r['floor_copy_ms']:.3f}) -> "
              f"{r['graph_over_floor']:.2f}x the floor")

    prefill = []
    for num_seqs, num_new in PLAN["prefill"]:
        blocks = math.ceil(num_new / bs)
        tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32, device=DEVICE)
        tables[:, :blocks] = torch.arange(num_seqs * blocks, device=DEVICE,
                                          dtype=torch.int32).view(num_seqs, blocks)
        positions = torch.arange(num_new, device=DEVICE).repeat(num_seqs)
        rows_of = torch.arange(num_seqs, device=DEVICE).repeat_interleave(num_new)
        slots = tables[rows_of, positions // bs].long() * bs + positions % bs
        qsl = torch.arange(num_seqs + 1, device=DEVICE, dtype=torch.int32) * num_new
        lens = torch.full((num_seqs,), num_new, device=DEVICE, dtype=torch.int32)
        tokens = torch.randint(3, SHAPE["vocab"], (num_seqs * num_new,), device=DEVICE)
        t = bench(lambda: stack.prefill(tokens, positions, slots, tables, qsl, lens), 300)
        total = num_seqs * num_new
        model_flops = 2 * stack.num_params * total
        prefill.append({"num_seqs": num_seqs, "num_new": num_new, "ms": t * 1e3,
                        "tokens_per_s": total / t,
                        "mfu_measured_peak": model_flops / t / matmul_rate,
                        "mfu_790": model_flops / t / BF16_FLOPS})
    print("\nprefill step (MFU = 2 x parameters x tokens / time)")
    for p in prefill:
        print(f"  {p['num_seqs']} x {p['num_new']} tokens: {p['ms']:.2f} ms, "
              f"{p['tokens_per_s']:.0f} tok/s, MFU {p['mfu_measured_peak']:.1%} of the "
              f"measured peak, {p['mfu_790']:.1%} of 790 TFLOP/s")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"device": name, "copy_bytes_per_s": copy_rate, "matmul_flops": matmul_rate,
             "num_params": stack.num_params, "graph_checks": checks, "decode": rows,
             "prefill": prefill}, indent=1))
    return 0 if all(c["tokens_equal"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
