"""What the GPU machine has, and whether treadle's offline path runs there as is.

Prints the versions of python, torch, triton and transformers, the GPU, and which of the
packages the offline path does without (the server's fastapi, uvicorn, pydantic;
llguidance for structured outputs; gguf for GGUF files) are there; then imports
everything the GPU check uses (the offline LLM path, bench/static, the Triton kernels)
with those blocked, so a pass here means the check needs no carried wheels. Exits 1 on an
import failure.

    python benchmarks/gpu/environment.py
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import platform
import sys
from pathlib import Path

SERVER_ONLY = ("fastapi", "uvicorn", "pydantic", "starlette", "llguidance", "gguf")
NEEDED = ("torch", "triton", "transformers", "safetensors", "tokenizers", "numpy",
          "prometheus_client", "tqdm", "yaml", "pytest")


class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in SERVER_ONLY:
            raise ImportError(f"{name} is blocked: the offline path must not need it")
        return None


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    print(f"python {platform.python_version()} on {platform.machine()}")
    missing = []
    for name in NEEDED:
        if importlib.util.find_spec(name) is None:
            missing.append(name)
            continue
        module = importlib.import_module(name)
        print(f"  {name} {getattr(module, '__version__', '?')}")
    print("packages the offline path does without, present:",
          [n for n in SERVER_ONLY if importlib.util.find_spec(n) is not None] or "none")
    import torch
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        print(f"GPU: {p.name}, {p.multi_processor_count} SMs, capability {p.major}.{p.minor}, "
              f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free; CUDA {torch.version.cuda}")
    else:
        print("GPU: none visible to torch")
    sys.meta_path.insert(0, _Block())
    for module in ("treadle", "treadle.engine.llm", "treadle.bench.static",
                   "treadle.measure.workloads", "treadle.bench.throughput", "treadle.engine.trace",
                   "treadle.worker.cuda.triton", "treadle.worker.cuda.cuda_graphs",
                   "treadle.worker.cuda.attention_reference", "engine_check", "make_llama_1b"):
        importlib.import_module(module)
    print("offline path, kernels and check scripts import without", ", ".join(SERVER_ONLY))
    if missing:
        print("MISSING:", missing)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
