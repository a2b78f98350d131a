"""Streaming text: deltas concatenate to the full decode (multi-byte characters split
across tokens, byte-fallback tokenizers), stop strings spanning tokens, and the output
processor's cumulative outputs, stop reasons, logprobs, n > 1 grouping, abort and reject."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treadle.core.outputs import EngineCoreOutput, PromptLogprobs, TokenLogprobs
from treadle.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher, make_decode
from treadle.engine.output_processor import OutputProcessor
from treadle.request import FinishReason
from treadle.sampling_params import SamplingParams

UTF8_HEAVY = ["日本語のテキストを書きます。", "emoji 🎉👍🏽👨‍👩‍👧 and flags 🇯🇵🇫🇷",
              "naïve café — Ελληνικά и русский", "mixed 中文, 한국어 and ascii\nnew line",
              "  spaces   and\ttabs ", "zero\u200bwidth e\u0301 combining"]


@pytest.fixture(scope="module")
def demo_tok():
    from transformers import PreTrainedTokenizerFast

    from treadle.models.demo import build_demo_tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=build_demo_tokenizer())


@pytest.fixture(scope="module")
def fallback_tok():
    """A Llama-style SentencePiece BPE: Metaspace '▁', byte-fallback <0xXX> tokens for
    anything outside its tiny vocabulary, and a decoder that strips the leading space."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", "a", "b", "c", "e", "t", "h", "▁t", "▁th", "▁the", "▁a", "at", "▁c",
               "▁cat"]
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = [("▁", "t"), ("▁t", "h"), ("▁th", "e"), ("a", "t"), ("▁", "a"), ("▁", "c"),
              ("▁c", "at")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                               byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def stream(tokenizer, prompt_ids, ids, chunks=None, skip_special_tokens=True) -> list[str]:
    detok = IncrementalDetokenizer(make_decode(tokenizer, skip_special_tokens), prompt_ids)
    deltas, i = [], 0
    rng = random.Random(len(ids))
    while i < len(ids):
        n = 1 if chunks is None else rng.randint(1, chunks)
        deltas.append(detok.push(ids[i:i + n]))
        i += n
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("chunks", [None, 3])
def test_utf8_heavy_deltas_equal_the_full_decode(demo_tok, chunks):
    prompt = demo_tok.encode("Translate: ")
    for text in UTF8_HEAVY:
        ids = demo_tok.encode(text)
        deltas = stream(demo_tok, prompt, ids, chunks)
        assert "".join(deltas) == demo_tok.decode(ids) == text
        assert not any("\ufffd" in d for d in deltas)  # characters are released whole
    # Tokens that split characters really occur (4-byte emoji are several tokens).
    assert any(demo_tok.decode([t]) == "\ufffd" for t in demo_tok.encode("🎉"))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 49151), min_size=1, max_size=30),
       st.lists(st.integers(0, 49151), max_size=8))
def test_any_token_sequence_streams_to_its_decode(demo_tok, ids, prompt):
    # Random ids include lone bytes of multi-byte characters and special tokens.
    assert "".join(stream(demo_tok, prompt, ids)) == demo_tok.decode(ids,
                                                                    skip_special_tokens=True)
    assert "".join(stream(demo_tok, prompt, ids, skip_special_tokens=False)) == \
        demo_tok.decode(ids, skip_special_tokens=False)


def test_byte_fallback_tokenizer(fallback_tok):
    prompt = fallback_tok.encode("the cat", add_special_tokens=False)
    for text in ["the cat at 日本 🎉", "é the", "cat 🎉"]:
        ids = fallback_tok.encode(text, add_special_tokens=False)
        assert any(fallback_tok.convert_ids_to_tokens(i).startswith("<0x") for i in ids)
        # Alone: the decoder strips the first leading space, as decode(output) does.
        assert "".join(stream(fallback_tok, [], ids)) == fallback_tok.decode(ids) == text
        # After a prompt: the continuation keeps its leading space.
        full = fallback_tok.decode(prompt + ids)
        expected = full[len(fallback_tok.decode(prompt)):]
        assert "".join(stream(fallback_tok, prompt, ids)) == expected == " " + text


def test_stop_strings_span_chunks_and_are_held_back():
    m = StopStringMatcher(["STOP", "\n\n"], include_stop_str_in_output=False)
    assert m.feed("Hello S") == "Hello "   # "S" could start "STOP"
    assert m.feed("T") == ""
    assert m.feed("Ox") == "STOx"          # resolved: not a stop after all
    assert m.feed("yz\n") == "yz"
    assert m.feed("\nafter") == ""         # "\n\n" matched across chunks
    assert m.matched == "\n\n" and m.text == "Hello STOxyz"
    assert m.feed("more") == ""            # nothing after a match

    inc = StopStringMatcher(["END"], include_stop_str_in_output=True)
    assert inc.feed("abcE") == "abcE" and inc.feed("NDtail") == "ND"
    assert inc.text == "abcEND" and inc.matched == "END"

    early = StopStringMatcher(["ab", "b"], include_stop_str_in_output=False)
    assert early.feed("xab") == "x" and early.matched == "ab"  # the earliest match wins

    quiet = StopStringMatcher(["ab"], include_stop_str_in_output=False)
    assert quiet.feed("xab", check=False) == "xab" and quiet.matched is None
    assert quiet.feed("a", check=False) == "" and quiet.flush() == "a"


def _processor(tok, params, rid="r", prompt_ids=(5, 6)):
    proc = OutputProcessor(tok)
    proc.add_request(rid, None, list(prompt_ids), params, 0.0)
    return proc, proc.engine_requests(rid)


def _out(rid, ids, finish=None, **kw):
    return EngineCoreOutput(rid, list(ids), finish, **kw)


def test_processor_streams_and_stops_on_a_string_spanning_tokens(demo_tok):
    text = "The answer is 42. 日本語 END of story"
    ids = demo_tok.encode(text)
    proc, (req,) = _processor(demo_tok, SamplingParams(max_tokens=100, stop=["語 END"]))
    assert req.request_id == "r" and req.parent_id == "r"
    seen, stopped_at = [], None
    for k, t in enumerate(ids):
        outs, to_stop = proc.process([_out("r", [t])])
        (o,) = outs
        assert o.outputs[0].text.startswith(seen[-1] if seen else "")  # only grows
        seen.append(o.outputs[0].text)
        if to_stop:
            stopped_at = k
            assert to_stop == ["r"] and o.finished
            break
    c = o.outputs[0]
    assert c.text == "The answer is 42. 日本" and c.finish_reason == "stop"
    assert c.stop_reason == "語 END" and c.token_ids == ids[:stopped_at + 1]
    assert not proc.has_request("r")
    assert proc.process([_out("r", [7])]) == ([], [])  # a late token is ignored


def test_processor_stop_token_eos_and_length(demo_tok):
    ids = demo_tok.encode("hello world")
    proc, _ = _processor(demo_tok, SamplingParams(stop_token_ids=[ids[-1]]))
    proc.process([_out("r", ids[:-1])])
    (o,), _ = proc.process([_out("r", ids[-1:], FinishReason.STOP)])
    assert o.outputs[0].text == demo_tok.decode(ids[:-1]) and o.outputs[0].stop_reason == ids[-1]
    proc, _ = _processor(demo_tok, SamplingParams(include_stop_str_in_output=True))
    (o,), _ = proc.process([_out("r", ids, FinishReason.STOP)])  # EOS-like stop
    assert o.outputs[0].text == "hello world" and o.outputs[0].stop_reason is None
    proc, _ = _processor(demo_tok, SamplingParams(stop=["zzz"]))
    (o,), _ = proc.process([_out("r", demo_tok.encode("ab zz"), FinishReason.LENGTH)])
    assert o.outputs[0].text == "ab zz" and o.outputs[0].finish_reason == "length"


def test_processor_logprobs_and_prompt_logprobs(demo_tok):
    proc, _ = _processor(demo_tok, SamplingParams(logprobs=2, prompt_logprobs=1),
                         prompt_ids=[40, 41, 42])
    plp = PromptLogprobs(1, [TokenLogprobs([41, 7], [-1.0, -0.5], [3, 1]),
                             TokenLogprobs([42, 42], [-0.1, -0.1], [1, 1])])
    assert proc.process([_out("r", [], new_prompt_logprobs=plp)]) == ([], [])
    entry = TokenLogprobs([50, 50, 51], [-0.2, -0.2, -2.0], [1, 1, 2])
    (o,), _ = proc.process([_out("r", [50], new_logprobs=[entry])])
    (lp,) = o.outputs[0].logprobs
    assert list(lp) == [50, 51] and lp[50].logprob == -0.2 and lp[51].rank == 2
    assert lp[50].decoded_token == demo_tok.decode([50])
    assert o.outputs[0].cumulative_logprob == pytest.approx(-0.2)
    assert o.prompt_logprobs[0] is None and list(o.prompt_logprobs[1]) == [41, 7]
    assert o.prompt_logprobs[2][42].rank == 1


def test_processor_groups_n_samples():
    params = SamplingParams(n=3, seed=10, max_tokens=2)
    proc, first = _processor(None, params)
    assert [r.request_id for r in first] == ["r#0"] and first[0].sampling_params.seed == 10
    assert proc.engine_request_ids("r") == ["r#0", "r#1", "r#2"]
    assert proc.requests_to_add() == [] and proc.engine_requests("r") == []
    (o,), _ = proc.process([_out("r#0", [9])])
    assert [c.token_ids for c in o.outputs] == [[9], [], []] and not o.finished
    assert proc.requests_to_add() == ["r"]
    rest = proc.engine_requests("r")
    assert [(r.request_id, r.sampling_params.seed, r.sampling_params.n) for r in rest] == [
        ("r#1", 11, 1), ("r#2", 12, 1)]
    assert proc.requests_to_add() == []
    outs, _ = proc.process([_out("r#0", [8], FinishReason.LENGTH), _out("r#2", [4])])
    assert len(outs) == 1 and not outs[0].finished
    outs, _ = proc.process([_out("r#1", [1, 2], FinishReason.LENGTH),
                            _out("r#2", [5], FinishReason.LENGTH)])
    (o,) = outs
    assert o.finished and [c.token_ids for c in o.outputs] == [[9, 8], [1, 2], [4, 5]]
    assert [c.index for c in o.outputs] == [0, 1, 2] and o.outputs[0].text == ""


def test_processor_abort_and_reject(demo_tok):
    proc, _ = _processor(demo_tok, SamplingParams(n=2, stop=["xyz"]))
    proc.process([_out("r#0", demo_tok.encode("ab x"))])
    o = proc.abort("r")
    assert o.finished and [c.finish_reason for c in o.outputs] == ["abort", "abort"]
    assert o.outputs[0].text == "ab x"  # the held-back "x" is released at the end
    assert proc.abort("r") is None and not proc.has_request("r")
    proc, _ = _processor(demo_tok, SamplingParams())
    o = proc.reject("r", "too long")
    assert o.error == "too long" and o.outputs[0].finish_reason == "error"
    assert proc.reject("never-added", "bad").outputs[0].finish_reason == "error"
