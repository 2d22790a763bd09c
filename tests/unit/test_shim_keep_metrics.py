"""python_backends.shim.keep_metrics: the objects it is given are never deleted (their destructors
would crash the python backend stub or corrupt the server's shared metric series)."""

import gc

from python_backends.shim import keep_metrics


class Tracked:
    deleted = 0

    def __del__(self):
        Tracked.deleted += 1


def test_kept_objects_outlive_every_reference_and_a_collection():
    kept, dropped = Tracked(), Tracked()
    keep_metrics(kept, None)  # None (a metric never made) is skipped
    del kept, dropped
    gc.collect()
    assert Tracked.deleted == 1  # only the one not kept
