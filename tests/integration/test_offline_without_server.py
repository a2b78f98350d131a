"""The offline path (LLM.generate on a local checkpoint, bench/static, the GPU check
scripts) runs where the server's packages and the optional ones are absent, as on the GPU
machine whose image has no fastapi, uvicorn, pydantic, llguidance (structured outputs)
or gguf (GGUF files): imported and run here in a process that blocks them."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = ("fastapi", "uvicorn", "pydantic", "starlette", "llguidance", "gguf")


def test_offline_generate_needs_no_server_packages(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    script = textwrap.dedent(f"""
        import importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in {BLOCKED!r}:
                    raise ImportError("blocked " + name)
        sys.meta_path.insert(0, Block())
        sys.path.insert(0, {str(ROOT / "benchmarks" / "gpu")!r})
        import engine_check, make_llama_1b  # the GPU check's own imports
        from treadle import LLM, SamplingParams
        llm = LLM(model={model_dir!r}, dtype="float32", num_kv_blocks=64)
        out = llm.generate([{{"prompt_token_ids": [5, 6, 7]}}],
                           SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
        assert not any(m.split(".")[0] in {BLOCKED!r} for m in sys.modules)
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
