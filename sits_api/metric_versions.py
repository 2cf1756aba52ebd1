"""Which model versions keep a `version` label of their own on /metrics, and the sums of the others.

Versions are never deleted, and a tenant may register hundreds of one name: each would add some 280 series
(histograms by priority class and phase) to every scrape. So the per-version histograms and summaries show a
name's `VERSIONS_SHOWN` newest versions alone, and sum the older ones under `OTHER_VERSION`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from broker.models.model_record import ModelRecord
from broker.monitoring.histograms import summed
from broker.monitoring.sla_metrics import Histogram
from broker.monitoring.stats import SystemStats
from broker.state.store import Store, translate_redis_errors


def model_labels(model_ref: str) -> list[str]:
    """The (model, version) label values of a model ref ('name@version'; a bare name has version '')."""
    name, _, version = model_ref.rpartition("@")
    return [name, version] if name else [model_ref, ""]


VERSIONS_SHOWN = 3
"""Versions of a model name whose histograms and summaries keep their own `version` label: its newest.
Older versions' figures are summed under `OTHER_VERSION`. Versions are never deleted and a tenant may
register hundreds (`max_model_versions`), each adding some 280 series to every scrape; three keep the
version serving, the one before it and one being rolled out apart."""

OTHER_VERSION = "other"
"""The `version` label of a name's versions older than its `VERSIONS_SHOWN` newest. No version is
called so: versions are content hashes or a repository's numbers."""


def shown_versions(store: Store, stats: SystemStats) -> dict[str, str]:
    """Model ref -> the `version` label of its histograms and summaries: its own for its name's
    `VERSIONS_SHOWN` newest versions with figures, `OTHER_VERSION` for the older ones. Newest is the name's
    latest, then by registration as `registry.list_model_versions` orders them. A name with few versions
    costs no read; the records of the others' versions are read in one round trip."""
    refs = {*stats.model_stats, *(key[0] for key in stats.histograms), *(key[0] for key in stats.batch_sizes)}
    by_name: dict[str, list[str]] = {}
    for ref in refs:
        by_name.setdefault(model_labels(ref)[0], []).append(ref)
    registered = _registration_times(store, sorted(
        ref for named in by_name.values() if len(named) > VERSIONS_SHOWN for ref in named))
    shown = {}
    for name, named in by_name.items():
        for rank, ref in enumerate(_newest_first(named, stats.latest_versions.get(name), registered)):
            shown[ref] = model_labels(ref)[1] if rank < VERSIONS_SHOWN else OTHER_VERSION
    return shown


def _newest_first(refs: list[str], latest: str | None, registered: Mapping[str, float]) -> list[str]:
    """The `refs` of one name, newest first: its `latest` version, then by registration time, then by
    version (a repository's versions loaded at once are numbered)."""
    def newness(ref: str) -> tuple[bool, float, str]:
        version = model_labels(ref)[1]
        return version == latest, registered.get(ref, 0.0), version.zfill(20)

    return sorted(refs, key=newness, reverse=True)


def _registration_times(store: Store, refs: list[str]) -> dict[str, float]:
    """Model ref -> when its version was registered (left out: a version with no record), in one round trip."""
    if not refs:
        return {}
    with translate_redis_errors():
        raws = store.client.hmget(store.keys.model_versions, refs)
    return {ref: ModelRecord.of(json.loads(raw)).registered_at or 0.0
            for ref, raw in zip(refs, raws, strict=True) if raw}


def summed_by_shown_version(figures: Iterable[tuple[tuple[str, ...], Histogram]],
                             shown: Mapping[str, str]) -> list[tuple[tuple[str, ...], Histogram]]:
    """Histograms keyed (model ref, ...) as ((name, shown version, ...), histogram), sorted: those of a
    name's versions shown as `OTHER_VERSION` summed into one (`shown_versions`)."""
    grouped: dict[tuple[str, ...], list[Histogram]] = {}
    for (model_ref, *rest), histogram in figures:
        grouped.setdefault((model_labels(model_ref)[0], shown[model_ref], *rest), []).append(histogram)
    return [(labels, summed(found)) for labels, found in sorted(grouped.items())]
