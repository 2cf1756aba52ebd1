"""Shared helpers of the worker tests."""

from __future__ import annotations

from pathlib import Path

import onnx

from broker.config.settings import Settings
from broker.models import registry
from broker.state.store import Store
from sits_worker.device.pinning import Device
from sits_worker.device.runtime import SessionCache
from sits_worker.model.graph import static_profile
from sits_worker.serving.context import WorkerContext


def mlp_worker_context(store: Store, zoo_dir: Path, settings: Settings | None = None) -> WorkerContext:
    """A CPU worker's context (one stream) with the zoo MLP registered as 'mlp@v1'."""
    path = zoo_dir / "mlp.onnx"
    profile = static_profile(onnx.load(str(path)))
    registry.save_model_version(store, {"name": "mlp", "version": "v1", "ref": "mlp@v1", "path": str(path),
                                        "signature": profile["signature"], "static_profile": profile})
    return WorkerContext(settings=settings or Settings(), store=store, device=Device("cpu"), streams=1,
                         sessions=SessionCache(Device("cpu"), 1))
