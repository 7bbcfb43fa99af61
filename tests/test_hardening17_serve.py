"""Session 43, from the list earlier sessions noticed and left alone: JSON `true`/`false`
among an FP32 input's numbers was taken as 1.0/0.0 (numpy's asarray of [0.5, true]), where
Triton refuses a boolean in a numeric tensor."""

from __future__ import annotations

import numpy as np
import pytest

from leanrnn.serve.errors import InvalidRequest
from leanrnn.serve.protocol import ModelInfo, Tensor, from_list

INFO = ModelInfo("m", "FP32", np.dtype(np.float32), {"x": Tensor("x", (-1, 2))},
                 {"y": Tensor("y", (-1, 3))}, 1.0, 8, "lstm")  # fmt: skip


@pytest.mark.parametrize("data", [[0.5, True], [[0.5, 1.0], [False, 2.0]], [[1, 2], [3, True]],
                                  [[[0.5, 1.5]], [[2.5, True]]]])  # fmt: skip
def test_json_booleans_are_not_numbers(data):
    shape = np.asarray(data, dtype=np.float64).shape
    with pytest.raises(InvalidRequest, match="list of numbers"):
        from_list(INFO, "x", shape, data)


def test_json_numbers_still_parse():
    data = [[0.5, 1], [2, -3.25]]
    np.testing.assert_array_equal(from_list(INFO, "x", (2, 2), data),
                                  np.array(data, np.float32))  # fmt: skip


def test_a_scheduler_dropped_without_stop_ends_its_thread():
    """Its thread held it (a bound method as the target): one dropped without stop() kept
    its thread, models and pool for the life of the process."""
    import gc
    import threading
    import time
    import weakref

    import leanrnn
    from leanrnn.engine.session import Pool
    from leanrnn.serve.scheduler import Lane, Scheduler

    m = leanrnn.GRU(4, 8, seed=0)
    lane = Lane("m", m, Pool(), threads=1, max_streams=4, max_batch=4, max_chunk=4,
                idle_timeout=0.2)  # fmt: skip
    s = Scheduler({"m": lane}, max_wait=0.0)
    s.start()
    thread = s._thread
    done = []
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    s.submit("m", 1, True, True, x, on_done=done.append)
    deadline = time.monotonic() + 10
    while not done and time.monotonic() < deadline:
        time.sleep(0.01)
    assert done and done[0].error is None
    np.testing.assert_allclose(done[0].y, m(x[:, None])[0][:, 0], atol=1e-6, rtol=0)
    ref = weakref.ref(s)
    del s, done, lane
    gc.collect()
    thread.join(timeout=5)
    assert ref() is None and not thread.is_alive()
    assert threading.active_count() < 50  # (nothing else piled up meanwhile)
