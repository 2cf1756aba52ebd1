"""The `tuning` settings section: how the batching controller steers the models that ask for it."""

from __future__ import annotations

from pydantic import Field

from broker.setting_types import Integer, Number, Seconds
from broker.setting_types import Section as _Section


class BatchingControl(_Section):
    """The batching controller (docs/tuning.md, "Closed-loop batching"): its window and its hysteresis.
    A model is steered when its batching says `closed_loop: true`, toward its `target_p99`."""

    every: Seconds = Field(2.0, ge=0, le=600)
    """The window: how often the beat sends a step (`sits.steer_batching`, run by a releaser), over the
    requests answered since the last; 0 turns the controller off."""
    patience: Integer = Field(2, ge=1, le=100)
    """Windows in a row that must point the same way before a knob moves."""
    cooldown: Seconds = Field(6.0, ge=0, le=3600)
    """Least time between two moves of one model's knobs: the fleet shows one move's effect first."""
    low_water: Number = Field(0.6, gt=0, lt=1)
    """A P99 under this share of the target is room to spare; between it and the target nothing moves."""
    min_answered: Integer = Field(20, ge=1)
    """Fewer answers in a window say nothing of its P99."""
    memory: Seconds = Field(600.0, ge=0)
    """How long a value left because P99 passed the target is barred to moves made for room to spare."""


class TuningSettings(_Section):
    """Self-tuning: the batching controller."""

    controller: BatchingControl = BatchingControl()
