"""bad_words and DRY's sequence breakers as token ids (treadle/engine/token_words.py) on
the demo model's byte-level BPE tokenizer, against plain rules written here; and
spaces_between_special_tokens in the detokenizer (a WordPiece tokenizer, whose decoder
puts a space between any two tokens)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from treadle.engine.detokenizer import make_decode
from treadle.engine.token_words import TokenWords
from treadle.models.demo import build_demo_tokenizer
from treadle.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer():
    return PreTrainedTokenizerFast(tokenizer_object=build_demo_tokenizer())


def test_bad_words_follow_vllm(tokenizer):
    words = TokenWords(tokenizer)
    enc = lambda text: tuple(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    got = words.bad_words(["  hello", "supercalifragilistic"])
    expected = [enc("hello")]
    if enc(" hello")[0] != enc("hello")[0] and len(enc(" hello")) == len(enc("hello")):
        expected.append(enc(" hello"))
    expected.append(enc("supercalifragilistic"))
    spaced = enc(" supercalifragilistic")
    if spaced[0] != expected[-1][0] and len(spaced) == len(expected[-1]):
        expected.append(spaced)
    assert got == expected and len(got) >= 3
    assert words.bad_words(["  "]) == [enc("  ")]  # spaces alone: as they are (vLLM fails)


def test_dry_breakers_follow_llama_cpp(tokenizer):
    words = TokenWords(tokenizer)
    breakers = words.dry_breakers(["\n", "User:"])
    texts = [tokenizer.decode([i]) for i in range(len(tokenizer))]
    for token_id, text in enumerate(texts):
        expected = set()
        for breaker in ("\n", "User:"):
            if breaker in text:
                expected.add(())
                continue
            for start in range(len(text)):  # the text ends with the breaker's beginning
                rest = text[start:]
                if breaker.startswith(rest):
                    expected.add(tuple(tokenizer.encode(breaker[len(rest):],
                                                        add_special_tokens=False)[:20]))
        assert set(breakers.get(token_id, ())) == expected, (token_id, text)
    us = tokenizer.encode("Us", add_special_tokens=False)  # "Us" starts "User:": a head
    assert len(us) == 1 and breakers[us[0]] == (
        tuple(tokenizer.encode("er:", add_special_tokens=False)),)
    assert words.dry_breakers(["\n", "User:"]) is breakers  # cached


def test_resolve_sets_token_ids_only_when_needed(tokenizer):
    words = TokenWords(tokenizer)
    plain = SamplingParams()
    assert words.resolve(plain) is plain
    resolved = words.resolve(SamplingParams(dry_multiplier=0.8, bad_words=["cat"]))
    assert resolved.tokenized.bad_words and resolved.tokenized.dry_breakers
    assert not resolved.needs_tokenized_words
    with pytest.raises(ValueError, match="^dry_multiplier: this model has no tokenizer"):
        TokenWords(None).resolve(SamplingParams(dry_multiplier=0.8))


def test_spaces_between_special_tokens_false_joins_consecutive_special_tokens():
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "##s": 3}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tok.add_special_tokens({"additional_special_tokens": ["<a>", "<b>"]})
    ids = tok.encode("hello <a><b> worlds", add_special_tokens=False)
    assert make_decode(tok, False)(ids) == "hello <a> <b> worlds"  # the decoder's spaces
    assert make_decode(tok, False, False)(ids) == "hello <a><b> worlds"
    assert make_decode(tok, True, False)(ids) == "hello worlds"
