"""The scheduling policies, one module each, and how a name becomes its policy.

The names come from one registry, `treadle.config.SCHEDULING_POLICIES` (one line per
policy, with its line of `--help`); each name is a module of this package whose `POLICY`
is its `SchedulingPolicy` subclass. Adding a policy is that module and its registry
line; nothing compares policy names. The registry is in config, below core, so that
config checks a name without importing core.
"""

from __future__ import annotations

import importlib

from treadle import config
from treadle.core.fair_share import FairShareLedger
from treadle.core.policies.base import SchedulingPolicy


def policy_class(name: str) -> type[SchedulingPolicy]:
    """The policy class `name` names; a ValueError listing the names for any other."""
    if name not in config.SCHEDULING_POLICIES:
        raise ValueError(f"scheduling policy must be one of "
                         f"{', '.join(config.SCHEDULING_POLICIES)}, got {name!r}")
    return importlib.import_module(f"{__name__}.{name}").POLICY


def make_policy(scheduler_config: config.SchedulerConfig,
                ledger: FairShareLedger) -> SchedulingPolicy:
    """The policy a SchedulerConfig names, sharing the scheduler's fair-share ledger."""
    return policy_class(scheduler_config.scheduling_policy)(scheduler_config, ledger)


__all__ = ["SchedulingPolicy", "make_policy", "policy_class"]
