"""The start-up heap frozen out of full collections (treadle/engine/gc_freeze.py)."""

from __future__ import annotations

import gc
import weakref

from treadle.engine.gc_freeze import freeze_startup_heap


def test_freezing_keeps_what_exists_out_of_collections_and_frees_startup_garbage():
    class Node:
        pass

    garbage = Node()
    garbage.self = garbage  # a cycle: only the collector frees it
    gone = weakref.ref(garbage)
    kept = Node()
    kept.self = kept
    ref = kept
    del garbage
    before = gc.get_freeze_count()
    try:
        frozen = freeze_startup_heap("a test")
        # Frozen objects that other threads free afterwards leave the count (a CI run saw
        # 6 go between the two reads), so the count now is at most what was frozen.
        assert frozen > before and before < gc.get_freeze_count() <= frozen
        assert gone() is None  # start-up garbage was collected, not frozen
        assert ref not in gc.get_objects()  # frozen: no generation holds it
        fresh = Node()
        assert fresh in gc.get_objects()  # allocated later: collected as usual
    finally:
        gc.unfreeze()
