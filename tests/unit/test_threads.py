"""worker/threads.py: the thread count from the affinity mask and the cgroup's CPU quota,
and OpenMP's wait policy set before the runtime loads (issue 51, item 6)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from treadle.config import OMP_ENV_MARKER, EngineConfig
from treadle.measure.launch import peer_environment
from treadle.worker import threads


def _cgroup_v2(tmp_path, cpu_max: dict[str, str]):
    """A fake unified hierarchy: /proc/self/cgroup naming /a/b, cpu.max files as given."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cgroup").write_text("0::/a/b\n")
    root = tmp_path / "fs"
    for folder, text in cpu_max.items():
        path = root / folder
        path.mkdir(parents=True, exist_ok=True)
        (path / "cpu.max").write_text(text)
    return str(tmp_path / "cgroup"), str(root)


def test_cgroup_v2_quota_is_the_tightest_of_the_cgroup_and_its_ancestors(tmp_path):
    proc, root = _cgroup_v2(tmp_path, {"": "max 100000\n", "a": "250000 100000\n",
                                       "a/b": "150000 100000\n"})
    assert threads.cgroup_cpu_limit(proc, root) == pytest.approx(1.5)
    proc, root = _cgroup_v2(tmp_path / "x", {"a": "50000 100000\n", "a/b": "max 100000\n"})
    assert threads.cgroup_cpu_limit(proc, root) == pytest.approx(0.5)


def test_cgroup_without_a_quota_limits_nothing(tmp_path):
    proc, root = _cgroup_v2(tmp_path, {"": "max 100000\n", "a/b": "max 100000\n"})
    assert threads.cgroup_cpu_limit(proc, root) is None
    assert threads.cgroup_cpu_limit(str(tmp_path / "missing"), root) is None


def test_cgroup_v1_cfs_quota(tmp_path):
    (tmp_path / "cgroup").write_text("4:memory:/m\n1:cpu,cpuacct:/pod/c\n0::/\n")
    folder = tmp_path / "fs" / "cpu,cpuacct" / "pod" / "c"
    folder.mkdir(parents=True)
    (folder / "cpu.cfs_quota_us").write_text("300000\n")
    (folder / "cpu.cfs_period_us").write_text("100000\n")
    parent = folder.parent
    (parent / "cpu.cfs_quota_us").write_text("-1\n")
    (parent / "cpu.cfs_period_us").write_text("100000\n")
    assert threads.cgroup_cpu_limit(str(tmp_path / "cgroup"),
                                    str(tmp_path / "fs")) == pytest.approx(3.0)


def test_usable_cpus_caps_the_affinity_by_the_quota_rounded_up(tmp_path, monkeypatch):
    monkeypatch.setattr(threads, "affinity_cpus", lambda: 16)
    proc, root = _cgroup_v2(tmp_path, {"a/b": "150000 100000\n"})
    assert threads.usable_cpus(proc, root) == 2
    proc, root = _cgroup_v2(tmp_path / "y", {"a/b": "20000 100000\n"})
    assert threads.usable_cpus(proc, root) == 1
    proc, root = _cgroup_v2(tmp_path / "z", {"a/b": "max 100000\n"})
    assert threads.usable_cpus(proc, root) == 16
    monkeypatch.setattr(threads, "affinity_cpus", lambda: 2)
    proc, root = _cgroup_v2(tmp_path / "w", {"a/b": "800000 100000\n"})
    assert threads.usable_cpus(proc, root) == 2


def test_default_threads_follow_omp_num_threads_when_the_user_set_it(monkeypatch):
    monkeypatch.setattr(threads, "usable_cpus", lambda: 3)
    assert threads.default_num_threads({}) == 3
    assert threads.default_num_threads({"OMP_NUM_THREADS": "5"}) == 5
    assert threads.default_num_threads({"OMP_NUM_THREADS": "4,2"}) == 4
    assert threads.default_num_threads({"OMP_NUM_THREADS": "zero"}) == 3


def test_wait_policies_and_the_users_own_settings():
    assert threads.openmp_env("auto", {}) == {"GOMP_SPINCOUNT": str(threads.AUTO_SPIN_COUNT)}
    assert threads.openmp_env("auto", {"OMP_WAIT_POLICY": "active"}) == {}
    assert threads.openmp_env("passive", {"GOMP_SPINCOUNT": "9"}) == {
        "OMP_WAIT_POLICY": "PASSIVE"}
    assert threads.openmp_env("runtime", {}) == {}
    with pytest.raises(ValueError, match="omp_wait_policy must be one of"):
        threads.openmp_env("spin", {})
    with pytest.raises(ValueError, match="omp_wait_policy must be one of"):
        EngineConfig.from_options(model="demo", omp_wait_policy="sometimes")


def test_openmp_loaded_reads_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 0:0 0 /usr/lib/libc.so.6\n")
    assert not threads.openmp_loaded(str(maps))
    maps.write_text(maps.read_text() + "7f02-7f03 r-xp 0 0:0 0 /x/torch/lib/libgomp.so.1\n")
    assert threads.openmp_loaded(str(maps))


_CHILD = """
import ctypes, importlib.util, json, os, sys
from pathlib import Path
from treadle.worker.threads import prepare_openmp
first = prepare_openmp(sys.argv[1])
gomp = Path(importlib.util.find_spec("torch").origin).parent / "lib" / "libgomp.so.1"
ctypes.CDLL(str(gomp) if gomp.exists() else "libgomp.so.1")  # the runtime torch loads
second = prepare_openmp(sys.argv[2])
keys = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "TREADLE_OMP_ENV_SET")
print(json.dumps({"first": first, "second": second,
                  "env": {k: os.environ.get(k) for k in keys}}))
"""


def _child(*policies: str, env: dict | None = None) -> dict:
    base = {k: v for k, v in os.environ.items()
            if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", OMP_ENV_MARKER)}
    out = subprocess.run([sys.executable, "-c", _CHILD, *policies], check=True,
                         capture_output=True, text=True, env={**base, **(env or {})})
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_policy_is_set_before_torch_loads_and_not_after():
    got = _child("passive", "active")
    assert got["env"]["OMP_WAIT_POLICY"] == "PASSIVE"
    assert got["env"]["GOMP_SPINCOUNT"] is None
    assert "OMP_WAIT_POLICY=PASSIVE" in got["first"]
    assert "ACTIVE" not in json.dumps(got["env"])  # too late: the runtime has loaded
    assert "OMP_WAIT_POLICY=PASSIVE" in got["second"]


def test_a_parents_settings_give_way_to_the_childs_policy_but_the_users_stay():
    parent = {"GOMP_SPINCOUNT": "2000", OMP_ENV_MARKER: "GOMP_SPINCOUNT"}
    got = _child("passive", "passive", env=parent)
    assert got["env"]["GOMP_SPINCOUNT"] is None and got["env"]["OMP_WAIT_POLICY"] == "PASSIVE"
    got = _child("auto", "auto", env={"GOMP_SPINCOUNT": "77"})  # the user's own
    assert got["env"]["GOMP_SPINCOUNT"] == "77" and got["env"]["TREADLE_OMP_ENV_SET"] is None


def test_peers_start_without_what_treadle_set():
    env = {"PATH": "/bin", "GOMP_SPINCOUNT": "2000", "OMP_WAIT_POLICY": "x",
           OMP_ENV_MARKER: "GOMP_SPINCOUNT"}
    assert peer_environment(env) == {"PATH": "/bin", "OMP_WAIT_POLICY": "x"}
    assert peer_environment({"PATH": "/bin"}) == {"PATH": "/bin"}
