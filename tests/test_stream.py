"""Streaming consumption (trainer.stream_slack, scheduling/stream.py): a step takes the first groups
to finish from any batch, never a group past its deadline.

The order on its own (torch-free, a discrete-event simulation of dispatch, long-tailed generation
and training with random durations): every group trained exactly once, each within eta versions of
its batch's dispatch version, no step waiting for nothing; with slack a step does take later
batches' groups. (Slack 0 does not use this order: the producer's batch-bound path.) Then the producer and trainer end to end (tests/test_async.py
style): the bound, every prompt once, a straggler that no longer holds its step, a killed worker
and a resume that lose and repeat nothing.
"""
import heapq
import random
from dataclasses import dataclass

import pytest

from periodic_async.scheduling.staleness import StalenessRule
from periodic_async.scheduling.stream import StreamOrder


@dataclass
class _G:
    group_index: int


def simulate(batch_size, eta, slack, steps, seed, train_s=1.0):
    """Dispatch by the staleness rule, groups finishing after random long-tailed times, a trainer
    taking groups through StreamOrder. Returns [(step, batch, group index, dispatch version)]."""
    rng = random.Random(seed)
    rule = StalenessRule(eta, slack)
    order = StreamOrder(batch_size, eta)
    events, trained, version_at = [], [], {}
    now, version, next_batch = 0.0, 0, 1

    def dispatch():
        nonlocal next_batch
        while next_batch <= steps and rule.may_dispatch(next_batch, version):
            order.add_batch(next_batch, batch_size, version)
            version_at[next_batch] = version
            for g in range(batch_size):
                dur = rng.paretovariate(1.5) * rng.choice([0.3, 1.0, 3.0])
                heapq.heappush(events, (now + dur, next_batch, g))
            next_batch += 1

    dispatch()
    for step in range(1, steps + 1):
        for k in range(batch_size):
            while True:
                got = order.take(step, k)
                if got is not None:
                    break
                assert events, f"step {step} waits with nothing generating"
                now, b, g = heapq.heappop(events)
                order.add_ready(b, _G(g))
            b, g = got
            trained.append((step, b, g.group_index, version_at[b]))
            if order.done(b):
                order.forget(b)
        now += train_s * rng.uniform(0.2, 2.0)
        version = step           # the new weights reach the workers
        dispatch()
    return trained


CASES = [(B, eta, slack) for B in (1, 2, 4) for eta in (0, 1, 2, 4) for slack in range(eta + 1)]


@pytest.mark.parametrize("batch_size, eta, slack", CASES)
def test_every_group_once_within_the_bound(batch_size, eta, slack):
    steps = 12
    for seed in range(15):
        trained = simulate(batch_size, eta, slack, steps, seed)
        assert sorted((b, g) for _, b, g, _ in trained) == [(b, g) for b in range(1, steps + 1)
                                                          for g in range(batch_size)]
        for step, _, _, v in trained:
            assert 0 <= (step - 1) - v <= eta, (seed, step, v)


def test_slack_lets_a_step_take_later_batches_groups():
    """eta 4, slack 2: stragglers no longer hold their step, so some step takes a group of a later
    batch, and some group is trained after its own batch's step."""
    ahead = behind = 0
    for seed in range(10):
        for step, b, _, _ in simulate(4, 4, 2, 12, seed):
            ahead += b > step
            behind += b < step
    assert ahead > 0 and behind > 0


def test_a_hand_example():
    """B 2, eta 2, slack 1: batches 1 and 2 dispatched at version 0 (deadlines 3). Step 1 takes
    batch 2's finished groups before batch 1's, which are still generating; step 2 must then take
    batch 3's finished groups (batch 1's two still fit step 3), and step 3 waits for batch 1's rather
    than take batch 4's finished group, which would leave one of them past its deadline."""
    order = StreamOrder(2, 2)
    order.add_batch(1, 2, 0)
    order.add_batch(2, 2, 0)
    assert order.take(1, 0) is None
    order.add_ready(2, _G(0))
    order.add_ready(2, _G(1))
    assert order.take(1, 0)[0] == 2 and order.take(1, 1)[0] == 2
    order.forget(2)
    order.add_batch(3, 2, 1)        # dispatched at version 1: deadline 4
    order.add_ready(3, _G(0))
    # step 2: pending due by 3 is batch 1's 2 groups; steps 2..3 can train 4: batch 3's group fits
    assert order.take(2, 0)[0] == 3
    order.add_ready(3, _G(1))
    # k = 1: due by step 3 is 2 <= (3 - 2 + 1) * 2 - 1 - 1 = 2: still feasible
    assert order.take(2, 1)[0] == 3
    # step 3 must take batch 1's two groups: nothing else is feasible, and they are not ready
    order.add_batch(4, 2, 2)
    order.add_ready(4, _G(0))
    assert order.take(3, 0) is None
    order.add_ready(1, _G(1))
    assert order.take(3, 0) == (1, _G(1))
    order.add_ready(1, _G(0))
    assert order.take(3, 1) == (1, _G(0))


def test_a_group_past_its_deadline_raises():
    order = StreamOrder(2, 1)
    order.add_batch(1, 2, 0)        # deadline 2
    with pytest.raises(RuntimeError, match="past their deadline 2"):
        order.take(3, 0)


# ---------------------------------------------------------------------- the producer and trainer
from helpers import kill_worker_after_publish, stop_after_step  # noqa: E402
from test_async import ASYNC, _record_prompts  # noqa: E402
from test_periodic import _run  # noqa: E402

STREAM = (*ASYNC, "trainer.stream_slack=1", "rollout.arrival_jitter_s=0.05")


def hold_back_a_straggler(trainer, batch=2, group=0):
    """Batch `batch`'s group `group` becomes a straggler: its responses reach the producer only
    once every response of batch `batch + 1` has."""
    from periodic_async.scheduling.producer import _STEP_STRIDE
    pool = trainer.producer.pool
    poll, held, later = pool.poll, [], []

    def holding_poll(timeout):
        results = poll(timeout)
        if held is None:
            return results
        later.extend(r for r in results if r.group_index // _STEP_STRIDE == batch + 1)
        keep = []
        for r in results:
            (held if divmod(r.group_index, _STEP_STRIDE) == (batch, group) else keep).append(r)
        if len(later) == 8 * 4:
            keep += held
            held.clear()
            held_done[0] = True
        return keep
    held_done = [False]
    pool.poll = holding_poll
    return held_done


@pytest.fixture(scope="module")
def stream_run(tmp_path_factory):
    seen, straggler = [], {}

    def hook(trainer):
        _record_prompts(trainer, seen)
        straggler["released"] = hold_back_a_straggler(trainer)
    _, history, _ = _run(tmp_path_factory.mktemp("stream"), "async", *STREAM, hook=hook)
    assert straggler["released"][0]
    return history, seen


@pytest.fixture(scope="module")
def periodic_prompts(tmp_path_factory):
    seen = []
    _run(tmp_path_factory.mktemp("periodic"), "periodic", "trainer.total_steps=6",
         hook=lambda t: _record_prompts(t, seen))
    return sorted(p for _, p in seen)


def test_streaming_keeps_the_bound_and_trains_every_prompt_once(stream_run, periodic_prompts):
    """eta 2, slack 1, 2 workers with jittered arrival: every step trains B = 8 full groups within
    eta versions, and the run trains exactly the prompts of the periodic schedule's 6 batches,
    each once, whichever step took them."""
    history, seen = stream_run
    assert len(history) == 6
    assert all(h["rollout/generated"] == 8 * 4 for h in history)
    assert max(h["training/off_policy/trajectory_staleness/max"] for h in history) <= 2
    assert [s for s, _ in seen] == [s for s in range(1, 7) for _ in range(8)]
    assert sorted(p for _, p in seen) == periodic_prompts
    for h in history:       # a group comes from at most slack steps before or lookahead after
        assert -1 <= h["stream/batch_offset/min"] <= h["stream/batch_offset/max"] <= 1
    # batch 2's straggler did not hold step 2: it took a group of batch 3, and step 3 the straggler
    assert history[1]["stream/batch_offset/max"] == 1 and history[1]["stream/other_batch_ratio"] > 0
    assert history[2]["stream/batch_offset/min"] == -1


def test_a_resumed_streaming_run_loses_and_repeats_no_prompt(periodic_prompts, tmp_path):
    """Batch 2's straggler lets step 2 take a group of batch 3; stopped after step 2 (the
    straggler untrained, batch 3 partly taken) and resumed: the checkpoint hands exactly the
    untrained prompts to the resumed run, so the two runs together train the periodic schedule's
    prompts, each once (a checkpoint of the loader before batch 3 would lose the straggler and
    repeat the group step 2 took)."""
    from periodic_async.train.stop import STOP
    first = []

    def stop_after_2(trainer):
        _record_prompts(trainer, first)
        hold_back_a_straggler(trainer)
        stop_after_step(trainer, 2)
    try:
        with pytest.raises(KeyboardInterrupt, match="stopped after step 2"):
            _run(tmp_path, "async", *STREAM, "trainer.save_every=0", hook=stop_after_2)
    finally:
        STOP.requested = False
    second = []
    _, history, _ = _run(tmp_path, "async", *STREAM, hook=lambda t: _record_prompts(t, second))
    assert len(history) == 4 and len(first) == 16
    assert sorted(p for _, p in first + second) == periodic_prompts


def test_a_worker_killed_mid_stream_loses_nothing(periodic_prompts, tmp_path):
    """Worker 0 SIGKILLed right after version 2 is published, while batches run ahead: it is
    restarted, its owed samples re-dispatched, and the run still trains every prompt of the
    periodic schedule once, within the bound."""
    killed, seen = {}, []

    def hook(trainer):
        _record_prompts(trainer, seen)
        kill_worker_after_publish(killed, version=2, worker=0)(trainer)
    _, history, _ = _run(tmp_path, "async", *STREAM, "rollout.worker_timeout_s=30", hook=hook)
    assert killed, "the hook never ran"
    assert history[-1]["rollouter/restarts"] == 1
    assert all(h["rollout/generated"] == 32 and h["training/off_policy/trajectory_staleness/max"] <= 2
               for h in history)
    assert sorted(p for _, p in seen) == periodic_prompts


@pytest.mark.parametrize("overrides, message", [
    (["trainer.stream_slack=1"], "trainer.stream_slack: 1 needs trainer.mode async"),
    (["trainer.mode=async", "trainer.max_staleness=1", "trainer.stream_slack=2"],
     "trainer.stream_slack: 2 exceeds trainer.max_staleness 1"),
    (["trainer.mode=async", "trainer.max_staleness=2", "trainer.stream_slack=1", "rollout.group_sizing=sagc"],
     "trainer.stream_slack: streaming needs rollout.group_sizing fixed"),
    (["trainer.mode=async", "trainer.max_staleness=2", "trainer.stream_slack=1", "rollout.selection=backfill"],
     "trainer.stream_slack: streaming is not supported with rollout.selection 'backfill'"),
])
def test_streaming_configuration_errors_name_the_key(overrides, message):
    from periodic_async.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=message):
        load_config("configs/default.yaml", overrides).validate(world_size=1)
