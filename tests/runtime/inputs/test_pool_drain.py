"""`PreprocessPool.drain_s`: the predicted wait before a new job of a lane starts (the jobs
queued and running there, at the lane's recent time per job, over its workers)."""

import threading
import time

from spaceserve.runtime.inputs.pool import PreprocessPool


def test_drain_follows_the_backlog_and_the_time_per_job() -> None:
    pool = PreprocessPool(light_workers=1, heavy_workers=2)
    try:
        assert pool.drain_s("light") == 0.0 and pool.drain_s("heavy") == 0.0
        for _ in range(5):  # learn the time per job: about 20 ms
            pool.submit(lambda: time.sleep(0.02), lane="light").result()
        per_job = pool.lanes["light"].service_s
        assert 0.005 < per_job < 0.05
        gate = threading.Event()
        futs = [pool.submit(gate.wait, lane="light") for _ in range(4)]
        time.sleep(0.05)  # one runs, three wait
        assert abs(pool.drain_s("light") - 4 * per_job) < 1e-9
        assert pool.drain_s("heavy") == 0.0  # the other lane is free
        gate.set()
        for f in futs:
            f.result()
        assert pool.drain_s("light") == 0.0
    finally:
        pool.shutdown()
