"""The CPU threads of the model's math: how many, and how they wait.

Owns two decisions, both made before a worker builds anything:

- **How many threads**: the CPUs this process may really use, which is the smaller of
  its affinity mask (`os.sched_getaffinity`) and its cgroup's CPU quota
  (`/sys/fs/cgroup/.../cpu.max` under cgroup v2, `cpu.cfs_quota_us` /
  `cpu.cfs_period_us` under v1; the tightest of the process's cgroup and its
  ancestors), rounded up. A container limited to 1.5 CPUs on a 16-core host gets 2
  threads, not 16: OpenMP's own default counts the cores it is allowed to run on, not
  the time it is allowed to run.
- **How idle threads wait** (`omp_wait_policy`): between two parallel regions OpenMP's
  threads spin, by default for ~300,000 rounds (~3 ms here) before they sleep. A step
  runs a few hundred regions with a few microseconds of one-thread work between them,
  and ~1 ms of Python between steps. On cores that other work shares, a spinning
  thread burns the time slice its own team's laggard needs, and the team's every join
  waits for a descheduled thread (issue 51 measured treadle at 3% of its quiet
  throughput on a machine at load 10-19). `auto` spins ~10-20 us (GOMP_SPINCOUNT=1000:
  the gaps inside a step) and then sleeps (the gaps between steps, and a descheduled
  teammate). The runtime reads these variables once, when it loads: they are set here
  before torch is first imported, or not at all (`prepare_openmp` says which).

It decides nothing about the model, and imports no torch.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from treadle.config import OMP_ENV_MARKER, OMP_WAIT_POLICIES

AUTO_SPIN_COUNT = 1000
"""libgomp spin rounds before a waiting thread sleeps under `auto`: one round is a
`pause` and a load, ~11 ns on this Sapphire Rapids guest (measured; more on cores with a
longer pause), so ~11 us: longer than the one-thread kernels between two parallel
regions of a decode step (a norm, the rotary write: a few microseconds), far shorter than
the Python between steps (~1 ms) or a descheduled teammate (a time slice). Offline
throughput on this 2-core machine at load 13-16 (16 requests, 128 + 64 tokens, one run
each, docs/benchmarks.md): 5.4 tok/s with libgomp's default (300,000 rounds), 9.5 at
100,000, 42.8 at 10,000, 68.6 at 1,000, 72.6 passive."""

_ENV = {
    "auto": {"GOMP_SPINCOUNT": str(AUTO_SPIN_COUNT)},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},
    "runtime": {},
}
_USER_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
"""Variables a user may have set themselves: `auto` then leaves the environment alone."""

_RUNTIMES = ("libgomp", "libiomp", "libomp.so")
"""Shared objects of the OpenMP runtimes torch and the kernels may load."""


def openmp_env(policy: str, environ: dict | None = None) -> dict[str, str]:
    """The variables `policy` sets (none for `auto` when the user set any of their own)."""
    if policy not in OMP_WAIT_POLICIES:
        raise ValueError(f"omp_wait_policy must be one of {', '.join(OMP_WAIT_POLICIES)}, "
                         f"got {policy!r}")
    environ = os.environ if environ is None else environ
    if policy == "auto" and any(key in environ for key in _USER_KEYS):
        return {}
    return dict(_ENV[policy])


def openmp_loaded(maps: str = "/proc/self/maps") -> bool:
    """Whether an OpenMP runtime is already mapped into this process (then it has read
    its environment, and changing it does nothing). False where the file cannot be read
    (not Linux): the caller then sets the variables, which is harmless."""
    try:
        text = Path(maps).read_text()
    except OSError:
        return False
    return any(name in text for name in _RUNTIMES)


def prepare_openmp(policy: str) -> str:
    """Set `policy`'s variables in this process's environment (children inherit them)
    when the runtime has not loaded yet; a line saying what was done, for the log."""
    loaded = openmp_loaded()
    inherited = os.environ.get(OMP_ENV_MARKER)
    if inherited and loaded:  # this process's CLI (or a parent) set them before it loaded
        return "OpenMP wait policy: " + ", ".join(
            f"{key}={os.environ.get(key)}" for key in inherited.split(","))
    if inherited:  # set by a treadle parent process, not by the user
        for key in inherited.split(","):
            os.environ.pop(key, None)
        del os.environ[OMP_ENV_MARKER]
    env = openmp_env(policy)
    if not env:
        return f"OpenMP wait policy: {policy}, the environment's own settings"
    if loaded:
        return (f"OpenMP wait policy {policy} not applied: the OpenMP runtime was loaded "
                f"(torch imported) before the engine; set {env} in the environment")
    os.environ.update(env)
    os.environ[OMP_ENV_MARKER] = ",".join(env)
    return f"OpenMP wait policy: {policy} ({', '.join(f'{k}={v}' for k, v in env.items())})"


# ----- how many threads ---------------------------------------------------------------------

def _cgroup_paths(proc_cgroup: str) -> dict[str, str]:
    """controller ('' for the unified v2 hierarchy) -> this process's cgroup path."""
    paths = {}
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return paths
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for controller in parts[1].split(",") if parts[1] else [""]:
            paths[controller] = parts[2]
    return paths


def _ancestors(root: Path, path: str) -> list[Path]:
    """root/path and each of its parents up to root."""
    parts = [p for p in path.split("/") if p]
    return [root.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_cpu_limit(proc_cgroup: str = "/proc/self/cgroup",
                     root: str = "/sys/fs/cgroup") -> float | None:
    """The CPUs' worth of time this process's cgroups allow (quota / period, the tightest
    over the cgroup and its ancestors, v2 or v1), or None when nothing limits it."""
    base = Path(root)
    paths = _cgroup_paths(proc_cgroup)
    limits = []
    if "" in paths:  # cgroup v2: cpu.max holds "max PERIOD" or "QUOTA PERIOD"
        for folder in _ancestors(base, paths[""]):
            fields = (_read(folder / "cpu.max") or "").split()
            if len(fields) == 2 and fields[0] != "max":
                limits.append(int(fields[0]) / int(fields[1]))
    for controller in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):  # cgroup v1
        if "cpu" not in paths:
            break
        for folder in _ancestors(base / controller, paths["cpu"]):
            quota = _read(folder / "cpu.cfs_quota_us")
            period = _read(folder / "cpu.cfs_period_us")
            if quota and period and int(quota) > 0 and int(period) > 0:
                limits.append(int(quota) / int(period))
    return min(limits) if limits else None


def affinity_cpus() -> int:
    """CPUs this process may run on (its affinity mask; the CPU count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def usable_cpus(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int:
    """The threads worth running: the affinity mask's CPUs, capped by the cgroup's CPU
    quota rounded up (1.5 CPUs of quota: 2 threads, throttled together), at least 1."""
    cpus = affinity_cpus()
    limit = cgroup_cpu_limit(proc_cgroup, root)
    if limit is not None:
        cpus = min(cpus, max(1, math.ceil(limit - 1e-9)))
    return max(1, cpus)


def default_num_threads(environ: dict | None = None) -> int:
    """A worker's threads when --num-threads is not given: OMP_NUM_THREADS where the user
    set it (a positive integer), else `usable_cpus()`."""
    environ = os.environ if environ is None else environ
    value = environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if value.isdigit() and int(value) > 0:
        return int(value)
    return usable_cpus()
