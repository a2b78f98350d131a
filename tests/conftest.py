"""How the suite is split between pytest-xdist's workers (.ci/run and the README:
`-n 2 --dist loadgroup`): each test file runs whole on one worker, so that its module
fixtures (a launched server, a replica set, a Ray cluster) are made once, and every Ray
test file runs on the same worker, so that one local Ray cluster runs at a time.

pytest-xdist's own loadgroup scheduler cannot do this under pytest >= 9.2: it groups by an
`@group` suffix its workers append to `item._nodeid`, an attribute pytest 9.2 no longer
reads (a node's id is `item._id`), so every test was its own group and the two workers
split each file between them, each making the file's fixtures again (two servers, two
replica sets on two Ray clusters at once). The controller makes the scheduler below
instead (this hook runs there; this file is loaded at start, the integration conftest is
not), grouping by file from the node ids alone."""

from __future__ import annotations

from functools import cache
from pathlib import Path

RAY_MARK = "pytest.mark.ray"
"""A test file whose source names this marker runs in the "ray" group (the marker is set
by `pytestmark = pytest.mark.ray`; the controller does not import the test files)."""

FIRST = ("ray",)
"""Groups handed out before the others: the Ray files together are the longest unit of
work, and a long unit handed out last would be the run's tail on one worker while the
other sits idle."""


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    root = Path(config.rootpath)

    @cache
    def uses_ray(path: str) -> bool:
        try:
            return RAY_MARK in (root / path).read_text(encoding="utf-8")
        except OSError:
            return False

    class FileGroups(LoadScopeScheduling):
        """loadscope's dynamic scheduling (a worker takes the next group when it has two
        tests or fewer left) over groups of whole files, the FIRST groups first and the
        others in collection order (the slow integration files, then the many quick unit
        files that even out the end)."""

        def _split_scope(self, nodeid: str) -> str:
            if nodeid.rfind("@") > nodeid.rfind("]"):  # an xdist that sets the suffix
                return nodeid.split("@")[-1]
            path = nodeid.split("::", 1)[0]
            return "ray" if uses_ray(path) else path

        def _assign_work_unit(self, node) -> None:
            for scope in reversed(FIRST):
                if scope in self.workqueue:
                    self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    # loadscope orders the groups by test count (--loadscope-reorder, on by default): the
    # many quick parametrized unit tests would go first and the slow files last
    config.option.loadscopereorder = False
    return FileGroups(config, log)
