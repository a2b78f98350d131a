"""Overload bounds and API-key tenants, as pure bookkeeping."""

from __future__ import annotations

import pytest

from treadle.server.admission import (AdmissionControl, AdmissionLimits, NeverAdmissible,
                                      Overloaded)
from treadle.server.auth import AuthError, KeyRing, Tenant


def control(**kw):
    limits = dict(max_waiting_requests=3, max_waiting_tokens=100,
                  tenant_max_concurrent_requests=2, tenant_tokens_per_minute=0)
    limits.update(kw)
    return AdmissionControl(AdmissionLimits(**limits))


def test_waiting_request_bound_and_release():
    ac = control(tenant_max_concurrent_requests=10)
    tickets = [ac.admit("t", 10, 5, now=0) for _ in range(3)]
    with pytest.raises(Overloaded, match="max_waiting_requests=3") as exc:
        ac.admit("t", 10, 5, now=0)
    assert exc.value.retry_after_s >= 1
    ac.started(tickets[0])  # running requests no longer count as waiting
    ac.admit("t", 10, 5, now=0)
    for t in tickets:
        ac.release(t)
        ac.release(t)  # idempotent
    assert ac.num_waiting == 1 and ac.num_waiting_tokens == 10


def test_waiting_token_bound():
    ac = control(max_waiting_requests=10, tenant_max_concurrent_requests=10)
    ac.admit("t", 60, 1, now=0)
    with pytest.raises(Overloaded, match="max_waiting_tokens=100"):
        ac.admit("t", 41, 1, now=0)


def test_tenant_concurrency_is_per_tenant():
    ac = control(max_waiting_requests=10)
    a1, a2 = ac.admit("a", 1, 1, now=0), ac.admit("a", 1, 1, now=0)
    with pytest.raises(Overloaded, match="'a'"):
        ac.admit("a", 1, 1, now=0)
    ac.admit("b", 1, 1, now=0)
    ac.release(a1)
    ac.admit("a", 1, 1, now=0)
    del a2


def test_tokens_per_minute_window_and_retry_after():
    ac = control(max_waiting_requests=100, tenant_max_concurrent_requests=100,
                 tenant_tokens_per_minute=100)
    ac.release(ac.admit("a", 30, 20, now=0.0))   # 50 tokens at t=0
    ac.release(ac.admit("a", 20, 20, now=10.0))  # 40 tokens at t=10
    with pytest.raises(Overloaded) as exc:
        ac.admit("a", 10, 10, now=20.0)          # 90 + 20 > 100: wait for t=0 to expire
    assert exc.value.retry_after_s == 40
    ac.admit("a", 10, 10, now=60.5)              # the t=0 entry has left the window


def test_a_request_over_the_whole_quota_is_never_admissible():
    # It used to be a 429 with Retry-After: 60 that no retry could ever pass.
    ac = control(max_waiting_requests=100, tenant_max_concurrent_requests=100,
                 tenant_tokens_per_minute=100)
    with pytest.raises(NeverAdmissible, match="tenant_tokens_per_minute") as exc:
        ac.admit("b", 90, 20, now=0)
    assert not isinstance(exc.value, Overloaded) and exc.value.param == "max_tokens"
    assert ac.num_waiting == 0 and ac.num_waiting_tokens == 0  # nothing was counted
    ac.release(ac.admit("b", 90, 10, now=0))  # exactly the quota still passes
    with pytest.raises(NeverAdmissible, match="max_waiting_tokens") as exc:
        ac.admit("c", 101, 1, now=0)  # a prompt larger than the whole waiting queue
    assert exc.value.param == "prompt"


def test_keyring_tenants_and_constant_time_check(tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text("- {key: k1, tenant: acme, weight: 3}\n- {key: k2, tenant: beta}\n")
    ring = KeyRing.from_options(["plain"], str(keys))
    assert ring.authenticate("Bearer k1") == Tenant("acme", 3.0)
    assert ring.authenticate("Bearer plain").name == "key0"
    assert ring.tenants() == {"key0": 1.0, "acme": 3.0, "beta": 1.0}
    for header in (None, "k1", "Bearer ", "Bearer k3", "Basic k1"):
        with pytest.raises(AuthError):
            ring.authenticate(header)
    assert KeyRing.from_options(None, None).authenticate(None).name == "default"


def test_bad_keys_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- {key: k1}\n")
    with pytest.raises(ValueError, match="needs 'key' and 'tenant'"):
        KeyRing.from_options(None, str(bad))
    bad.write_text("- {key: k1, tenant: a, weight: 0}\n")
    with pytest.raises(ValueError, match="weight must be > 0"):
        KeyRing.from_options(None, str(bad))
