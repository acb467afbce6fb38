"""Reward scoring in worker processes with a per-item time limit.

A reward function is user code (a custom file, a math checker that can hang on a pathological
expression), so it runs in separate processes: an item that overruns `timeout_s` costs one worker,
which is killed and replaced, and never the training run. A function that raises, or returns
something that is not a finite number, scores 0.0 and is counted; training goes on.

Workers are started EAGERLY, at construction, so that their start-up (spawn + imports, ~1-2 s)
overlaps with model set-up. `score()` waits until a worker has loaded the reward function and
reported ready before handing it an item, so start-up time never counts against an item's limit.
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
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from types import ModuleType
from typing import Any, Callable, Optional

from periodic_async.config import RewardConfig

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, str], float]
RewardSpec = tuple[str, str]  # (module name or path of a .py file, function name)

BUILTIN_REWARDS: dict[str, RewardSpec] = {
    "synthetic": ("periodic_async.reward.synthetic", "compute_score"),
    "gsm8k": ("periodic_async.reward.gsm8k", "compute_score"),
}
# A worker that has not loaded the reward function by then is taken as broken (imports hang).
STARTUP_TIMEOUT_S = 120.0
_JOIN_TIMEOUT_S = 5.0


class RewardFnError(ValueError):
    """The reward function cannot be resolved or loaded; the message names the file and function."""


class RewardWorkerError(RuntimeError):
    """A worker process could not start; the manager is closed when this is raised."""


@dataclass
class RewardBatch:
    scores: list[float]
    num_errors: int = 0
    num_timeouts: int = 0


# ---------------------------------------------------------------- resolving and loading

def resolve_reward_fn(cfg: RewardConfig) -> RewardSpec:
    """The (module-or-file, function) spec for `cfg.name`; the function is not imported here."""
    if cfg.name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[cfg.name]
    if cfg.name == "custom":
        if not cfg.custom_file:
            raise RewardFnError("reward.custom_file: required when reward.name is 'custom'")
        return cfg.custom_file, cfg.custom_fn
    raise RewardFnError(f"reward.name: '{cfg.name}' is not allowed; allowed: "
                        f"{', '.join([*BUILTIN_REWARDS, 'custom'])}")


def _is_file_spec(target: str) -> bool:
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


def load_reward_fn(spec: RewardSpec) -> RewardFn:
    """Import the module or file of `spec` and return its function, failing with a clear message."""
    target, fn_name = spec
    if _is_file_spec(target):
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

def _as_score(value: Any) -> float:
    """A finite float, or an exception: a NaN or a string reward would poison the advantages."""
    if not isinstance(value, numbers.Real):
        raise TypeError(f"reward fn returned {type(value).__name__} {repr(value)[:80]}, expected a number")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"reward fn returned a non-finite value {score}")
    return score


def _call_reward(fn: RewardFn, response: str, answer: str) -> tuple[float, Optional[str]]:
    """(score, None) on success, (0.0, error text) when fn raises or returns a bad value."""
    try:
        return _as_score(fn(response, answer)), None
    except Exception as e:
        return 0.0, f"{type(e).__name__}: {e}"


def _worker_main(conn: Connection, spec: RewardSpec) -> None:
    """Worker process: load the fn once, report ready, then score one (index, response, answer)
    task at a time until told to stop (None) or the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    try:
        fn = load_reward_fn(spec)
    except Exception as e:
        conn.send(("load_error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        index, response, answer = task
        conn.send(("result", index, *_call_reward(fn, response, answer)))


# ---------------------------------------------------------------- manager

@dataclass
class _Worker:
    process: Any  # multiprocessing.context.SpawnProcess
    conn: Connection
    started_at: float
    ready: bool = False
    item: Optional[int] = None  # index of the item being scored, None when idle
    deadline: float = field(default=math.inf)


class RewardManager:
    """Scores (response, gold_answer) pairs with the configured reward fn.

    num_workers >= 1: that many spawned worker processes, each item limited to `timeout_s` from the
    moment it is handed to a ready worker. num_workers == 0: scored inline in the calling thread;
    exceptions are handled the same way but timeouts are NOT enforced (a hanging fn hangs the caller).
    `score` may be called from any thread; calls are serialised by a lock. Use `close()` (or a
    `with` block) to stop the workers; an atexit hook does it too.
    """

    def __init__(self, cfg: RewardConfig, startup_timeout_s: float = STARTUP_TIMEOUT_S):
        if cfg.num_workers < 0:
            raise ValueError(f"reward.num_workers: must be >= 0, got {cfg.num_workers}")
        if not cfg.timeout_s > 0:
            raise ValueError(f"reward.timeout_s: must be > 0, got {cfg.timeout_s}")
        self.cfg = cfg
        self.startup_timeout_s = startup_timeout_s
        spec = resolve_reward_fn(cfg)
        self._fn = load_reward_fn(spec)  # eager: a bad spec fails here, before training starts
        # Workers may not share the parent's idea of a relative path; give them an absolute one.
        self._spec: RewardSpec = (os.path.abspath(spec[0]), spec[1]) if _is_file_spec(spec[0]) else spec
        self._lock = threading.Lock()
        self._closed = False
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = [self._start_worker() for _ in range(cfg.num_workers)]
        atexit.register(self.close)

    # ------------------------------------------------------------ public

    @property
    def worker_pids(self) -> list[int]:
        """Pids of the current worker processes (replacements included), for monitoring and tests."""
        return [w.process.pid for w in self._workers]

    def score(self, items: list[tuple[str, str]]) -> RewardBatch:
        """Scores in input order; failures and timeouts score 0.0 and are counted, never raised."""
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardManager.score: the manager is closed")
            if not items:
                return RewardBatch(scores=[])
            if not self._workers:
                return self._score_inline(items)
            return self._score_in_workers(items)

    def close(self) -> None:
        """Terminate and join every worker. Safe to call twice and from atexit; if another thread
        is stuck inside score() the lock is not waited on for long, the workers are ended anyway."""
        locked = self._lock.acquire(timeout=_JOIN_TIMEOUT_S)
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
            score, error = _call_reward(self._fn, response, answer)
            self._record(batch, index, score, error)
        return batch

    @staticmethod
    def _record(batch: RewardBatch, index: int, score: float, error: Optional[str]) -> None:
        batch.scores[index] = score
        if error is not None:
            batch.num_errors += 1
            logger.warning("reward item %d: %s; scored 0.0", index, error)

    # ------------------------------------------------------------ workers

    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(target=_worker_main, args=(child_conn, self._spec),
                                    name="reward-worker", daemon=True)
        process.start()
        child_conn.close()  # so that the parent sees EOF if the child dies
        return _Worker(process=process, conn=parent_conn, started_at=time.monotonic())

    @staticmethod
    def _stop_worker(w: _Worker) -> None:
        """SIGTERM, then SIGKILL if it lingers; always joined so no zombie or orphan remains."""
        if w.process.is_alive():
            w.process.terminate()
            w.process.join(_JOIN_TIMEOUT_S)
            if w.process.is_alive():
                w.process.kill()
        w.process.join()
        w.conn.close()

    def _replace(self, slot: int) -> None:
        old = self._workers[slot]
        if old.process.is_alive():
            old.process.kill()  # the worker may be stuck in C code; SIGTERM could be ignored
        self._stop_worker(old)
        self._workers[slot] = self._start_worker()

    def _shutdown(self) -> None:
        """The body of close(), for callers that already hold the lock."""
        for w in self._workers:
            self._stop_worker(w)
        self._workers = []
        self._closed = True
        atexit.unregister(self.close)

    def _fail_startup(self, message: str) -> None:
        """A worker that cannot load what the parent loaded means a broken environment: stop all."""
        self._shutdown()
        raise RewardWorkerError(message)

    def _score_in_workers(self, items: list[tuple[str, str]]) -> RewardBatch:
        batch = RewardBatch(scores=[0.0] * len(items))
        pending = deque(range(len(items)))
        remaining = len(items)
        try:
            while remaining:
                self._dispatch(pending, items)
                self._wait_for_event()
                remaining -= self._collect(batch)
                remaining -= self._expire(batch)
        finally:
            if remaining and not self._closed:  # interrupted (e.g. KeyboardInterrupt): drop in-flight work
                for slot, w in enumerate(self._workers):
                    if w.item is not None:
                        self._replace(slot)
        return batch

    def _dispatch(self, pending: deque, items: list[tuple[str, str]]) -> None:
        """Hand pending items to ready idle workers; the item's clock starts now."""
        for slot, w in enumerate(self._workers):
            if not pending:
                return
            if not w.ready or w.item is not None:
                continue
            index = pending.popleft()
            try:
                w.conn.send((index, *items[index]))
            except (OSError, ValueError):  # died while idle: requeue, its replacement will take it
                pending.appendleft(index)
                self._replace(slot)
                continue
            w.item, w.deadline = index, time.monotonic() + self.cfg.timeout_s

    def _next_deadline(self) -> float:
        deadlines = [w.deadline if w.item is not None else w.started_at + self.startup_timeout_s
                     for w in self._workers if w.item is not None or not w.ready]
        return min(deadlines, default=math.inf)

    def _wait_for_event(self) -> None:
        """Block until a worker writes, a worker exits, or the nearest deadline passes."""
        handles: list[Any] = [w.conn for w in self._workers] + [w.process.sentinel for w in self._workers]
        timeout = min(max(0.0, self._next_deadline() - time.monotonic()), 60.0)
        wait(handles, timeout=timeout)

    def _collect(self, batch: RewardBatch) -> int:
        """Read every available message and detect dead workers; returns items finished."""
        finished = 0
        for slot in range(len(self._workers)):
            w = self._workers[slot]
            try:
                while w.conn.poll():
                    finished += self._handle_message(w, w.conn.recv(), batch)
            except (EOFError, OSError):
                pass  # the child closed its end: it is dead, handled below
            if not w.process.is_alive():
                finished += self._handle_death(slot, batch)
        return finished

    def _handle_message(self, w: _Worker, message: tuple, batch: RewardBatch) -> int:
        tag = message[0]
        if tag == "ready":
            w.ready = True
            return 0
        if tag == "load_error":
            self._fail_startup(f"reward worker pid {w.process.pid} could not load {self._spec}: {message[1]}")
        _, index, score, error = message
        if index != w.item:  # cannot happen: one task at a time per worker
            raise RuntimeError(f"reward worker pid {w.process.pid} answered item {index}, expected {w.item}")
        w.item, w.deadline = None, math.inf
        self._record(batch, index, score, error)
        return 1

    def _handle_death(self, slot: int, batch: RewardBatch) -> int:
        w = self._workers[slot]
        if not w.ready:
            self._fail_startup(f"reward worker pid {w.process.pid} exited with code {w.process.exitcode} "
                               f"while loading {self._spec}")
        index = w.item
        self._replace(slot)
        if index is None:
            logger.warning("reward worker pid %d exited while idle (code %s); replaced", w.process.pid,
                           w.process.exitcode)
            return 0
        batch.num_errors += 1
        batch.scores[index] = 0.0
        logger.warning("reward item %d: worker pid %d died (exit code %s); scored 0.0, worker replaced",
                       index, w.process.pid, w.process.exitcode)
        return 1

    def _expire(self, batch: RewardBatch) -> int:
        """Kill and replace workers past their item's deadline; fail if one never starts."""
        now, finished = time.monotonic(), 0
        for slot in range(len(self._workers)):
            w = self._workers[slot]
            if w.item is not None and now >= w.deadline:
                batch.num_timeouts += 1
                batch.scores[w.item] = 0.0
                logger.warning("reward item %d: no result within timeout_s=%g s; scored 0.0, killing "
                               "worker pid %d and starting a replacement", w.item, self.cfg.timeout_s,
                               w.process.pid)
                self._replace(slot)
                finished += 1
            elif not w.ready and now - w.started_at > self.startup_timeout_s:
                self._fail_startup(f"reward worker pid {w.process.pid} did not load {self._spec} within "
                                   f"{self.startup_timeout_s:g} s")
        return finished
