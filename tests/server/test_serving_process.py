"""What the serving process sets up for itself: the interpreter tuned once the engine is
loaded (`tune_interpreter`), and request ids made without a system call (`new_id`)."""

import gc
import re
import sys

from spaceserve.server.engine_load import SWITCH_INTERVAL_S, tune_interpreter
from spaceserve.server.transport.guard import new_id


def test_tune_interpreter_freezes_startup_objects_and_shortens_the_switch_interval() -> None:
    before = sys.getswitchinterval()
    try:
        tune_interpreter()
        assert gc.get_freeze_count() > 1000  # the imported modules' objects, at least
        assert sys.getswitchinterval() == SWITCH_INTERVAL_S == 0.001
    finally:
        gc.unfreeze()
        sys.setswitchinterval(before)


def test_new_ids_are_fresh_hex_after_their_prefix() -> None:
    ids = [new_id("chatcmpl-") for _ in range(10_000)] + [new_id("req-", 16)]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"chatcmpl-[0-9a-f]{32}", i) for i in ids[:-1])
    assert re.fullmatch(r"req-[0-9a-f]{16}", ids[-1])
