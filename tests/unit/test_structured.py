"""Structured outputs on a tiny byte-level BPE tokenizer: masked decoding (greedy and
random) only ever produces strings the grammar accepts; rollback, sync after
preemption, the batch filler, applying masks, the compile cache and error messages."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
import torch

pytest.importorskip("llguidance")

from treadle.structured import (StructuredOutputError, StructuredSpec,  # noqa: E402
                                from_response_format, from_structured_outputs)
from treadle.structured.compiler import GrammarCompiler  # noqa: E402
from treadle.structured.matcher import (BitmaskFiller, allocate_bitmask,  # noqa: E402
                                        allowed_ids, apply_bitmask_)

CORPUS = ['{"name": "bob", "n": 12, "ok": true, "tags": ["a", "b"]}',
          "yes no maybe 2024-01-31 hello world", "[1, 2, 3] {\"a\": false} null",
          "the quick brown fox jumps over the lazy dog 0123456789"] * 20
EOS = "<eos>"

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                  "maxItems": 3}},
          "required": ["name", "n", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)


VOCAB = 416  # the model's logits are wider than the tokenizer (as with padded vocabularies)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler.from_hf_tokenizer(tokenizer, VOCAB)


def decode_masked(compiler, tokenizer, spec, seed: int | None, max_steps: int = 300):
    """Sample with random logits (greedy when seed is None) under the grammar's masks
    until EOS; the text, or None if it ran out of steps."""
    request = compiler.new_request(spec)
    generator = torch.Generator().manual_seed(seed if seed is not None else 0)
    eos = tokenizer.eos_token_id
    bitmask = allocate_bitmask(1, VOCAB)
    out = []
    for _ in range(max_steps):
        logits = torch.randn(1, VOCAB, generator=generator) * 3
        request.fill_bitmask(bitmask[0])
        apply_bitmask_(logits, bitmask)
        if seed is None:
            token = int(logits.argmax())
        else:
            token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        assert request.accept(token), "a masked sampler picked a disallowed token"
        if token == eos:
            assert request.is_terminated()
            return tokenizer.decode(out)
        out.append(token)
    return None


CASES = [
    ("json schema", from_response_format({"type": "json_schema", "json_schema": {
        "name": "t", "schema": SCHEMA, "strict": True}}),
     lambda text: jsonschema.validate(json.loads(text), SCHEMA)),
    ("json object", from_response_format({"type": "json_object"}),
     lambda text: isinstance(json.loads(text), dict) or pytest.fail(text)),
    ("regex", from_structured_outputs({"regex": r"[0-9]{4}-(0[1-9]|1[0-2])-[0-3][0-9]"}),
     lambda text: re.fullmatch(r"[0-9]{4}-(0[1-9]|1[0-2])-[0-3][0-9]", text)
     or pytest.fail(text)),
    ("choice", from_structured_outputs({"choice": ["yes", "no", "maybe so"]}),
     lambda text: text in ("yes", "no", "maybe so") or pytest.fail(text)),
    ("lark", from_structured_outputs({"grammar": 'start: "(" item ("," item)* ")"\n'
                                                 'item: /[a-c]{1,3}/'}),
     lambda text: re.fullmatch(r"\([a-c]{1,3}(,[a-c]{1,3})*\)", text) or pytest.fail(text)),
    ("ebnf", from_structured_outputs({"grammar": 'root ::= "x" digit digit\n'
                                                 'digit ::= [0-9]'}),
     lambda text: re.fullmatch(r"x[0-9][0-9]", text) or pytest.fail(text)),
]


@pytest.mark.parametrize("name, spec, check", CASES, ids=[c[0] for c in CASES])
def test_masked_decoding_only_makes_accepted_strings(compiler, tokenizer, name, spec, check):
    finished = 0
    for seed in [None, *range(12)]:
        text = decode_masked(compiler, tokenizer, spec, seed)
        if text is None:
            continue  # random logits may wander (e.g. an unbounded JSON object)
        check(text)
        finished += 1
    assert finished >= 8, f"only {finished} of 13 decodes of {name} finished"


def test_disallowed_token_is_refused_and_matcher_stays_usable(compiler, tokenizer):
    request = compiler.new_request(from_structured_outputs({"choice": ["yes", "no"]}))
    before = request.allowed_token_ids()
    bad = tokenizer.encode("q", add_special_tokens=False)
    assert not request.accept(bad)
    assert request.accepted == [] and request.allowed_token_ids() == before
    assert request.accept(tokenizer.encode("yes", add_special_tokens=False))
    assert request.allowed_token_ids() == [tokenizer.eos_token_id]
    assert request.is_terminated() and request.is_accepting()


def test_rollback_restores_the_earlier_masks(compiler, tokenizer):
    spec = from_structured_outputs({"json": SCHEMA})
    request = compiler.new_request(spec)
    tokens = tokenizer.encode('{"name": "bob", "n": 12', add_special_tokens=False)
    masks = []
    for token in tokens:
        masks.append(request.allowed_token_ids())
        assert request.accept(token)
    for k in (1, 3, len(tokens)):
        request.rollback(k)
        assert request.allowed_token_ids() == masks[len(tokens) - k]
        assert request.accept(tokens[len(tokens) - k:])
    with pytest.raises(ValueError, match="rollback"):
        request.rollback(len(tokens) + 1)


def test_sync_rebuilds_the_state_after_preemption(compiler, tokenizer):
    spec = from_structured_outputs({"json": SCHEMA})
    tokens = tokenizer.encode('{"name": "al", "n": 7, "ok": ', add_special_tokens=False)
    original = compiler.new_request(spec)
    assert original.accept(tokens)
    resumed = compiler.new_request(spec)  # e.g. in another worker after a swap
    assert resumed.sync(tokens)
    assert resumed.allowed_token_ids() == original.allowed_token_ids()
    # sync to a diverging list (a rejected speculative suffix): rolls back, then accepts
    other = tokenizer.encode('{"name": "al", "n": 8', add_special_tokens=False)
    assert original.sync(other) and original.accepted == other
    fresh = compiler.new_request(spec)
    fresh.accept(other)
    assert original.allowed_token_ids() == fresh.allowed_token_ids()


def test_batch_filler_matches_per_request_masks(compiler, tokenizer):
    spec = from_structured_outputs({"json": SCHEMA})
    texts = ['{"na', '{"name": "x", "n": 1', '{"name": "x", "n": 1, "ok": true}', '']
    requests = [compiler.new_request(spec) for _ in texts]
    for request, text in zip(requests, texts):
        assert request.accept(tokenizer.encode(text, add_special_tokens=False))
    rows = [5, 0, 2, 3]
    bitmask = allocate_bitmask(6, VOCAB)
    filler = BitmaskFiller(num_threads=2)
    try:
        filler.submit(requests, bitmask, rows).result(timeout=30)
    finally:
        filler.close()
    for request, row in zip(requests, rows):
        assert allowed_ids(bitmask[row], VOCAB) == request.allowed_token_ids()
    assert len(allowed_ids(bitmask[1], VOCAB)) == VOCAB  # untouched rows stay all-allowed
    assert allowed_ids(bitmask[2], VOCAB) == [tokenizer.eos_token_id]
    assert all(t < len(tokenizer) for t in allowed_ids(bitmask[3], VOCAB))


def test_apply_bitmask_sets_exactly_the_disallowed_logits_to_minus_inf():
    generator = torch.Generator().manual_seed(3)
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, 13), dtype=torch.int32,
                            generator=generator)
    logits = torch.randn(2, 13 * 32 + 7, generator=generator)  # wider than the mask
    expected = logits.clone()
    for i, row in enumerate((3, 1)):
        for t in range(expected.shape[1]):
            if t >= 13 * 32 or not (int(bitmask[row, t // 32]) >> (t % 32)) & 1:
                expected[i, t] = float("-inf")
    apply_bitmask_(logits, bitmask, rows=[3, 1])
    assert torch.equal(logits, expected)


def test_compile_cache_and_async_compile(tokenizer):
    compiler = GrammarCompiler.from_hf_tokenizer(tokenizer, VOCAB, cache_size=2)
    a = from_structured_outputs({"regex": "a+"})
    same_as_a = StructuredSpec("regex", "a+", field="response_format")
    compiler.compile(a)
    compiler.compile(same_as_a)
    assert compiler.num_compiled == 1
    asyncio.run(compiler.compile_async(from_structured_outputs({"regex": "b+"})))
    assert compiler.num_compiled == 2
    compiler.compile(from_structured_outputs({"regex": "c+"}))  # evicts a (LRU of 2)
    compiler.compile(a)
    assert compiler.num_compiled == 4


@pytest.mark.parametrize("spec, field, construct", [
    (from_structured_outputs({"json": {"type": "string", "format": "weird"}}),
     "structured_outputs.json", "format"),
    (from_structured_outputs({"json": {"type": "strng"}}), "structured_outputs.json",
     "strng"),
    (from_structured_outputs({"regex": "a(b"}), "structured_outputs.regex",
     "unclosed group"),
    (from_structured_outputs({"json": {"type": "string", "pattern": "(?<=a)b"}}),
     "structured_outputs.json", "look-around"),
    (from_structured_outputs({"grammar": "start: foo\nfoo: 'a' bar"}),
     "structured_outputs.grammar", "grammar"),
    (from_response_format({"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#/defs/missing"}}}),
     "response_format.json_schema.schema", "/defs/missing"),
])
def test_compile_errors_name_field_and_construct(compiler, spec, field, construct):
    with pytest.raises(StructuredOutputError) as info:
        compiler.compile(spec)
    assert info.value.field == field
    assert construct in str(info.value)
    with pytest.raises(StructuredOutputError):  # cached errors are raised again
        compiler.compile(spec)


@pytest.mark.parametrize("body, field", [
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": 3}}, "response_format.json_schema.schema"),
    ({"type": "xml"}, "response_format.type"),
])
def test_response_format_shape_errors(body, field):
    with pytest.raises(StructuredOutputError) as info:
        from_response_format(body)
    assert info.value.field == field


@pytest.mark.parametrize("body, field", [
    ({}, "structured_outputs"),
    ({"json": {}, "regex": "a"}, "structured_outputs"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"structural_tag": "x"}, "structured_outputs.structural_tag"),
    ({"regex": "a", "colour": 1}, "structured_outputs.colour"),
    ({"json": "{not json"}, "structured_outputs.json"),
])
def test_structured_outputs_shape_errors(body, field):
    with pytest.raises(StructuredOutputError) as info:
        from_structured_outputs(body)
    assert info.value.field == field


def test_spec_forms():
    assert from_response_format({"type": "text"}) is None
    assert from_response_format(None) is None
    a = from_structured_outputs({"json": '{"type": "object"}'})
    b = from_response_format({"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "object"}, "strict": False}})
    assert a.key == b.key and a.kind == "json"
    closed = from_structured_outputs({"json": {"type": "object", "properties": {
        "properties": {"type": "object"}}}, "disable_additional_properties": True})
    schema = json.loads(closed.value)
    assert schema["additionalProperties"] is False
    assert schema["properties"]["properties"]["additionalProperties"] is False
    assert set(schema["properties"]) == {"properties"}
    assert from_structured_outputs({"json_object": True,
                                    "disable_any_whitespace": True}).compact_json


# ----- a grammar never takes the engine down (issue: no request kills the engine) ---------

def test_grammars_that_overflow_the_parser_are_refused_at_compile_naming_the_limit(compiler):
    """Once admitted, these made the matcher fail on the first consumed token and took the
    engine loop down with every other request; now compiling them is the 400."""
    optional = {"type": "object",
                "properties": {f"p{i}": {"type": "integer"} for i in range(499)}}
    with pytest.raises(StructuredOutputError) as info:
        compiler.compile(from_response_format({"type": "json_schema", "json_schema": {
            "name": "x", "schema": optional}}))
    message = str(info.value)
    assert info.value.field == "response_format.json_schema.schema"
    assert "max is 2000" in message and "499 properties" in message
    assert "<state>" not in message and "consider" not in message
    alternatives = "start: " + " | ".join(f'"a{i}"' for i in range(2001))
    with pytest.raises(StructuredOutputError, match="max is 2000"):
        compiler.compile(from_structured_outputs({"grammar": alternatives}))
    smaller = {"type": "object",
               "properties": {f"p{i}": {"type": "integer"} for i in range(300)}}
    compiler.compile(StructuredSpec.json_schema(smaller, "x"))  # within the limits


class _BrokenMatcher:
    """A matcher whose grammar breaks once the output reaches `fail_at` tokens."""

    def __init__(self, real, fail_at: int) -> None:
        self.real, self.fail_at = real, fail_at

    @property
    def accepted(self):
        return self.real.accepted

    def sync(self, token_ids):
        if len(token_ids) >= self.fail_at:
            raise RuntimeError("grammar matcher failed on validated tokens: Parser Error: "
                               "Current row has 2003 items; max is 2000; consider x <state> y")
        return self.real.sync(token_ids)

    def __getattr__(self, name):
        return getattr(self.real, name)


def _grammar_state(compiler, budget_s=0.05, broken=None):
    from pathlib import Path

    from treadle.worker.grammar import GrammarState
    from concurrent.futures import Future
    state = GrammarState(Path("unused"), VOCAB, compiler.eos_token_ids[0], budget_s)
    built = Future()
    built.set_result(compiler)  # what warm_up builds from the model's tokenizer files
    state._compiler = built
    if broken is not None:  # the matchers of one grammar break at `fail_at` tokens
        pattern, fail_at = broken
        real = state._new_request

        def new_request(spec):
            made = real(spec)
            return _BrokenMatcher(made, fail_at) if spec.value == pattern else made
        state._new_request = new_request
    return state


def test_a_grammar_that_fails_while_generating_fails_its_request_alone(compiler, tokenizer):
    specs = {"good": from_structured_outputs({"regex": "[a-z]{0,40}"}),
             "bad": from_structured_outputs({"regex": "[a-y]{0,40}"})}
    state = _grammar_state(compiler, broken=("[a-y]{0,40}", 3))
    outputs = {"good": [], "bad": []}
    letter = tokenizer.convert_tokens_to_ids("a")
    for _ in range(6):
        state.start([(i, rid, specs[rid], ids, [])
                     for i, (rid, ids) in enumerate(outputs.items())])
        masks = state.masks()
        if state.failed:
            break
        for i, ids in enumerate(outputs.values()):
            assert letter in allowed_ids(masks.bitmask[i], VOCAB)
            ids.append(letter)
    assert list(state.failed) == ["bad"] and len(outputs["bad"]) == 3
    assert len(allowed_ids(masks.bitmask[1], VOCAB)) == VOCAB  # its draw is dropped
    assert letter in allowed_ids(masks.bitmask[0], VOCAB)
    failed = state.failed["bad"]
    assert failed.startswith("structured_outputs.regex: the grammar failed while generating")
    assert "max is 2000" in failed and "<state>" not in failed
    state.start([(0, "good", specs["good"], outputs["good"], [])])  # the other goes on
    assert not state.failed and letter in allowed_ids(state.masks().bitmask[0], VOCAB)
    state.close()


def test_a_grammar_over_the_mask_budget_fails_its_request_alone(compiler, tokenizer):
    """An ambiguous grammar's cost grows with its output (0.3 ms a token at 50 tokens, 387
    ms at 800 in the report): over the budget, it ends instead of slowing every step."""
    ambiguous = from_structured_outputs({"grammar": 'start: x\nx: x x | "a"'})
    plain = from_structured_outputs({"regex": "a*"})
    state = _grammar_state(compiler, budget_s=0.002)
    letter = tokenizer.convert_tokens_to_ids("a")
    outputs = []
    for step in range(2000):
        state.start([(0, "ambiguous", ambiguous, outputs, []), (1, "plain", plain, outputs, [])])
        masks = state.masks()
        if state.failed:
            break
        assert allowed_ids(masks.bitmask[0], VOCAB)
        outputs = outputs + [letter]
    assert list(state.failed) == ["ambiguous"], state.failed
    assert "over the budget of 2 ms a step" in state.failed["ambiguous"]
    assert letter in allowed_ids(masks.bitmask[1], VOCAB)  # the plain request's mask stands
    state.close()


def test_grammars_compile_on_the_pool_never_on_the_callers_thread(compiler, tokenizer):
    """A grammar's compile (and the compiler's own build) runs on the grammar pool from the
    request's first step: neither `prepare` nor `start` waits for it, only the sampler's
    `masks` does. Before, the worker compiled on the engine's thread when the request
    first sampled, stalling every other stream of that step."""
    import time
    state = _grammar_state(compiler)
    real = state._new_request

    def slow(spec):
        time.sleep(0.5)
        return real(spec)
    state._new_request = slow
    spec = from_structured_outputs({"regex": "[a-z]{0,40}"})
    t0 = time.perf_counter()
    state.prepare([("r", spec)])
    state.start([(0, "r", spec, [], [])])
    assert time.perf_counter() - t0 < 0.2
    masks = state.masks()
    assert time.perf_counter() - t0 >= 0.5 and not state.failed  # compile not counted
    assert tokenizer.convert_tokens_to_ids("a") in allowed_ids(masks.bitmask[0], VOCAB)
    state.close()


def test_a_compile_over_its_cpu_budget_is_refused_naming_it_and_stays_refused(tokenizer):
    import time
    compiler = GrammarCompiler.from_hf_tokenizer(tokenizer, VOCAB)
    real = compiler._build

    def busy(spec):
        end = time.thread_time() + 0.3
        while time.thread_time() < end:  # CPU work, as a compile does
            pass
        return real(spec)
    compiler._build = busy
    compiler.budget_s = 0.1
    spec = from_structured_outputs({"regex": "[0-9]+"})
    for _ in range(2):  # the refusal is cached: asking again is refused at once
        with pytest.raises(StructuredOutputError, match=r"of CPU, over the budget of 0.1 s"):
            asyncio.run(compiler.compile_async(spec))
    assert compiler.num_compiled == 1


def test_a_compile_waiting_for_cpu_is_not_refused_for_its_wall_time(tokenizer):
    """A compile descheduled (the idle class on a busy server) but within its CPU budget
    is served: the budget counts the grammar's work, not the machine's load."""
    import time
    compiler = GrammarCompiler.from_hf_tokenizer(tokenizer, VOCAB)
    real = compiler._build

    def descheduled(spec):
        time.sleep(0.4)  # wall time without CPU time
        return real(spec)
    compiler._build = descheduled
    compiler.budget_s = 0.2
    spec = from_structured_outputs({"regex": "[0-9]+"})
    assert asyncio.run(compiler.compile_async(spec)).spec == spec


def test_a_compile_past_the_admission_wait_is_refused_then_served_from_the_cache(tokenizer):
    import time
    compiler = GrammarCompiler.from_hf_tokenizer(tokenizer, VOCAB)
    real = compiler._build

    def slow(spec):
        time.sleep(0.5)
        return real(spec)
    compiler._build = slow
    spec = from_structured_outputs({"regex": "[0-9]+"})
    with pytest.raises(StructuredOutputError, match="did not finish within 0.1 s"):
        asyncio.run(compiler.compile_async(spec, wait_s=0.1))
    time.sleep(0.6)  # the compile finished in its thread and was cached
    t0 = time.perf_counter()
    asyncio.run(compiler.compile_async(spec, wait_s=0.1))
    assert time.perf_counter() - t0 < 0.1 and compiler.num_compiled == 1


def test_compile_threads_run_at_the_idle_scheduling_class(tokenizer):
    """The compile thread takes only cores nothing else wants (Linux SCHED_IDLE); the
    calling thread keeps its class."""
    import os
    compiler = GrammarCompiler.from_hf_tokenizer(tokenizer, VOCAB)
    policy = compiler._compile_executor().submit(os.sched_getscheduler, 0).result()
    assert policy == os.SCHED_IDLE
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


def test_the_server_and_an_in_process_worker_share_one_compiler(tokenizer, tmp_path):
    """A grammar compiled at admission is a cache hit for the worker in the same process:
    one compile per grammar, not one on each side."""
    from treadle.worker.grammar import GrammarState
    first = GrammarCompiler.shared(tmp_path, tokenizer, VOCAB, tokenizer.eos_token_id)
    assert GrammarCompiler.shared(tmp_path, lambda: 1 / 0, VOCAB,
                                  tokenizer.eos_token_id) is first  # built once
    spec = from_structured_outputs({"regex": "[a-c]+"})
    asyncio.run(first.compile_async(spec))
    state = GrammarState(tmp_path, VOCAB, tokenizer.eos_token_id)
    state.prepare([("r", spec)])
    state.start([(0, "r", spec, [], [])])
    state.masks()
    state.close()
    assert first.num_compiled == 1 and not state.failed


def test_a_compile_is_held_to_the_cpus_it_is_given_and_let_go_after(tokenizer):
    """compile_cpus (the server: the engine's step thread's CPU) holds the compile thread
    to those CPUs while it compiles; the thread's affinity is what it was afterwards."""
    import os
    compiler = GrammarCompiler.from_hf_tokenizer(tokenizer, VOCAB)
    allowed = os.sched_getaffinity(0)
    target = {min(allowed)}
    seen = []
    real = compiler._build

    def watched(spec):
        seen.append(os.sched_getaffinity(0))
        return real(spec)
    compiler._build = watched
    compiler.compile_cpus = lambda: target
    asyncio.run(compiler.compile_async(from_structured_outputs({"regex": "x+"})))
    assert seen == [target]
    after = compiler._compile_executor().submit(os.sched_getaffinity, 0).result()
    assert after == allowed
