"""The batch band and deadlines through every door, on a tiny model: LLM.generate's
`band` / `slo_ttft_ms` / `slo_tpot_ms`, and the server's body fields and the gateway
header `x-slo-ttft-ms` on completions, chat and responses, with `--slo-reject`'s refusal
(503 naming the deadline). The scheduling itself is tested on the fake runner
(tests/unit/test_bands_and_deadlines.py, tests/unit/test_upstream_scheduling.py)."""

from __future__ import annotations

import random

import httpx
import pytest

from server_fixtures import running_server, write_tiny_demo
from treadle import LLM, SamplingParams



@pytest.fixture(scope="module")
def tiny_demo(tmp_path_factory):
    return write_tiny_demo(tmp_path_factory.mktemp("demo"))


def token_prompts(n, seed=0):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(300, 4000) for _ in range(rng.randint(4, 30))]}
            for _ in range(n)]


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def test_llm_generate_takes_the_band_and_batch_work_waits(tiny_demo):
    """band="batch" per prompt: outputs are the ones the interactive band gives, and with
    one seat every interactive request is scheduled before any batch one."""
    llm = LLM(model=tiny_demo, dtype="float32", max_num_seqs=1, num_kv_blocks=64)
    prompts = token_prompts(6)
    bands = ["batch", "interactive", "batch", "interactive", "batch", "interactive"]
    mixed = llm.generate(prompts, GREEDY, use_tqdm=False, band=bands)
    plain = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in plain]
    started = {band: [o.metrics.first_scheduled_time for o, b in zip(mixed, bands) if b == band]
               for band in ("batch", "interactive")}
    assert max(started["interactive"]) < min(started["batch"])
    with pytest.raises(ValueError, match="band must be one of"):
        llm.generate(prompts[:1], GREEDY, use_tqdm=False, band="bulk")


def test_llm_generate_takes_deadlines_and_slo_reject_refuses_what_cannot_make_it(tiny_demo):
    """Under the slo policy with slo_reject: a deadline no engine can meet (a microsecond)
    ends that prompt alone with an error naming slo_ttft_ms and the predicted time; the
    others, with generous deadlines or none, complete as they would under fcfs."""
    llm = LLM(model=tiny_demo, dtype="float32", scheduling_policy="slo", slo_reject=True,
              num_kv_blocks=64)
    prompts = token_prompts(4, seed=1)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False,
                        slo_ttft_ms=[60_000, 0.001, None, 60_000], slo_tpot_ms=[1000, None,
                                                                                None, None])
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "length", "length"]
    assert outs[1].error.startswith("slo_ttft_ms: ") and "predicted at" in outs[1].error
    fcfs = LLM(model=tiny_demo, dtype="float32", num_kv_blocks=64)
    expected = fcfs.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for i, o in enumerate(outs) if i != 1] == [
        o.outputs[0].token_ids for i, o in enumerate(expected) if i != 1]
    with pytest.raises(ValueError, match="slo_tpot_ms must be a positive"):
        llm.generate(prompts[:1], GREEDY, use_tqdm=False, slo_tpot_ms=-5)


@pytest.fixture(scope="module")
def server(tiny_demo):
    with running_server(tiny_demo, "--num-kv-blocks", "256", "--scheduling-policy", "slo",
                        "--slo-reject") as (base, _):
        yield base


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hello there", "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 4}),
])
def test_every_endpoint_takes_the_deadlines_and_refuses_what_cannot_make_it(server, path,
                                                                            body):
    body = {"model": "tiny", **body}
    ok = httpx.post(server + path, json={**body, "slo_ttft_ms": 60_000, "slo_tpot_ms": 5000},
                    timeout=60)
    assert ok.status_code == 200, ok.text
    ok = httpx.post(server + path, json=body, headers={"x-slo-ttft-ms": "60000"}, timeout=60)
    assert ok.status_code == 200, ok.text
    for late in ({"json": {**body, "slo_ttft_ms": 0.001}},
                 {"json": body, "headers": {"x-slo-ttft-ms": "0.001"}}):
        refused = httpx.post(server + path, timeout=60, **late)
        if path == "/v1/responses":  # a failed response, with its error, as OpenAI's are
            assert refused.json()["status"] == "failed", refused.text
            error = refused.json()["error"]
            assert error["code"] == "slo_ttft_ms" and "predicted at" in error["message"]
            continue
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["param"] == "slo_ttft_ms" and "predicted at" in error["message"]
    bad = httpx.post(server + path, json=body, headers={"x-slo-ttft-ms": "soon"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-slo-ttft-ms"
    bad = httpx.post(server + path, json={**body, "slo_tpot_ms": 0}, timeout=60)
    assert bad.status_code == 400 and "slo_tpot_ms" in bad.text
