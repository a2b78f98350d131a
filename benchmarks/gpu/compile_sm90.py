"""Compile every Triton kernel configuration for sm_90 (H100/H200) without a GPU.

Runs on any machine with triton installed: triton's own ptxas builds the cubin and its
cuobjdump reports registers, stack (spills) and shared memory per kernel. The arguments
are specialised as triton's launcher would specialise them at real shapes (pointers and
strides divisible by 16), so the figures are those of the real launch. Exits 1 when a
configuration spills (a stack frame), which on the GPU would cost local-memory traffic.

    python benchmarks/gpu/compile_sm90.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from treadle.worker.cuda.triton import decode, kv_write, prefill  # noqa: E402

_TARGET = GPUTarget("cuda", 90, 32)
_INT_PTRS = ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr")
_FLOAT32_PTRS = ("part_acc_ptr", "part_ml_ptr")
_UNALIGNED = ("stride_bt",)  # max_blocks per table row: any value


def _signature(fn, dtype: str, constexprs: dict) -> tuple[dict, dict]:
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        if name in _INT_PTRS:
            sig[name] = "*i32"
        elif name == "slot_ptr":
            sig[name] = "*i64"
        elif name in _FLOAT32_PTRS:
            sig[name] = "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = "*" + dtype
        elif name == "scale_log2":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
        if name.endswith("_ptr") or (name.startswith("stride") and name not in _UNALIGNED):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def _resources(cubin: bytes) -> dict[str, int]:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], check=True,
                              capture_output=True, text=True).stdout
    line = next(line for line in text.splitlines() if "REG:" in line)
    fields = dict(item.split(":", 1) for item in line.split() if ":" in item)
    return {k: int(fields[k]) for k in ("REG", "STACK", "LOCAL")}


def compile_one(fn, dtype: str, constexprs: dict, num_warps: int, num_stages: int) -> dict:
    sig, attrs = _signature(fn, dtype, constexprs)
    kernel = triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs),
                            target=_TARGET, options={"num_warps": num_warps,
                                                     "num_stages": num_stages})
    return {**_resources(kernel.asm["cubin"]), "SHARED": kernel.metadata.shared}


def configurations():
    """(name, kernel, dtype, constexprs, num_warps, num_stages) at the shapes served."""
    for dtype in ("bf16", "fp16"):
        for head_dim in (64, 128, 256):
            for group in (4, 8):
                for sliding in (False, True):
                    cfg = decode.decode_config(head_dim, group)
                    yield (f"decode d{head_dim} g{group} {dtype}{' win' * sliding}",
                           decode._decode_kernel, dtype,
                           dict(GROUP=group, GROUP_PAD=16, HEAD_DIM=head_dim,
                                HEAD_DIM_PAD=head_dim, BLOCK_SIZE=16, TILE_N=cfg["TILE_N"],
                                NUM_SPLITS=8, SLIDING=sliding, DOT_F32=False),
                           cfg["num_warps"], cfg["num_stages"])
                    cfg = prefill.prefill_config(head_dim, group)
                    yield (f"prefill d{head_dim} g{group} {dtype}{' win' * sliding}",
                           prefill._prefill_kernel, dtype,
                           dict(GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim,
                                BLOCK_SIZE=16, BLOCK_M=cfg["BLOCK_M"],
                                BLOCK_Q=cfg["BLOCK_M"] // group, TILE_N=cfg["TILE_N"],
                                SLIDING=sliding, DOT_F32=False),
                           cfg["num_warps"], cfg["num_stages"])
            yield (f"merge d{head_dim} {dtype}", decode._merge_splits_kernel, dtype,
                   dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim, NUM_SPLITS=32), 4, 1)
            yield (f"write_kv d{head_dim} {dtype}", kv_write._write_kv_kernel, dtype,
                   dict(HEAD_DIM=head_dim, HEADS_PAD=8, HEAD_DIM_PAD=head_dim,
                        BLOCK_SIZE=16), 1 if 8 * head_dim <= 1024 else 4, 1)


def main() -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    print(f"triton {triton.__version__}, target sm_90")
    print(f"{'kernel':<28} {'regs':>5} {'stack':>6} {'smem KiB':>9}")
    spills = 0
    for name, fn, dtype, constexprs, num_warps, num_stages in configurations():
        r = compile_one(fn, dtype, constexprs, num_warps, num_stages)
        spills += r["STACK"] > 0 or r["LOCAL"] > 0
        print(f"{name:<28} {r['REG']:>5} {r['STACK']:>6} {r['SHARED'] / 1024:>9.1f}")
    print("no spills" if not spills else f"{spills} configurations spill")
    return 1 if spills else 0


if __name__ == "__main__":
    sys.exit(main())
