"""The Responses API's store: per-tenant LRU bound, and no tenant reads another's."""

from treadle.server.response_store import ResponseStore
from treadle.server.responses_items import input_messages


def test_store_is_per_tenant_and_bounded():
    store = ResponseStore(capacity=2)
    store.put("a", "r1", {"n": 1})
    store.put("a", "r2", {"n": 2})
    store.put("b", "r1", {"n": 10})
    assert store.get("b", "r1") == {"n": 10} and store.get("a", "r1") == {"n": 1}
    store.put("a", "r3", {"n": 3})  # evicts a's least recently used: r2 (r1 was just read)
    assert store.get("a", "r2") is None and store.get("a", "r1") == {"n": 1}
    assert store.get("c", "r1") is None
    assert store.delete("a", "r1") and not store.delete("b", "r3")
    assert store.get("b", "r1") == {"n": 10}


def test_input_items_become_chat_messages():
    messages = input_messages([
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": {"ok": True}}])
    assert messages[0] == {"role": "user", "content": "hi"}
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": '{"ok": true}'}
