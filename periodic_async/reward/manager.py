"""Reward scoring in worker processes with a per-item time limit.

A reward function is user code (a custom file, a math checker that can hang on a pathological
expression), so it runs in separate processes: an item that overruns `timeout_s` costs one worker,
which is killed and replaced, and never the training run. A function that raises, overruns or
returns something that is not a finite number scores 0.0 and is counted (`RewardBatch`: errors,
timeouts, invalid, and the first message); training goes on. Nothing is logged per item (a broken
reward fn would write a line per response, hundreds a step): the trainer logs one summary line
per step (scheduling/scorer.py: `reward_fault_summary`).

The pool is pebble's ProcessPool: it kills and replaces a worker that overruns or dies, and loads
the reward function once per worker (its `initializer`). Items go to the workers in chunks (a few
per worker per call), not one task each: a task's round trip costs ~0.2 ms, which for a string
compare is the whole cost. The time limit stays per item, counted from the moment a worker starts
it: a worker reports each item's start and result on a queue as it goes, and the item that
overruns is the one whose worker is killed; its chunk-mates before it keep their scores and those
after it are scheduled again. So a chunk behaves exactly as its items one task each would. On top of it, this module
starts the workers EAGERLY, at construction, so that their start-up (spawn + imports, ~1-2 s)
overlaps with model set-up, and checks that every worker did load the function: one that cannot,
or takes longer than `startup_timeout_s`, means a broken environment and stops everything.
"""
from __future__ import annotations

import atexit
import hashlib
import importlib
import importlib.util
import logging
import math
import multiprocessing as mp
import numbers
import os
import sys
import threading
import time
from concurrent import futures
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Optional

from pebble import ProcessExpired, ProcessPool

from periodic_async.config import RewardConfig
from periodic_async.errors import InputError

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, str], float]
RewardFnRef = tuple[str, str]  # (module name or path of a .py file, function name)

BUILTIN_REWARDS: dict[str, RewardFnRef] = {
    "synthetic": ("periodic_async.reward.synthetic", "compute_score"),
    "exact": ("periodic_async.reward.synthetic", "exact_score"),
    "gsm8k": ("periodic_async.reward.gsm8k", "compute_score"),
}
# A worker that has not loaded the reward function by then is taken as broken (imports hang).
STARTUP_TIMEOUT_S = 120.0
CHUNKS_PER_WORKER = 2  # a call's items go out in this many chunks per worker: few round trips, some balance
_LOCK_TIMEOUT_S = 5.0  # how long close() waits for a score() running in another thread
_POLL_S = 0.1          # how often score() checks on the workers while it waits for results


class RewardFnError(InputError):
    """The reward function cannot be resolved or loaded; the message names the file and function."""


class RewardWorkerError(RuntimeError):
    """A worker process could not load the reward function; the manager is closed when this is raised."""


@dataclass
class RewardBatch:
    scores: list[float]
    num_errors: int = 0     # the fn raised, or its worker died
    num_timeouts: int = 0   # no result within reward.timeout_s
    num_invalid: int = 0    # the fn returned a non-number, NaN or an infinity
    # the first failure's message, for the step's summary line; not part of equality, the counts are
    first_error: Optional[str] = field(default=None, compare=False)

    def fail(self, index: int, kind: str, message: str) -> None:
        """Item `index` scored 0.0 because of `kind` (error | timeout | invalid)."""
        self.scores[index] = 0.0
        counter = {"error": "num_errors", "timeout": "num_timeouts", "invalid": "num_invalid"}[kind]
        setattr(self, counter, getattr(self, counter) + 1)
        if self.first_error is None:
            self.first_error = message
        logger.debug("reward item %d: %s; scored 0.0", index, message)


# ---------------------------------------------------------------- resolving and loading

def resolve_reward_fn(cfg: RewardConfig) -> RewardFnRef:
    """The (module-or-file, function) reference for `cfg.name`; nothing is imported here."""
    if cfg.name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[cfg.name]
    if cfg.name == "custom":
        if not cfg.custom_file:
            raise RewardFnError("reward.custom_file: required when reward.name is 'custom'")
        return cfg.custom_file, cfg.custom_fn
    raise RewardFnError(f"reward.name: '{cfg.name}' is not allowed; allowed: "
                        f"{', '.join([*BUILTIN_REWARDS, 'custom'])}")


def _is_file_ref(target: str) -> bool:
    return target.endswith(".py") or os.sep in target


def _load_file_module(path: str) -> ModuleType:
    """Import a .py file under a name derived from its absolute path, so two files never collide."""
    if not os.path.isfile(path):
        raise RewardFnError(f"reward.custom_file: {path} does not exist")
    abspath = os.path.abspath(path)
    name = "periodic_async_reward_custom_" + hashlib.sha1(abspath.encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, abspath)
    if spec is None or spec.loader is None:
        raise RewardFnError(f"reward.custom_file: {path} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickle look the module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        raise RewardFnError(f"reward.custom_file: importing {path} failed: {type(e).__name__}: {e}") from e
    return module


def load_reward_fn(fn_ref: RewardFnRef) -> RewardFn:
    """Import the module or file of `fn_ref` and return its function, failing with a clear message."""
    target, fn_name = fn_ref
    if _is_file_ref(target):
        module = _load_file_module(target)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise RewardFnError(f"reward function module {target} cannot be imported: {e}") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise RewardFnError(f"{target}: has no callable '{fn_name}' "
                            f"({'found a ' + type(fn).__name__ if fn is not None else 'not defined'})")
    return fn


# ---------------------------------------------------------------- calling

class _InvalidScore(ValueError):
    """The fn returned, but not a finite number."""


def _as_score(value: Any) -> float:
    """A finite float, or _InvalidScore: a NaN or a string reward would poison the advantages."""
    if not isinstance(value, numbers.Real):
        raise _InvalidScore(f"reward fn returned {type(value).__name__} {repr(value)[:80]}, expected a number")
    score = float(value)
    if not math.isfinite(score):
        raise _InvalidScore(f"reward fn returned a non-finite value {score}")
    return score


def _call_reward(fn: RewardFn, response: str, answer: str) -> tuple[float, Optional[tuple[str, str]]]:
    """(score, None) on success; (0.0, (kind, message)) when fn raises (kind 'error') or returns
    a bad value ('invalid')."""
    try:
        value = fn(response, answer)
    except Exception as e:
        return 0.0, ("error", f"{type(e).__name__}: {e}")
    try:
        return _as_score(value), None
    except _InvalidScore as e:
        return 0.0, ("invalid", str(e))


# ---------------------------------------------------------------- worker process

_worker_fn: Optional[RewardFn] = None  # set once per worker process, by _init_worker
_worker_progress: Any = None            # the manager's progress queue, set by _init_worker


class _DropMathVerifyTimeoutNotice(logging.Filter):
    """math-verify warns 'Timeout is disabled as ... is None or <= 0' once per module (parser and
    grader) in each process that scores: the gsm8k reward turns its SIGALRM timeouts off on
    purpose, because this manager enforces reward.timeout_s by killing the worker instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled as ")


_MATH_VERIFY_FILTER = _DropMathVerifyTimeoutNotice()


def _quiet_reward_libraries() -> None:
    """Install the filters above in this process (a reward worker, or the trainer scoring inline)."""
    for name in ("math_verify.parser", "math_verify.grader"):
        log = logging.getLogger(name)
        if _MATH_VERIFY_FILTER not in log.filters:
            log.addFilter(_MATH_VERIFY_FILTER)


def _init_worker(fn_ref: RewardFnRef, ready: Any, progress: Any = None) -> None:
    """pebble initializer: load the fn and report on `ready` (a SimpleQueue) whether that worked.
    Re-raising makes pebble end this worker before it takes any item. `progress`: the queue that
    `_score_chunk_in_worker` reports on."""
    global _worker_fn, _worker_progress
    _worker_progress = progress
    _quiet_reward_libraries()
    try:
        _worker_fn = load_reward_fn(fn_ref)
    except BaseException as e:
        ready.put(("load_error", os.getpid(), f"{type(e).__name__}: {e}"))
        raise
    ready.put(("ready", os.getpid(), None))


def _score_in_worker(response: str, answer: str) -> tuple[float, Optional[tuple[str, str]]]:
    return _call_reward(_worker_fn, response, answer)


def _score_chunk_in_worker(chunk_id: int, items: list[tuple[str, str]]) -> list:
    """Score `items` in order, putting ("start", chunk_id, j, time.monotonic()) before item j and
    ("done", chunk_id, j, score, failure) after it on the progress queue (a SimpleQueue: each put is
    in the pipe when it returns, so what a killed worker sent is there). CLOCK_MONOTONIC is one clock
    for every process of the machine, so the parent can time the item. Returns every (score, failure)."""
    out = []
    for j, (response, answer) in enumerate(items):
        _worker_progress.put(("start", chunk_id, j, time.monotonic()))
        result = _call_reward(_worker_fn, response, answer)
        _worker_progress.put(("done", chunk_id, j, *result))
        out.append(result)
    return out


def chunk_ranges(num_items: int, num_chunks: int) -> list[range]:
    """[0, num_items) cut into min(num_items, num_chunks) consecutive ranges whose sizes differ by at
    most one."""
    n = max(1, min(num_items, num_chunks))
    bounds = [num_items * i // n for i in range(n + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def _pool_processes(pool: Optional[ProcessPool]) -> list:
    """The live worker processes of `pool`. pebble exposes them only through private attributes
    (5.2.3: pool._pool_manager.worker_manager.workers, a pid -> Process dict, kept up to date by its
    manager thread), so they are read defensively: if that changes, this gives [] (and the tests
    fail) instead of an error in the middle of a run."""
    worker_manager = getattr(getattr(pool, "_pool_manager", None), "worker_manager", None)
    workers = getattr(worker_manager, "workers", None)
    return list(workers.values()) if isinstance(workers, dict) else []  # a copy: pebble's thread edits it


# ---------------------------------------------------------------- manager

class RewardManager:
    """Scores (response, gold_answer) pairs with the configured reward fn.

    num_workers >= 1: that many spawned worker processes, each item limited to `timeout_s` from the
    moment a worker takes it. num_workers == 0: scored inline in the calling thread; exceptions are
    handled the same way but timeouts are NOT enforced (a hanging fn hangs the caller).
    `score` may be called from any thread; calls are serialised by a lock. Use `close()` (or a
    `with` block) to stop the workers; an atexit hook does it too.
    """

    def __init__(self, cfg: RewardConfig, startup_timeout_s: float = STARTUP_TIMEOUT_S,
                 chunks_per_worker: int = CHUNKS_PER_WORKER):
        if cfg.num_workers < 0:
            raise ValueError(f"reward.num_workers: must be >= 0, got {cfg.num_workers}")
        if not cfg.timeout_s > 0:
            raise ValueError(f"reward.timeout_s: must be > 0, got {cfg.timeout_s}")
        self.cfg = cfg
        self.startup_timeout_s = startup_timeout_s
        self.chunks_per_worker = chunks_per_worker   # tools/bench_reward.py compares it
        fn_ref = resolve_reward_fn(cfg)
        self._fn = load_reward_fn(fn_ref)  # eager: a bad reference fails here, before training starts
        _quiet_reward_libraries()          # num_workers 0 scores in this process
        # Workers may not share the parent's idea of a relative path; give them an absolute one.
        if _is_file_ref(fn_ref[0]):
            fn_ref = (os.path.abspath(fn_ref[0]), fn_ref[1])
        self._fn_ref: RewardFnRef = fn_ref
        self._lock = threading.Lock()
        self._closed = False
        self._pool: Optional[ProcessPool] = None
        if cfg.num_workers > 0:
            self._start_pool()
        atexit.register(self.close)

    # ------------------------------------------------------------ public

    @property
    def worker_pids(self) -> list[int]:
        """Pids of the current worker processes (replacements included), for monitoring and tests."""
        return [p.pid for p in _pool_processes(self._pool)]

    def score(self, items: list[tuple[str, str]]) -> RewardBatch:
        """Scores in input order; failures and timeouts score 0.0 and are counted, never raised."""
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardManager.score: the manager is closed")
            if not items:
                return RewardBatch(scores=[])
            if self._pool is None:
                return self._score_inline(items)
            return self._score_in_workers(items)

    def close(self) -> None:
        """Stop and join every worker. Safe to call twice and from atexit; if another thread is
        stuck inside score() the lock is not waited on for long, the workers are ended anyway."""
        locked = self._lock.acquire(timeout=_LOCK_TIMEOUT_S)
        try:
            self._shutdown()
        finally:
            if locked:
                self._lock.release()

    def __enter__(self) -> "RewardManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------ inline

    def _score_inline(self, items: list[tuple[str, str]]) -> RewardBatch:
        batch = RewardBatch(scores=[0.0] * len(items))
        for index, (response, answer) in enumerate(items):
            self._record(batch, index, *_call_reward(self._fn, response, answer))
        return batch

    @staticmethod
    def _record(batch: RewardBatch, index: int, score: float, failure: Optional[tuple[str, str]]) -> None:
        if failure is None:
            batch.scores[index] = score
        else:
            batch.fail(index, *failure)

    # ------------------------------------------------------------ workers

    def _start_pool(self) -> None:
        ctx = mp.get_context("spawn")
        self._ready = ctx.SimpleQueue()  # ("ready" | "load_error", pid, error) from _init_worker
        self._progress = ctx.SimpleQueue()  # ("start" | "done", chunk, item, ...) from _score_chunk_in_worker
        self._next_chunk_id = getattr(self, "_next_chunk_id", 0)   # kept over pool restarts
        self._pool = ProcessPool(max_workers=self.cfg.num_workers, initializer=_init_worker,
                                 initargs=(self._fn_ref, self._ready, self._progress), context=ctx)
        if not self._pool.active:  # reading `active` starts the workers now; pebble would wait for an item
            raise RewardWorkerError("the reward worker pool did not start")
        self._ready_pids: set[int] = set()
        self._loading: dict[int, tuple[float, Any]] = {}  # pid -> (first seen, process), until ready
        self._track_new_workers(time.monotonic())

    def _stop_pool(self) -> None:
        """SIGTERM to every worker (SIGKILL after 3 s), joined, so no zombie or orphan remains."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()
            pool.join()
            self._ready.close()
            self._progress.close()

    def _shutdown(self) -> None:
        """The body of close(), for callers that already hold the lock."""
        self._stop_pool()
        self._closed = True
        atexit.unregister(self.close)

    def _fail_startup(self, message: str) -> None:
        """A worker that cannot load what the parent loaded means a broken environment: stop all."""
        self._shutdown()
        raise RewardWorkerError(message)

    def _track_new_workers(self, now: float) -> dict[int, Any]:
        """The current workers by pid; those not seen before start their start-up clock now."""
        current = {p.pid: p for p in _pool_processes(self._pool)}
        for pid, process in current.items():
            if pid not in self._ready_pids:
                self._loading.setdefault(pid, (now, process))
        return current

    def _check_workers(self) -> bool:
        """Raise RewardWorkerError if a worker could not load the fn, exited while loading it or has
        not loaded it within startup_timeout_s; return False if the pool broke (pebble gives up on the
        pool when a worker dies while no item is running, e.g. killed from outside)."""
        if self._pool is None:
            raise RuntimeError("RewardManager.score: the manager was closed during the call")
        healthy = self._pool.active  # read first: a worker reports a load error before it exits
        now = time.monotonic()
        current = self._track_new_workers(now)  # before reading `ready`: what a gone worker sent is there
        while not self._ready.empty():
            status, pid, error = self._ready.get()
            if status == "load_error":
                self._fail_startup(f"reward worker pid {pid} could not load {self._fn_ref}: {error}")
            self._ready_pids.add(pid)
            self._loading.pop(pid, None)
        for pid, (started_at, process) in self._loading.items():
            if pid not in current:  # pebble only stops workers on an item (or at close): this one died
                self._fail_startup(f"reward worker pid {pid} exited with code {process.exitcode} while "
                                   f"loading {self._fn_ref}")
            if now - started_at > self.startup_timeout_s:
                self._fail_startup(f"reward worker pid {pid} did not load {self._fn_ref} within "
                                   f"{self.startup_timeout_s:g} s")
        return healthy

    def _score_in_workers(self, items: list[tuple[str, str]]) -> RewardBatch:
        if not self._check_workers():
            logger.warning("reward worker pool broke while idle; starting a new one")
            self._stop_pool()
            self._start_pool()
        batch = RewardBatch(scores=[0.0] * len(items))
        todo = [list(r) for r in chunk_ranges(len(items), self.chunks_per_worker * self.cfg.num_workers)]
        lost = 0
        while todo:   # a chunk cut short by a killed item comes back with the items after that one
            todo, lost_now = self._score_chunks(items, todo, batch)
            lost += lost_now
            if lost_now:
                self._stop_pool()
                self._start_pool()
        if lost:
            logger.warning("reward worker pool broke (a worker died while no item was running); %d of %d "
                           "items scored 0.0; started a new pool", lost, len(items))
        return batch

    def _score_chunks(self, items: list[tuple[str, str]], chunks: list[list[int]],
                      batch: RewardBatch) -> tuple[list[list[int]], int]:
        """Run `chunks` (lists of item indices) one task each, recording into `batch`; returns the
        item lists still to score (those after an item that overran or killed its worker) and how
        many items were lost to a broken pool."""
        limit = self.cfg.timeout_s
        position: dict[int, int] = {}   # chunk id (unique over the manager's life) -> index in chunks
        pending = []
        for c, chunk in enumerate(chunks):
            position[self._next_chunk_id] = c
            # pebble's own limit is only a backstop (a worker that stops reporting): items are timed here
            pending.append(self._pool.schedule(_score_chunk_in_worker, timeout=limit * len(chunk) + 10.0,
                                               args=(self._next_chunk_id, [items[i] for i in chunk])))
            self._next_chunk_id += 1
        running: dict[int, tuple[int, float]] = {}         # chunk -> (item, its start) last reported
        results: list[dict] = [{} for _ in chunks]          # chunk -> {item: (score, failure)} reported
        overran: dict[int, int] = {}                        # chunk -> the item its worker was killed on

        def drain() -> None:
            while not self._progress.empty():
                kind, chunk_id, j, *rest = self._progress.get()
                c = position.get(chunk_id)
                if c is None:
                    continue   # sent by a worker of an earlier call just before it was killed
                if kind == "start":
                    running[c] = (j, rest[0])
                else:
                    results[c][j] = tuple(rest)
        try:
            not_done = set(pending)
            while not_done:
                not_done = futures.wait(not_done, timeout=_POLL_S).not_done
                drain()
                now = time.monotonic()
                for c, future in enumerate(pending):
                    if future in not_done and c not in overran and c in running:
                        j, started_at = running[c]
                        if j not in results[c] and now - started_at > limit:
                            overran[c] = j
                            future.cancel()   # pebble stops the worker running it and starts another
                if not self._check_workers():
                    break
        finally:
            for future in pending:  # only if interrupted or broken: pebble stops workers still on them
                future.cancel()
        drain()
        again, lost = [], 0
        for c, (chunk, future) in enumerate(zip(chunks, pending)):
            error = None
            if c not in overran:
                error = BrokenProcessPool() if future.cancelled() else future.exception()  # done: never waits
                if error is None:
                    results[c] = dict(enumerate(future.result()))
            for j, result in results[c].items():
                if j != overran.get(c):
                    self._record(batch, chunk[j], *result)
            missing = [j for j in range(len(chunk)) if j not in results[c] and j != overran.get(c)]
            if c in overran:
                stop = overran[c]
                batch.fail(chunk[stop], "timeout", f"no result within reward.timeout_s={limit:g} s "
                                                   "(its worker was killed and replaced)")
            elif error is None or not missing:
                continue
            elif isinstance(error, BrokenProcessPool):
                for j in missing:
                    batch.fail(chunk[j], "error", "the reward worker pool broke (a worker died while idle)")
                lost += len(missing)
                continue
            else:
                stop = missing[0]   # items run in order: the first without a result is the one that failed
                self._record_failure(batch, chunk[stop], error)
            again.append([chunk[j] for j in missing if j > stop])
        return [chunk for chunk in again if chunk], lost

    def _record_failure(self, batch: RewardBatch, index: int, error: BaseException) -> None:
        """Record the failure of the item a worker was running when its task failed."""
        if isinstance(error, futures.TimeoutError):  # pebble's backstop: the worker stopped reporting
            batch.fail(index, "timeout", f"no result within reward.timeout_s={self.cfg.timeout_s:g} s "
                                         "(its worker was killed and replaced)")
        elif isinstance(error, ProcessExpired):
            batch.fail(index, "error", f"reward worker pid {error.pid} died (exit code {error.exitcode}); "
                                       "replaced")
        else:
            batch.fail(index, "error", f"{type(error).__name__}: {error}")
