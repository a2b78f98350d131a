"""What the Ray tests share: a tiny Llama whose greedy outputs vary (the demo model's
tiny random shapes repeat one token), with the demo tokenizer, and the front end over a
replica set in uvicorn on a thread."""

from __future__ import annotations

import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from conftest import make_tiny_checkpoint
from server_fixtures import free_port
from treadle.server.config import ServerConfig
from treadle.models.demo import write_demo_model

OPTIONS = dict(dtype="float32", num_kv_blocks=128, num_threads=1)
"""Engine options of every replica and of the one-engine reference."""


def tiny_model(root: Path) -> str:
    """A 2-layer Llama over the demo tokenizer's 49152 ids, with its tokenizer files."""
    demo = write_demo_model(root / "demo", config_overrides=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512))
    path = make_tiny_checkpoint(root / "llama", "llama", vocab_size=49152)
    for f in Path(demo).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, path)
    return path


@contextmanager
def serving(engine, **server_options):
    """build_app over `engine` in uvicorn on a thread; yields the base URL."""
    import uvicorn

    from treadle.server.api import build_app
    from treadle.server.auth import KeyRing

    config = ServerConfig(dashboard=False, request_timelines=0, **server_options)
    app = build_app(engine, config, KeyRing.from_options(None, None))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
