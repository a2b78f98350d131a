"""vLLM's extension fields and llama.cpp's DRY and XTC through every door: the offline
`LLM` and the HTTP server (the `openai` client's extra_body, raw bodies), on a tiny demo
model. Each check is one that fails without the feature: return_token_ids gives the ids
the text came from, truncate_prompt_tokens cuts the prompt the engine sees,
allowed_token_ids and bad_words bound what is generated, cache_salt splits the prefix
cache, DRY (a huge multiplier, greedy) never picks a token its penalty names while plain
greedy decoding does, and XTC (top-k 2, probability 1, threshold 0) always takes the
less likely of the two raw top tokens."""

from __future__ import annotations

import httpx
import openai
import pytest

from server_fixtures import running_server, TINY_DEMO
from treadle import LLM, SamplingParams
from treadle.engine.token_words import TokenWords
from treadle.models.demo import write_demo_model
from treadle.worker.dry import dry_penalties

REPEATED = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"
DRY = dict(dry_multiplier=50.0, dry_allowed_length=1, dry_sequence_breakers=["§"])
XTC = dict(temperature=1.0, top_k=2, xtc_probability=1.0, xtc_threshold=0.0)


@pytest.fixture(scope="module")
def tiny_demo(tmp_path_factory):
    return str(write_demo_model(tmp_path_factory.mktemp("demo") / "m", seed=11,
                                config_overrides=TINY_DEMO))


@pytest.fixture(scope="module")
def server(tiny_demo):
    with running_server(tiny_demo, "--num-kv-blocks", "512") as (base, _):
        yield base


@pytest.fixture(scope="module")
def llm(tiny_demo):
    return LLM(model=tiny_demo, dtype="float32", num_kv_blocks=64, block_size=16)


@pytest.fixture(scope="module")
def tokenizer(tiny_demo):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_demo)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)


def dry_violations(words: TokenWords, prompt_ids: list[int], output_ids: list[int]) -> int:
    """Generated tokens that DRY (the DRY fields above) penalizes given their history."""
    params = words.resolve(SamplingParams(**DRY))
    return sum(t in set(dry_penalties(prompt_ids + output_ids[:k], params)[0].tolist())
               for k, t in enumerate(output_ids))


def tokenize(server, text: str) -> list[int]:
    return httpx.post(server + "/tokenize", json={"prompt": text}).json()["tokens"]


# ----- the offline API -----------------------------------------------------------------------

def test_offline_dry_xtc_truncation_allowed_and_salt(llm, tokenizer):
    words = TokenWords(tokenizer)
    greedy = dict(temperature=0, max_tokens=16, ignore_eos=True)
    plain, dry = llm.generate([REPEATED] * 2, [SamplingParams(**greedy),
                                               SamplingParams(**greedy, **DRY)],
                              use_tqdm=False)
    ids = plain.prompt_token_ids
    assert dry_violations(words, ids, plain.outputs[0].token_ids) > 4
    assert dry_violations(words, ids, dry.outputs[0].token_ids) == 0
    xtc = llm.generate(REPEATED, SamplingParams(**XTC, max_tokens=8, logprobs=2,
                                                ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert [lp[t].rank for t, lp in zip(xtc.token_ids, xtc.logprobs)] == [2] * 8
    cut = llm.generate(REPEATED, SamplingParams(max_tokens=2, truncate_prompt_tokens=5),
                       use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-5:]
    allowed = llm.generate(REPEATED, SamplingParams(max_tokens=12, allowed_token_ids=[7, 9],
                                                    ignore_eos=True), use_tqdm=False)[0]
    assert set(allowed.outputs[0].token_ids) <= {7, 9}
    prompt = "a shared prefix that fills a few blocks of sixteen tokens " * 3
    salted = [SamplingParams(max_tokens=1, cache_salt=s) for s in ("s1", "s1", "s2")]
    hits = [llm.generate(prompt, p, use_tqdm=False)[0].num_cached_tokens for p in salted]
    assert hits[0] == 0 and hits[1] >= 16 and hits[2] == 0


def test_offline_allowed_tokens_outlast_the_bans_that_would_leave_nothing(llm, tokenizer):
    # min_tokens bans EOS, the only allowed token: the row keeps it rather than nothing
    eos = tokenizer.eos_token_id
    out = llm.generate("hi", SamplingParams(max_tokens=4, min_tokens=3, temperature=0.7,
                                            allowed_token_ids=[eos]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids[:1] == [eos]


# ----- the server ----------------------------------------------------------------------------

def test_return_token_ids_whole_and_streamed(client, server):
    kwargs = dict(model="tiny", prompt=REPEATED, max_tokens=6, temperature=0,
                  extra_body={"return_token_ids": True, "ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0].model_dump()
    assert whole["prompt_token_ids"] == tokenize(server, REPEATED)
    assert len(whole["token_ids"]) == 6
    text = httpx.post(server + "/detokenize", json={"tokens": whole["token_ids"]}).json()
    assert text["prompt"] == whole["text"]
    chunks = [c.choices[0].model_dump() for c in client.completions.create(stream=True,
                                                                             **kwargs)]
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in c or c["prompt_token_ids"] is None
               for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == whole["token_ids"]
    messages = [{"role": "user", "content": "Hello"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                          extra_body={"return_token_ids": True})
    body = chat.model_dump()
    assert len(body["prompt_token_ids"]) == chat.usage.prompt_tokens
    assert len(body["choices"][0]["token_ids"]) == chat.usage.completion_tokens
    stream = [c.model_dump() for c in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, stream=True, temperature=0,
        extra_body={"return_token_ids": True})]
    assert stream[0]["prompt_token_ids"] == body["prompt_token_ids"]
    assert sum(len(c["choices"][0]["token_ids"] or []) for c in stream if c["choices"]) == \
        4 or stream[-1]["choices"][0]["finish_reason"] == "stop"


def test_truncate_prompt_tokens(client, server):
    out = client.completions.create(model="tiny", prompt=REPEATED, max_tokens=1, echo=True,
                                    extra_body={"truncate_prompt_tokens": 5,
                                                "return_token_ids": True})
    ids = tokenize(server, REPEATED)
    assert out.usage.prompt_tokens == 5 and out.choices[0].model_dump()[
        "prompt_token_ids"] == ids[-5:]
    decoded = httpx.post(server + "/detokenize", json={"tokens": ids[-5:]}).json()["prompt"]
    assert out.choices[0].text.startswith(decoded)  # echo shows what the engine saw
    whole = client.completions.create(model="tiny", prompt=REPEATED, max_tokens=1,
                                      extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(ids)
    r = httpx.post(server + "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "truncate_prompt_tokens": 100000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_allowed_token_ids_and_bad_words(client, server):
    # vLLM bans a word's spaced form too when it is another word of as many tokens
    word = next(w for w in ("the", "and", "on", "in", "to", "of")
                if len(tokenize(server, w)) == len(tokenize(server, " " + w)) == 1)
    spaced, dog = tokenize(server, " " + word), tokenize(server, " dog")
    out = client.completions.create(model="tiny", prompt="pets:", max_tokens=10,
                                    extra_body={"allowed_token_ids": spaced + dog,
                                                "bad_words": [word], "ignore_eos": True,
                                                "return_token_ids": True})
    assert out.choices[0].model_dump()["token_ids"] == dog * 10
    free = client.completions.create(model="tiny", prompt="pets:", max_tokens=10,
                                     extra_body={"allowed_token_ids": spaced + dog,
                                                 "ignore_eos": True, "return_token_ids": True})
    assert set(free.choices[0].model_dump()["token_ids"]) <= set(spaced + dog)
    r = httpx.post(server + "/v1/completions", json={
        "model": "tiny", "prompt": "x", "max_tokens": 1, "allowed_token_ids": [10 ** 6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids"


def test_cache_salt_splits_the_prefix_cache(client):
    prompt = "a salted prefix that fills a few blocks of sixteen tokens " * 4
    usage = [client.completions.create(model="tiny", prompt=prompt, max_tokens=1,
                                       extra_body={"cache_salt": salt}).usage
             for salt in ("one", "one", "two")]
    cached = [u.prompt_tokens_details.cached_tokens for u in usage]
    assert cached[0] == 0 and cached[1] >= 16 and cached[2] == 0


def test_dry_and_xtc_through_the_server(client, server, tokenizer):
    words = TokenWords(tokenizer)
    ids = tokenize(server, REPEATED)
    outputs = {}
    for name, extra in (("plain", {}), ("dry", DRY)):
        out = client.completions.create(model="tiny", prompt=REPEATED, max_tokens=16,
                                        temperature=0, extra_body={
                                            **extra, "ignore_eos": True,
                                            "return_token_ids": True})
        outputs[name] = out.choices[0].model_dump()["token_ids"]
    assert dry_violations(words, ids, outputs["plain"]) > 4
    assert dry_violations(words, ids, outputs["dry"]) == 0
    xtc = client.completions.create(model="tiny", prompt=REPEATED, max_tokens=8, logprobs=2,
                                    temperature=1.0, extra_body={
                                        **{k: v for k, v in XTC.items() if k != "temperature"},
                                        "ignore_eos": True}).choices[0].logprobs
    for chosen, top in zip(xtc.token_logprobs, xtc.top_logprobs):
        assert chosen == pytest.approx(sorted(top.values())[-2], abs=1e-6)


@pytest.mark.parametrize("extra, field", [
    ({"dry_multiplier": -1}, "dry_multiplier"),
    ({"dry_sequence_breakers": []}, "dry_sequence_breakers"),
    ({"xtc_probability": 0.5, "temperature": 0}, "xtc_probability"),
    ({"xtc_threshold": 2}, "xtc_threshold"),
    ({"allowed_token_ids": [5], "response_format": {"type": "json_object"}},
     "allowed_token_ids"),
    ({"cache_salt": ""}, "cache_salt"),
    ({"dry_penalty_last_n": -2}, "dry_penalty_last_n"),
])
def test_out_of_range_fields_are_400_naming_them(server, extra, field):
    r = httpx.post(server + "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(field), r.json()


def test_extension_fields_on_responses(server):
    r = httpx.post(server + "/v1/responses", json={
        "model": "tiny", "input": REPEATED, "max_output_tokens": 4, "temperature": 0.8,
        "dry_multiplier": 0.8, "xtc_probability": 0.3, "cache_salt": "x",
        "spaces_between_special_tokens": False})
    assert r.status_code == 200, r.text
    r = httpx.post(server + "/v1/responses", json={
        "model": "tiny", "input": "hi", "return_token_ids": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_token_ids"
