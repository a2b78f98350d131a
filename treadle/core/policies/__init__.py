"""The scheduling policies, one class per module, and the registry that names them.

`POLICIES` is where policy names come from (`--scheduling-policy`, its validation in
`treadle.config`, the simulator's sizing search): adding a policy is one new module with
a `SchedulingPolicy` subclass and one line below. Nothing else compares policy names.
"""

from __future__ import annotations

from treadle.core.fair_share import FairShareLedger
from treadle.core.policies.base import SchedulingPolicy
from treadle.core.policies.fair import FairPolicy
from treadle.core.policies.fcfs import FCFSPolicy
from treadle.core.policies.makespan import MakespanPolicy
from treadle.core.policies.priority import PriorityPolicy
from treadle.core.policies.srpt import SRPTPolicy

POLICIES: dict[str, type[SchedulingPolicy]] = {policy.name: policy for policy in (
    FCFSPolicy,
    PriorityPolicy,
    SRPTPolicy,
    FairPolicy,
    MakespanPolicy,
)}
"""Every scheduling policy by name, the default first."""

DEFAULT_POLICY = next(iter(POLICIES))


def policy_class(name: str) -> type[SchedulingPolicy]:
    """The policy `name` names; a ValueError listing the names for any other."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, "
                         f"got {name!r}") from None


def make_policy(config, ledger: FairShareLedger) -> SchedulingPolicy:
    """The policy a SchedulerConfig names, sharing the scheduler's fair-share ledger."""
    return policy_class(config.scheduling_policy)(config, ledger)


__all__ = ["DEFAULT_POLICY", "POLICIES", "SchedulingPolicy", "make_policy", "policy_class"]
