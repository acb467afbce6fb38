"""Which rollout worker gets the next request: the pool's one dispatch rule, torch-free, so the
rollout pool (worker.py: WorkerPool.dispatch) and the scheduling simulator (tools/sim/replay.py)
make the same choice."""
from __future__ import annotations

from collections.abc import Mapping


def least_loaded_worker(load: Mapping[int, int]) -> int:
    """The worker id with the least outstanding samples in `load` (worker id -> samples
    dispatched and not yet returned); ties go to the lowest worker id."""
    return min(load, key=lambda w: (load[w], w))
