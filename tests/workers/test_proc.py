"""The worker process's start-up (workers/proc.py), the parts that run without sockets."""

import gc

from tidal.workers.proc import _freeze_imported_heap


def test_the_imports_objects_are_frozen_and_collection_is_back_on():
    """`main` turns the collector off before torch's import; once the imports are done their
    objects move to the permanent generation (never walked again by a full pass) and
    collection resumes for everything made after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        _freeze_imported_heap()
        assert gc.isenabled()
        assert gc.get_freeze_count() > 10_000  # this test process's imports, torch's among them
    finally:
        gc.unfreeze()
        (gc.enable if was_enabled else gc.disable)()
