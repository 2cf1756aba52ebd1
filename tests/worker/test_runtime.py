"""ONNX Runtime sessions as SITS builds them."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from sits_worker.devices import Device
from sits_worker.runtime import INTRA_OP_SPIN_MICROSECONDS, build_session, run_session, session_options


def test_session_options_bound_the_intra_op_spin() -> None:
    options = session_options(2)

    assert options.intra_op_num_threads == 2
    assert options.get_session_config_entry("session.intra_op.spin_duration_us") == str(INTRA_OP_SPIN_MICROSECONDS)


def test_idle_intra_op_threads_stop_spinning_soon_after_a_run(zoo_dir: Path) -> None:
    session = build_session(zoo_dir / "mlp.onnx", Device("cpu"), 2)
    features = np.ones((128, 64), np.float32)
    for _ in range(200):
        run_session(session, {"features": features})

    cpu_before = time.process_time()
    time.sleep(0.1)
    cpu_while_idle = time.process_time() - cpu_before

    # onnxruntime's default spin burns about 40 ms of a core here; what runs between batches needs it
    assert cpu_while_idle < 0.02
