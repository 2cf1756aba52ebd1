"""The tuned front, the pick under a P99 bound, the quick search's neighbours and the default space."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from broker.tuning.front import Point, Setting, Space, choose, default_space, pareto_front, quick_neighbours


def point(throughput: float, p99: float, *, batch: int = 1, refused: int = 0, answered: int = 10) -> Point:
    return Point(Setting(batch, 0.0, 1), 8, answered, 1.0, throughput, p99 / 2, p99, refused)


points = st.lists(st.builds(point, st.floats(0, 1e4), st.floats(0.1, 1e4), batch=st.sampled_from([1, 2, 4])),
                  max_size=30)


@given(points)
def test_no_point_beats_a_front_point_on_both_figures(found: list[Point]) -> None:
    front = pareto_front(found)
    for kept in front:
        assert not any(p.throughput > kept.throughput and p.p99_ms < kept.p99_ms for p in found)
    for p in found:  # and every point is matched or beaten by one on the front
        assert any(f.throughput >= p.throughput and f.p99_ms <= p.p99_ms for f in front)


@given(points, st.floats(0.1, 1e4))
def test_the_pick_is_the_most_throughput_within_the_bound(found: list[Point], bound: float) -> None:
    chosen = choose(found, bound)
    within = [p for p in found if p.p99_ms <= bound]
    assert (chosen is None) == (not within)
    if chosen is not None:
        assert chosen.p99_ms <= bound and chosen.throughput == max(p.throughput for p in within)


def test_a_point_with_refusals_or_no_answers_is_never_picked() -> None:
    assert choose([point(900, 10, refused=1), point(5, 10, answered=0)], 100) is None
    assert choose([point(900, 10, refused=1), point(100, 50)], 100) == point(100, 50)


def test_neighbours_are_one_step_along_one_knob() -> None:
    space = Space((1, 4, 16), (0.0, 0.002), (1, 2))
    found = quick_neighbours(space, Setting(4, 0.0, 1))
    assert set(found) == {Setting(1, 0.0, 1), Setting(16, 0.0, 1), Setting(4, 0.002, 1), Setting(4, 0.0, 2)}
    assert set(quick_neighbours(space, space.start())) == {Setting(4, 0.0, 1), Setting(1, 0.002, 1), Setting(1, 0.0, 2)}


def test_the_default_space_keeps_batches_whose_run_fits_half_the_bound() -> None:
    profile = [{"batch_size": b, "latency_ms": b * 1.0, "p99_ms": b * 1.5} for b in (1, 2, 4, 8, 16, 32, 64, 128)]
    space = default_space(profile, p99_bound_ms=100, max_streams=4)
    assert space.batch_sizes[0] == 1 and max(space.batch_sizes) == 32 and len(space.batch_sizes) <= 5
    assert space.delays == (0.0, 0.0025, 0.01) and space.streams == (1, 4)
    assert default_space([], p99_bound_ms=100, max_streams=1).batch_sizes == (1, 4, 16, 64)
