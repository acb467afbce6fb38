"""Step metrics from intervals and groups, against hand-computed values."""
import pytest

from periodic_async.telemetry.step_metrics import overlap_metrics, union_length


def test_union_length():
    assert union_length([]) == 0.0
    assert union_length([(0, 2), (1, 3), (5, 6)]) == 4.0
    assert union_length([(5, 6), (0, 1), (0.5, 0.75)]) == 2.0


def test_overlap_is_the_generation_time_covered_by_training():
    # generation 0..10; training 8..9 and 9.5..12 (of which 9.5..10 inside): overlap 1.5 s;
    # training in all 3.5 s, the shorter stage
    m = overlap_metrics((0.0, 10.0), [(8.0, 9.0), (9.5, 12.0)])
    assert m["perf/overlap_s"] == pytest.approx(1.5)
    assert m["perf/overlap_ratio"] == pytest.approx(1.5 / 3.5)
    # training after generation (sync, sync_split): no overlap, however long the optimizer runs
    assert overlap_metrics((0.0, 10.0), [(10.0, 30.0)]) == {"perf/overlap_s": 0.0, "perf/overlap_ratio": 0.0}
    assert overlap_metrics((0.0, 10.0), []) == {"perf/overlap_s": 0.0, "perf/overlap_ratio": 0.0}
