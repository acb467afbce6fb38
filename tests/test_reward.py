"""GSM8K scoring with math-verify, reward-fn resolution, and the RewardManager's worker handling:
errors and timeouts score 0 without stopping the batch, killed workers are replaced, close() leaves
no process behind."""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest

from periodic_async.config import DataConfig, RewardConfig
from periodic_async.data.dataset import load_records
from periodic_async.reward.gsm8k import compute_score, extract_final_answer
from periodic_async.reward.manager import (RewardBatch, RewardFnError, RewardManager, RewardWorkerError,
                                           load_reward_fn, resolve_reward_fn)

CUSTOM_REWARD = '''
import os, time

def compute_score(response, answer):
    if response == "raise":
        raise ValueError("boom from the reward fn")
    if response == "sleep":
        time.sleep(30)
    if response == "slow":
        time.sleep(0.4)
        return 0.5
    if response == "nan":
        return float("nan")
    if response == "text":
        return "1.0"
    if response == "inf":
        return float("-inf")
    if response == "none":
        return None
    if response == "die":
        os._exit(3)
    return 1.0 if response == answer else 0.25

not_callable = 3
'''


@pytest.fixture
def reward_file(tmp_path: Path) -> str:
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM_REWARD)
    return str(path)


def _custom(path: str, **kw: object) -> RewardConfig:
    return RewardConfig(name="custom", custom_file=path, **kw)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ---------------------------------------------------------------- gsm8k scoring

@pytest.fixture(scope="module")
def gsm8k_records() -> list:
    return load_records(DataConfig(source="gsm8k"))


def test_gsm8k_correct_and_wrong_on_shipped_rows(gsm8k_records: list) -> None:
    for rec in gsm8k_records[:20]:
        gold = rec.answer
        assert compute_score(f"Some reasoning with 3 and 4.\n#### {gold}", gold) == 1.0
        assert compute_score(f"Some reasoning with {gold}.\n#### {int(gold) + 1}", gold) == 0.0


@pytest.mark.parametrize("response, score", [
    ("48/2 = 24 in May, 48+24 = 72.\n#### 72", 1.0),
    ("#### 71", 0.0),
    ("So the total is \\boxed{72}.", 1.0),
    ("the answer is 72.", 1.0),
    ("#### 72.0", 1.0),
    ("72.0", 1.0),
    ("#### $72", 1.0),
    ("I first thought 72 but\n#### 70", 0.0),  # the marker wins over earlier numbers
    ("\\boxed{70} and later 72", 0.0),        # \boxed wins over the last number
    ("no number at all", 0.0),
    ("####", 0.0),
])
def test_gsm8k_answer_forms_for_first_row(gsm8k_records: list, response: str, score: float) -> None:
    assert gsm8k_records[0].answer == "72"
    assert compute_score(response, gsm8k_records[0].answer) == score


def test_gsm8k_thousands_and_raw_gold_field() -> None:
    assert compute_score("#### 1,000", "1000") == 1.0
    assert compute_score("The cost is $1,250 in total.", "1250") == 1.0
    assert compute_score("#### 10", "Weng earns 12/60 = $0.2 per minute.\n#### 10") == 1.0


def test_extract_final_answer() -> None:
    assert extract_final_answer("x #### 5 \n trailing text 9") == "5"
    assert extract_final_answer("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert extract_final_answer("-3 then 4.5") == "4.5"
    assert extract_final_answer("nothing") == ""


def test_gsm8k_scoring_works_off_the_main_thread() -> None:
    """math-verify's SIGALRM timeouts would raise in a thread; they must be disabled."""
    result: list[float] = []
    thread = threading.Thread(target=lambda: result.append(compute_score("#### 72", "72")))
    thread.start()
    thread.join()
    assert result == [1.0]


# ---------------------------------------------------------------- resolving and loading

def test_resolve_reward_fn() -> None:
    assert resolve_reward_fn(RewardConfig(name="synthetic")) == ("periodic_async.reward.synthetic", "compute_score")
    assert resolve_reward_fn(RewardConfig(name="gsm8k")) == ("periodic_async.reward.gsm8k", "compute_score")
    assert resolve_reward_fn(_custom("r.py", custom_fn="f")) == ("r.py", "f")
    with pytest.raises(RewardFnError, match="reward.custom_file: required"):
        resolve_reward_fn(RewardConfig(name="custom"))


def test_load_reward_fn_errors_name_file_and_function(reward_file: str, tmp_path: Path) -> None:
    assert load_reward_fn((reward_file, "compute_score"))("a", "a") == 1.0
    with pytest.raises(RewardFnError, match=r"missing_reward\.py does not exist"):
        load_reward_fn((str(tmp_path / "missing_reward.py"), "compute_score"))
    with pytest.raises(RewardFnError, match=r"my_reward\.py: has no callable 'score_it'"):
        load_reward_fn((reward_file, "score_it"))
    with pytest.raises(RewardFnError, match=r"my_reward\.py: has no callable 'not_callable' \(found a int\)"):
        load_reward_fn((reward_file, "not_callable"))
    with pytest.raises(RewardFnError, match="no_such_module_xyz cannot be imported"):
        load_reward_fn(("no_such_module_xyz", "compute_score"))


def test_manager_with_bad_custom_file_fails_at_construction(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing_reward.py")
    with pytest.raises(RewardFnError, match=r"missing_reward\.py does not exist"):
        RewardManager(_custom(missing, num_workers=1))


# ---------------------------------------------------------------- manager, inline

def test_inline_manager_scores_and_counts_errors(reward_file: str, caplog: pytest.LogCaptureFixture) -> None:
    """Raising counts as an error; a non-number, NaN or an infinity as invalid; all score 0.0, and
    nothing is logged per item (the trainer logs one line per step)."""
    with RewardManager(_custom(reward_file, num_workers=0)) as manager:
        assert manager.worker_pids == []
        with caplog.at_level(logging.DEBUG, logger="periodic_async.reward.manager"):
            batch = manager.score([("a", "a"), ("raise", "x"), ("b", "c"), ("nan", "x"), ("text", "x"),
                                   ("inf", "x"), ("none", "x")])
    assert batch == RewardBatch(scores=[1.0, 0.0, 0.25, 0.0, 0.0, 0.0, 0.0], num_errors=1, num_invalid=4)
    assert batch.first_error == "ValueError: boom from the reward fn"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    debug = caplog.text   # each item's cause is kept at debug level
    assert "reward item 3: reward fn returned a non-finite value nan" in debug
    assert "reward item 4: reward fn returned str '1.0', expected a number" in debug
    assert "reward item 5: reward fn returned a non-finite value -inf" in debug
    assert "reward item 6: reward fn returned NoneType None, expected a number" in debug


# ---------------------------------------------------------------- manager, workers

def test_workers_survive_errors_and_timeouts(reward_file: str, caplog: pytest.LogCaptureFixture) -> None:
    manager = RewardManager(_custom(reward_file, num_workers=2, timeout_s=1.0))
    try:
        pids_before = manager.worker_pids
        items = [("a", "a"), ("raise", "x"), ("sleep", "x"), ("b", "c"), ("c", "c"), ("nan", "x")]
        start = time.monotonic()
        with caplog.at_level(logging.DEBUG, logger="periodic_async.reward.manager"):
            batch = manager.score(items)
        elapsed = time.monotonic() - start
        assert elapsed < 15, f"a 30 s reward fn held the batch for {elapsed:.1f} s"
        assert batch == RewardBatch(scores=[1.0, 0.0, 0.0, 0.25, 1.0, 0.0], num_errors=1, num_timeouts=1,
                                    num_invalid=1)
        assert batch.first_error == "ValueError: boom from the reward fn"
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert "reward item 2: no result within reward.timeout_s=1 s" in caplog.text

        # pebble starts the replacement just after it gives up on the item, so give it a moment
        deadline = time.monotonic() + 5
        while len(manager.worker_pids) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids_after = manager.worker_pids
        killed = set(pids_before) - set(pids_after)
        assert len(killed) == 1 and len(pids_after) == 2  # exactly the stuck worker was replaced
        assert not _alive(killed.pop())
        assert manager.score([("x", "x"), ("y", "z")]) == RewardBatch(scores=[1.0, 0.25])
    finally:
        manager.close()
    assert manager.worker_pids == []
    assert not any(_alive(pid) for pid in pids_after)


def test_dead_worker_is_replaced_and_scored_as_error(reward_file: str, caplog: pytest.LogCaptureFixture) -> None:
    with RewardManager(_custom(reward_file, num_workers=1, timeout_s=5.0)) as manager:
        with caplog.at_level(logging.DEBUG, logger="periodic_async.reward.manager"):
            batch = manager.score([("die", "x"), ("a", "a")])
        assert batch == RewardBatch(scores=[0.0, 1.0], num_errors=1)
        assert batch.first_error.startswith("reward worker pid") and "died (exit code 3)" in batch.first_error
        assert "reward item 0: reward worker pid" in caplog.text
        pids = manager.worker_pids
    assert not any(_alive(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="closed"):
        manager.score([("a", "a")])


def test_items_go_out_in_chunks_but_the_time_limit_stays_per_item(reward_file: str) -> None:
    """A call is a few tasks per worker, not one per item; an item over the limit is stopped on its
    own (its chunk-mates before it keep their scores, those after it are scored again), and a
    chunk whose items together take longer than the limit, each within it, is not cut."""
    with RewardManager(_custom(reward_file, num_workers=1, timeout_s=1.0)) as manager:
        scheduled = []
        schedule = manager._pool.schedule
        manager._pool.schedule = lambda *a, **kw: scheduled.append(kw["args"][1]) or schedule(*a, **kw)
        items = [(str(i), str(i % 2)) for i in range(64)]
        assert manager.score(items) == RewardBatch(scores=[1.0 if i < 2 else 0.25 for i in range(64)])
        assert [len(chunk) for chunk in scheduled] == [32, 32]   # 2 chunks per worker, not 64 tasks

        # 3 items of 0.4 s in a chunk: 1.2 s, each within 1 s - one task per item would not time out
        scheduled.clear()
        batch = manager.score([("slow", "x")] * 6)
        assert batch == RewardBatch(scores=[0.5] * 6) and len(scheduled) == 2

        # a hang and a death in the middle of chunks: [a, sleep, b] [die, c, a]
        pids = manager.worker_pids
        scheduled.clear()
        batch = manager.score([("a", "a"), ("sleep", "x"), ("b", "b"), ("die", "x"), ("c", "c"), ("a", "b")])
        assert batch == RewardBatch(scores=[1.0, 0.0, 1.0, 0.0, 1.0, 0.25], num_errors=1, num_timeouts=1)
        # the two chunks, then what followed the hang and the death, each once
        assert sorted(scheduled) == sorted([[("a", "a"), ("sleep", "x"), ("b", "b")],
                                            [("die", "x"), ("c", "c"), ("a", "b")],
                                            [("b", "b")], [("c", "c"), ("a", "b")]])
        assert not set(pids) & set(manager.worker_pids)   # both workers it went through were replaced
        assert manager.score([("x", "x")]) == RewardBatch(scores=[1.0])


def test_score_from_a_producer_thread(reward_file: str) -> None:
    with RewardManager(_custom(reward_file, num_workers=2)) as manager:
        results: list[RewardBatch] = []
        threads = [threading.Thread(target=lambda: results.append(manager.score([("a", "a"), ("b", "c")])))
                   for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert results == [RewardBatch(scores=[1.0, 0.25])] * 3


def test_gsm8k_reward_in_a_worker(gsm8k_records: list) -> None:
    with RewardManager(RewardConfig(name="gsm8k", num_workers=1, timeout_s=30.0)) as manager:
        batch = manager.score([("#### 72", gsm8k_records[0].answer), ("\\boxed{11}", gsm8k_records[1].answer)])
    assert batch == RewardBatch(scores=[1.0, 0.0])


@pytest.mark.parametrize("child_code, startup_timeout_s, message", [
    ("raise ImportError('only the parent has this')", 60.0, "could not load .*only the parent has this"),
    ("import time; time.sleep(30)", 1.0, "did not load .* within 1 s"),
    ("import os; os._exit(7)", 60.0, "exited with code 7 while loading"),
])
def test_worker_that_cannot_start_raises_and_closes(tmp_path: Path, child_code: str, startup_timeout_s: float,
                                                    message: str) -> None:
    """Code that loads in the parent but not in a worker means a broken environment: fail loudly."""
    path = tmp_path / "parent_only.py"
    path.write_text("import multiprocessing\n"
                    "if multiprocessing.parent_process() is not None:\n"
                    f"    {child_code}\n"
                    "def compute_score(response, answer):\n    return 1.0\n")
    manager = RewardManager(_custom(str(path), num_workers=1), startup_timeout_s=startup_timeout_s)
    pids = manager.worker_pids
    start = time.monotonic()
    with pytest.raises(RewardWorkerError, match=message):
        manager.score([("a", "a")])
    assert time.monotonic() - start < 15
    assert manager.worker_pids == [] and not any(_alive(pid) for pid in pids)


# ---------------------------------------------------------------- faults over a step

def test_scorer_counts_each_fault_and_summarises_the_step_in_one_line(reward_file: str) -> None:
    """Groups are scored one by one (periodic mode); the step's stats add up every group's faults
    and keep the first message, and `reward_fault_summary` is the step's single line."""
    from periodic_async.rollout.base import RolloutResult
    from periodic_async.scheduling.group import Group
    from periodic_async.scheduling.producer import RolloutStats
    from helpers import score
    from periodic_async.scheduling.scorer import Scorer, reward_fault_summary

    def group(index: int, responses: list[str]) -> Group:
        results = [RolloutResult(index, k, [1], [ord(c) for c in r], [0.0] * len(r), "stop", 0)
                   for k, r in enumerate(responses)]
        return Group(index, [1], "a", results)

    with RewardManager(_custom(reward_file, num_workers=1, timeout_s=1.0)) as manager:
        scorer = Scorer(manager, lambda ids: "".join(chr(i) for i in ids), "grpo")
        stats = RolloutStats()
        groups = [group(0, ["a", "raise", "b", "nan"]), group(1, ["sleep", "text", "a", "raise"]),
                  group(2, ["a", "b", "c", "a"])]
        for g in groups:
            score(scorer, [g], stats)
    assert [g.rewards for g in groups] == [[1.0, 0.0, 0.25, 0.0], [0.0, 0.0, 1.0, 0.0], [1.0, 0.25, 0.25, 1.0]]
    assert (stats.num_errors, stats.num_timeouts, stats.num_invalid) == (2, 1, 2)
    summary = reward_fault_summary(stats, num_items=12)
    assert summary == ("reward fn failed on 5 of 12 responses, scored 0.0 (2 raised or lost their worker, "
                       "1 timed out, 2 returned a non-number or non-finite value); first: ValueError: boom "
                       "from the reward fn")
    assert reward_fault_summary(RolloutStats(), num_items=12) is None


def test_custom_reward_needs_a_worker_so_that_a_hang_ends(reward_file: str) -> None:
    """Inline scoring has no time limit, so a custom fn must run in a worker: there a hang ends at
    reward.timeout_s (test_workers_survive_errors_and_timeouts)."""
    from periodic_async.config import ConfigError, load_config
    cfg = load_config("configs/default.yaml", ["reward.name=custom", f"reward.custom_file={reward_file}"])
    assert cfg.reward.num_workers == 0
    with pytest.raises(ConfigError, match=r"reward.num_workers: 0 .* not allowed for reward.name 'custom'"):
        cfg.validate()


def test_math_verify_timeout_notice_is_dropped_in_workers_and_inline(gsm8k_records: list, capfd,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """math-verify warns 'Timeout is disabled ...' in every process that scores (its timeouts are
    off on purpose: the manager enforces reward.timeout_s); the workers and the inline scorer drop
    that notice, and only it."""
    with RewardManager(RewardConfig(name="gsm8k", num_workers=1, timeout_s=30.0)) as manager:
        assert manager.score([("#### 72", gsm8k_records[0].answer)]).scores == [1.0]
    assert "Timeout is disabled" not in capfd.readouterr().err
    with caplog.at_level(logging.WARNING), RewardManager(RewardConfig(name="gsm8k", num_workers=0)) as manager:
        assert manager.score([("#### 72", gsm8k_records[0].answer)]).scores == [1.0]
        logging.getLogger("math_verify.parser").warning("Timeout is disabled as parsing_timeout is None")
        logging.getLogger("math_verify.parser").warning("some other math-verify warning")
    assert [r.getMessage() for r in caplog.records if r.name.startswith("math_verify")] == [
        "some other math-verify warning"]
