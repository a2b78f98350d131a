"""P/D's WAITING_FOR_REMOTE_KV: a prefilled request waits without a queue place or a
running slot, and once its blocks land as prefix-cache blocks it is admitted with them as
hits, computing only its last partial block and its first token."""

from __future__ import annotations

from test_scheduler import fake_runner, make_request, make_scheduler

from treadle.core.kv.hashing import hash_block, root_hash
from treadle.request import RequestStatus


def prefilled(rid: str, prompt_len: int, first_token: int = 42):
    request = make_request(rid, prompt_len, max_tokens=5)
    request.append_output_token(first_token)
    return request


def land(scheduler, request, block_size=4) -> int:
    """What kv_transfer.land_blocks does: fill free blocks, register, release."""
    pool, parent = scheduler.kv.pool, root_hash(request.cache_salt)
    tokens = request.prompt_token_ids
    n = len(tokens) // block_size
    blocks = pool.allocate(n)
    for i, block in enumerate(blocks):
        parent = hash_block(parent, tokens[i * block_size:(i + 1) * block_size])
        pool.cache(block, parent)
    pool.free(reversed(blocks))
    return n


def test_waits_without_slot_then_admitted_with_the_landed_blocks():
    s = make_scheduler(max_seqs=1)
    request = prefilled("pd", 10)
    s.add_remote_kv_request(request)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert (s.num_waiting, s.num_running, s.num_waiting_for_kv) == (0, 0, 1)
    assert not s.has_unfinished_requests()  # nothing a step could do yet
    other = make_request("other", 6, max_tokens=2)
    s.add_request(other)  # the one running slot is not taken by the waiting request
    out = s.schedule()
    assert [r.request_id for r in out.scheduled] == ["other"]
    s.update_from_output(out, fake_runner(out))
    while s.requests.get("other") is not None:
        out = s.schedule()
        s.update_from_output(out, fake_runner(out))
    assert s.kv.usage == 0
    assert land(s, request) == 2
    assert s.remote_kv_arrived("pd") and not s.remote_kv_arrived("pd")
    out = s.schedule()
    [scheduled] = out.scheduled
    assert scheduled.request_id == "pd"
    assert request.num_cached_tokens == 8  # both full prompt blocks: hits
    assert scheduled.num_scheduled_tokens == 3  # the prompt's last 2 tokens and the first
    s.update_from_output(out, fake_runner(out))
    assert request.output_token_ids[0] == 42 and len(request.output_token_ids) == 2


def test_abort_while_waiting_for_kv():
    s = make_scheduler()
    s.add_remote_kv_request(prefilled("pd", 9))
    assert s.finish_request("pd", RequestStatus.FINISHED_ABORTED) is not None
    assert s.num_waiting_for_kv == 0 and "pd" not in s.requests
    assert not s.remote_kv_arrived("pd")
