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


def test_tail_is_from_the_median_end_to_the_last():
    """rollouter/tail_s: from when half the step's responses had finished to the last one."""
    from periodic_async.rollout.base import RolloutResult
    from periodic_async.scheduling.producer import RolloutStats
    from periodic_async.telemetry.step_metrics import rollout_metrics
    ends = [3.0, 1.0, 2.0, 9.0, 4.0]        # sorted 1 2 3 4 9: the 3rd of 5 ends at 3.0
    stats = RolloutStats(results=[RolloutResult(0, k, [1], [2], [0.0], "stop", 0, timings={"start": 0.0, "end": e})
                                  for k, e in enumerate(ends)])
    assert rollout_metrics([], stats, 10.0, 1, 0)["rollouter/tail_s"] == 9.0 - 3.0
    stats.results = [r for r in stats.results if r.timings["end"] < 9]    # 1 2 3 4: half finished at 2.0
    assert rollout_metrics([], stats, 10.0, 1, 0)["rollouter/tail_s"] == 4.0 - 2.0
    assert "rollouter/tail_s" not in rollout_metrics([], RolloutStats(), 10.0, 1, 0)
