"""The `tuning` settings section: the batching controller, and the learner of CP-Score's weights."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

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


Bounds = tuple[Number, Number]


class WeightLearning(_Section):
    """The learner of CP-Score's weights (docs/tuning.md, "Weights learned from outcomes"): how often it
    tries weights, within which box, against which targets. Off (`every: 0`) by default."""

    every: Seconds = Field(0.0, ge=0, le=3600)
    """The window: how often the beat sends a step (`sits.learn_weights`, run by a releaser), crediting the
    window that ended to the weights that were live and making the next ones live; 0 turns it off."""
    alpha: Bounds = (0.1, 2.0)
    """The range α (the latency term's weight) may take."""
    beta: Bounds = (0.075, 1.5)
    """The range β (the SLA tier's weight) may take."""
    gamma: Bounds = (0.05, 1.0)
    """The range γ (the complexity term's weight) may take."""
    delta: Bounds = (0.025, 0.5)
    """The range δ (priority points a second of waiting) may take; above 0, so every class ages."""
    targets: dict[str, Seconds] = {"express": 0.05, "high": 0.25, "normal": 1.0, "low": 5.0}
    """The P99 from submit to answer each priority class is held to: a window's overshoot costs (misses
    of deadlines cost first)."""
    seed: Integer = 0
    """The learner's random draws come from it: a run is repeatable."""
    windows_per_trial: Integer = Field(2, ge=2, le=20)
    """Windows each of the incumbent and the candidate runs in a trial; at least 2, for the spread between a
    side's windows is what tells a difference from chance."""
    margin: Number = Field(0.05, ge=0, lt=1)
    """By how much (a share) a candidate's cost must beat the incumbent's to replace it."""

    @field_validator("alpha", "beta", "gamma", "delta")
    @classmethod
    def _ordered(cls, value: Bounds) -> Bounds:
        if not 0 <= value[0] <= value[1]:
            raise ValueError(f"{list(value)} is not [low, high] with 0 <= low <= high")
        return value

    @model_validator(mode="after")
    def _known_classes(self) -> WeightLearning:
        unknown = set(self.targets) - {"express", "high", "normal", "low"}
        if unknown:
            raise ValueError(f"targets names unknown priority classes {sorted(unknown)}: use express, high, normal "
                             "or low")
        return self


class TuningSettings(_Section):
    """Self-tuning: tuning sweeps, the batching controller and the weight learner."""

    api_url: str = Field("", max_length=2048)
    """Where a tuning sweep's clients send their requests, as the releaser's host reaches the API; empty: the
    URL `sitsctl up` recorded in `paths.home`, else `api.host`:`api.port`. Never taken from a request (its
    Host header is the client's to write)."""
    tenant_sweep_seconds: Seconds = Field(7200.0, ge=0)
    """Most seconds of tuning sweeps one tenant's keys may plan in a UTC day (admin keys are not held to it;
    0: no limit). The releasers run one sweep at a time for every tenant, so without it one tenant's
    back-to-back hour-long sweeps would keep the others' from ever starting."""
    controller: BatchingControl = BatchingControl()
    weights: WeightLearning = WeightLearning()
