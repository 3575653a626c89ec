"""Freezing start-up objects takes them out of the garbage collector's walks."""

from __future__ import annotations

import gc

from dflash_serve.startup_heap import freeze_startup_objects


class Node:
    pass


def test_objects_alive_at_the_freeze_are_no_longer_walked_and_later_ones_are():
    before = Node()
    before.cycle = before
    dropped = Node()
    dropped.cycle = dropped
    dropped_id = id(dropped)
    del dropped  # start-up garbage: collected by the freeze's own collection, not frozen
    try:
        frozen = freeze_startup_objects()
        after = Node()
        after.cycle = after
        tracked = {id(obj) for obj in gc.get_objects()}
        # A frozen object leaves the count only when it is freed (another thread's, say).
        assert 0 < gc.get_freeze_count() <= frozen
        assert id(before) not in tracked
        assert id(after) in tracked
        assert dropped_id not in tracked
    finally:
        gc.unfreeze()
    assert id(before) in {id(obj) for obj in gc.get_objects()}
