"""The server's LoRA options without a model: `--lora-modules` in vLLM's two forms, and
the keys file's `models` limiting a key to some served models."""

from __future__ import annotations

import pytest

from treadle.server.auth import KeyRing
from treadle.server.serve import parse_lora_modules


def test_lora_modules_take_name_equals_path_and_json():
    assert parse_lora_modules(["a=/x/a", '{"name": "b", "path": "/x/b=c"}', "c=/p=q"]) == [
        ("a", "/x/a"), ("b", "/x/b=c"), ("c", "/p=q")]
    assert parse_lora_modules(None) == []


@pytest.mark.parametrize("entry, words", [
    ("noequals", "name=path"), ("=/path", "needs a name"), ("a=", "needs a name"),
    ('{"name": "a"}', "'name' and 'path'"), ("{not json", "'name' and 'path'")])
def test_bad_lora_modules_name_the_entry(entry, words):
    with pytest.raises(ValueError, match="lora_modules") as info:
        parse_lora_modules([entry])
    assert words in str(info.value)


def test_a_key_with_models_may_use_only_those(tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text("- {key: k1, tenant: a}\n- {key: k2, tenant: b, models: [base, ad]}\n")
    ring = KeyRing.from_options(None, str(keys))
    open_key, limited = ring.authenticate("Bearer k1"), ring.authenticate("Bearer k2")
    assert open_key.models is None and open_key.may_use("anything")
    assert limited.name == "b" and limited.may_use("ad") and not limited.may_use("other")


@pytest.mark.parametrize("models", ["base", "[1, 2]", '[""]', "{a: 1}"])
def test_a_keys_file_with_bad_models_is_refused(tmp_path, models):
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"- {{key: k1, tenant: a, models: {models}}}\n")
    with pytest.raises(ValueError, match="models must be a list of model names"):
        KeyRing.from_options(None, str(keys))
