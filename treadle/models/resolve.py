"""What `--model` names, as a checkpoint directory the loader can read.

Owns the one decision of which checkpoint a model string means:
- None: the default model, SmolLM2-135M-Instruct (treadle/models/default_model.py),
  or the demo model with a warning when it cannot be fetched;
- "demo": the random-weight benchmark checkpoint (treadle/models/demo.py);
- a `.gguf` file, or a directory holding exactly one and no config.json: its cached
  Hugging Face conversion (treadle/models/gguf_convert.py);
- a directory with config.json: itself;
- `org/name` that is not a path: a Hugging Face Hub id, through huggingface_hub
  (`snapshot_download`; only the local HF cache when HF_HUB_OFFLINE=1);
and the served name that goes with it. It loads no model. A GGUF file is converted to
the engine's dtype; what `auto` means there is the caller's `auto` (models/loader.py
`AutoDtype`: the platform's answer), asked only when a conversion needs it.
`check_model` applies the same rules without fetching, converting or importing torch: the
command line's fail-fast check (treadle/cli/preflight.py), seconds before anything heavy.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

DEMO = "demo"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.jinja", "*.txt", "*.tiktoken"]
"""Files fetched from a Hub repository: configs, safetensors weights, tokenizer files."""


def _dtype(dtype: str | torch.dtype, auto) -> torch.dtype:
    from treadle.models.loader import resolve_dtype
    return resolve_dtype(dtype, auto)


def is_hub_id(model: str) -> bool:
    """True for `org/name` strings that are not an existing path."""
    return bool(_HUB_ID.match(model)) and not os.path.exists(model)


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_snapshot(repo_id: str, revision: str | None = None,
                 download_dir: str | None = None) -> Path:
    """The local snapshot of a Hub repository: downloaded (configs, safetensors, tokenizer)
    when online, taken from the HF cache (`download_dir` or huggingface_hub's default)
    when HF_HUB_OFFLINE=1."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError as exc:
        raise ImportError("Hugging Face ids need the `huggingface_hub` package") from exc
    offline = _offline()
    if not offline:
        from huggingface_hub import try_to_load_from_cache
        if not isinstance(try_to_load_from_cache(repo_id, "config.json", cache_dir=download_dir,
                                                 revision=revision), str):
            logger.info("downloading %s (revision %s) from the Hugging Face Hub into %s: its "
                        "configs, safetensors and tokenizer, once (huggingface_hub shows the "
                        "progress; a model's size over the link's speed)", repo_id,
                        revision or "main", download_dir or "the Hugging Face cache")
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=download_dir,
                                 allow_patterns=_HUB_PATTERNS, local_files_only=offline)
    except LocalEntryNotFoundError as exc:
        where = download_dir or "the Hugging Face cache"
        if offline:
            raise FileNotFoundError(f"model {repo_id} (revision {revision or 'main'}) is not in "
                                    f"{where} and HF_HUB_OFFLINE=1 forbids downloading it") from exc
        raise FileNotFoundError(f"cannot download model {repo_id} from the Hugging Face Hub "
                                f"and it is not in {where}: {exc}") from exc
    except (HfHubHTTPError, OSError) as exc:
        raise FileNotFoundError(f"cannot download model {repo_id} (revision "
                                f"{revision or 'main'}) from the Hugging Face Hub: {exc}") from exc
    return Path(path)


def _gguf_in(directory: Path) -> Path | None:
    """The one .gguf file of a directory without config.json; None if it has none."""
    files = sorted(directory.glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(f"{directory} holds {len(files)} GGUF files "
                         f"({', '.join(f.name for f in files)}): pass one of them as --model")
    return files[0] if files else None


def local_checkpoint(path: Path, dtype: str | torch.dtype = "auto",
                     name: str | None = None, auto=None) -> Path:
    """A local directory or .gguf file as a checkpoint directory (`auto`: see the module)."""
    from treadle.models.gguf_convert import cached_checkpoint

    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model file {path} is not a .gguf file; pass a checkpoint "
                             "directory, a .gguf file or a Hugging Face id")
        return cached_checkpoint(path, _dtype(dtype, auto), name=name)
    if (path / "config.json").is_file():
        return path
    gguf = _gguf_in(path)
    if gguf is not None:
        return cached_checkpoint(gguf, _dtype(dtype, auto), name=name)
    raise FileNotFoundError(f"{path} has neither config.json nor a .gguf file")


def default_checkpoint(dtype: str | torch.dtype = "auto", auto=None) -> Path:
    """The default model's checkpoint, or the demo model when it cannot be fetched."""
    from treadle.models import default_model
    from treadle.models.demo import demo_model_path

    try:
        gguf = default_model.default_model_gguf()
    except default_model.FetchError as exc:
        logger.warning("could not fetch the default model %s (%s); serving the random-weight "
                       "demo model instead (its answers are noise; pass --model to choose)",
                       default_model.DEFAULT_MODEL_NAME, exc)
        return demo_model_path()
    return local_checkpoint(gguf, dtype, name=default_model.DEFAULT_MODEL_NAME, auto=auto)


def check_model(model: str | None, revision: str | None = None,
                download_dir: str | None = None) -> None:
    """Raise FileNotFoundError or ValueError, naming the problem and what to pass instead,
    when `model` cannot name a checkpoint by resolve_model's rules; cheap (no torch, no
    download, no conversion). A Hub id is checked against the local cache only when
    HF_HUB_OFFLINE=1 (online, only the download can tell)."""
    if model is None or model == DEMO:
        return
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model file {path} is not a .gguf file; pass a checkpoint "
                             "directory, a .gguf file or a Hugging Face id")
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ValueError(f"model file {path} is not a GGUF file (it does not start "
                                 "with the GGUF magic bytes)")
        return
    if path.is_dir():
        if (path / "config.json").is_file():
            if not any(path.glob("*.safetensors")):
                raise FileNotFoundError(f"model folder {path} has config.json but no "
                                        "*.safetensors weights")
            return
        if _gguf_in(path) is None:
            raise FileNotFoundError(f"model folder {path} has neither config.json nor a "
                                    ".gguf file")
        return
    if not is_hub_id(model):
        raise FileNotFoundError(f"model {model!r} not found: it is neither a folder with "
                                "config.json, a .gguf file, 'demo', nor a Hugging Face id "
                                "(org/name)")
    if _offline():
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, "config.json", cache_dir=download_dir,
                                       revision=revision)
        if not isinstance(found, str):
            raise FileNotFoundError(f"model {model} (revision {revision or 'main'}) is not in "
                                    f"{download_dir or 'the Hugging Face cache'} and "
                                    "HF_HUB_OFFLINE=1 forbids downloading it")


def resolve_model(model: str | None, revision: str | None = None,
                  download_dir: str | None = None, dtype: str | torch.dtype = "auto",
                  auto=None) -> Path:
    """The checkpoint directory `model` names (see the module docstring).

    `dtype` is the engine's (float32, bfloat16 or auto): a GGUF file is converted to it;
    `auto` (models.loader.AutoDtype) says what auto means, when a conversion asks.
    """
    if model is None:
        return default_checkpoint(dtype, auto)
    if model == DEMO:
        from treadle.models.demo import demo_model_path
        return demo_model_path()
    path = Path(model).expanduser()
    if path.exists():
        return local_checkpoint(path, dtype, auto=auto)
    if is_hub_id(model):
        return local_checkpoint(hub_snapshot(model, revision, download_dir), dtype,
                                name=model.split("/")[-1], auto=auto)
    raise FileNotFoundError(f"model {model!r} not found: it is neither a folder with "
                            "config.json, a .gguf file, 'demo', nor a Hugging Face id (org/name)")


def gguf_source(model: str | None, revision: str | None = None,
                download_dir: str | None = None) -> Path | None:
    """The GGUF file `model` names (resolve_model's rules: the default model, a .gguf file,
    a folder or Hub snapshot holding one without config.json, or treadle's cached
    conversion of one), or None when it names a checkpoint of another kind."""
    if model is None:
        from treadle.models import default_model
        try:
            return default_model.default_model_gguf()
        except default_model.FetchError:
            return None
    if model == DEMO:
        return None
    path = Path(model).expanduser()
    if not path.exists() and is_hub_id(model):
        path = hub_snapshot(model, revision, download_dir)
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if path.is_dir() and not (path / "config.json").is_file():
        return _gguf_in(path)
    return _converted_from(path) if path.is_dir() else None


def _converted_from(checkpoint: Path) -> Path | None:
    """The GGUF file a cached conversion was made from (its treadle_gguf.json), while that
    file still has the recorded sha256; else None."""
    import json

    from treadle.models.gguf_convert import SOURCE_FILE, file_sha256

    record = checkpoint / SOURCE_FILE
    if not record.is_file():
        return None
    info = json.loads(record.read_text(encoding="utf-8"))
    source = Path(info.get("source", ""))
    if not source.is_file() or file_sha256(source) != info.get("sha256"):
        return None
    return source


def served_model_name(model: str | None, model_dir: Path) -> str:
    """The name clients use: the Hub id as given, else the checkpoint folder's name."""
    if model is not None and model != DEMO and is_hub_id(model):
        return model
    return Path(model_dir).name
