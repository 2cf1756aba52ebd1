"""The `sla` settings section: deadline ordering and admission, per model."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from broker.setting_types import Number, Seconds
from broker.setting_types import Section as _Section

Admission = Literal["reject", "flag", "off"]


class ModelSla(_Section):
    """One model's deadline settings (`sla.models.<name>`); a key it leaves out is `sla`'s."""

    admission: Admission | None = None


class SlaSettings(_Section):
    """Deadlines on offline jobs: how they are ordered and whether one that cannot be met is refused."""

    admission: Admission = "reject"
    """At submit, a job with a deadline is checked against its predicted finish (`broker/sla/admission.py`):
    `reject` refuses one that cannot finish in time, or that would make an accepted job miss its own
    deadline (422, `deadline_infeasible`); `flag` accepts it with `at_risk: true`; `off` never checks."""
    admission_margin: Number = Field(0.1, ge=0, le=10)
    """Share of the predicted time kept in hand: with 0.1 a job predicted to need 100 s is accepted only
    with a deadline at least 110 s away."""
    admission_margin_floor: Seconds = Field(0.25, ge=0)
    """The least time kept in hand, however short the job: its fixed costs (the submit, the first lease, a
    chunk's start, the final merge) vary by a few hundred milliseconds on a loaded host, which a share of
    a one-second prediction does not cover."""
    deadline_horizon: Seconds = Field(300.0, ge=0)
    """A job with a deadline waits as if it had arrived this long before it (or when it came, if that is
    earlier): deadlines within the horizon are served earliest first and gain up to δ·horizon priority
    points as they near (30 at the defaults)."""
    models: dict[str, ModelSla] = {}
    """Per-model overrides, by model name."""

    def admission_for(self, model_name: str) -> Admission:
        """The admission mode of `model_name`'s jobs."""
        entry = self.models.get(model_name)
        return entry.admission if entry is not None and entry.admission is not None else self.admission
