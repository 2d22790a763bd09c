"""freeze_loaded_objects: what initialize loaded leaves the collector's generations; garbage does not."""

import gc
import weakref

from python_backends.shim import freeze_loaded_objects


class _Node:
    pass


def test_loaded_objects_are_frozen_and_cycles_left_by_loading_are_collected_first():
    gc.unfreeze()
    kept = [_Node() for _ in range(1000)]  # what a model keeps after initialize
    cycle = _Node()
    cycle.self = cycle  # garbage loading left behind: a cycle only the collector frees
    dead = weakref.ref(cycle)
    del cycle
    try:
        frozen = freeze_loaded_objects()
        assert dead() is None, "the garbage was frozen instead of collected"
        # The count only falls after the freeze: another thread of this process (a client's pool
        # left by an earlier test) may free frozen objects in between (two did in CI).
        assert frozen >= len(kept) and 0 < gc.get_freeze_count() <= frozen
        # A full collection now walks only what was allocated since: not the kept objects.
        tracked = len(gc.get_objects())
        assert tracked < frozen
        assert all(gc.is_tracked(k) for k in kept[:3])
        # Objects made after the freeze are collected as before.
        later = _Node()
        later.self = later
        ref = weakref.ref(later)
        del later
        gc.collect()
        assert ref() is None
    finally:
        gc.unfreeze()
