"""Reward scoring cost per call: items sent to the worker pool in chunks against one task per item,
and inline scoring, side by side (issue 30: rewards off the critical path).

    python tools/bench_reward.py [--rewards synthetic,gsm8k] [--workers 1,2] [--items 64,512] [--repeats 5]

One RewardManager per (reward, workers, chunking), started once; each timed call scores `items`
(response, answer) pairs - for gsm8k, GSM8K's own answers written as "#### N" with every second one
wrong, for synthetic a string compare. The chunked and one-task-per-item managers (the same code
with chunks_per_worker large enough for one item per chunk: still the progress messages, so this
is the chunking's gain, not the old code's exact cost) are called alternately, `--repeats` times
each, after one warm-up call. Prints ms per call, mean (min..max), and the per-item figure.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from periodic_async.config import DataConfig, RewardConfig  # noqa: E402
from periodic_async.reward.manager import CHUNKS_PER_WORKER, RewardManager  # noqa: E402


def items_for(reward: str, n: int) -> list[tuple[str, str]]:
    if reward == "gsm8k":
        from periodic_async.data.dataset import load_records
        records = load_records(DataConfig(source="gsm8k"))
        out = []
        for i in range(n):
            rec = records[i % len(records)]
            final = rec.answer.split("####")[-1].strip()
            out.append((f"The answer is computed step by step.\n#### {final if i % 2 else final + '1'}", rec.answer))
        return out
    return [(str(i % 97), str(i % 89)) for i in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rewards", default="synthetic,gsm8k")
    p.add_argument("--workers", default="1,2")
    p.add_argument("--items", default="64,512")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    rows = ["| reward | workers | items / call | how | ms / call | ms / item |", "|---|---|---|---|---|---|"]
    for reward in args.rewards.split(","):
        for n in (int(x) for x in args.items.split(",")):
            items = items_for(reward, n)
            with RewardManager(RewardConfig(name=reward, num_workers=0)) as inline:
                inline.score(items)
                t = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    inline.score(items)
                    t.append(1000 * (time.perf_counter() - t0))
                rows.append(f"| {reward} | 0 | {n} | inline | {statistics.fmean(t):.1f} ({min(t):.1f}..{max(t):.1f}) "
                            f"| {statistics.fmean(t) / n:.3f} |")
            for w in (int(x) for x in args.workers.split(",")):
                managers = {f"{CHUNKS_PER_WORKER} chunks / worker": RewardManager(RewardConfig(name=reward, num_workers=w)),
                            "one task / item": RewardManager(RewardConfig(name=reward, num_workers=w),
                                                             chunks_per_worker=10 ** 6)}
                try:
                    times = {k: [] for k in managers}
                    reference = None
                    for m in managers.values():
                        scores = m.score(items).scores   # warm-up (imports in the workers), and equal scores
                        assert reference is None or scores == reference, "chunked and per-item scores differ"
                        reference = scores
                    for _ in range(args.repeats):
                        for k, m in managers.items():
                            t0 = time.perf_counter()
                            m.score(items)
                            times[k].append(1000 * (time.perf_counter() - t0))
                    for k, t in times.items():
                        rows.append(f"| {reward} | {w} | {n} | {k} | {statistics.fmean(t):.1f} "
                                    f"({min(t):.1f}..{max(t):.1f}) | {statistics.fmean(t) / n:.3f} |")
                finally:
                    for m in managers.values():
                        m.close()
            print("\n".join(rows[-1 - 2 * len(args.workers.split(",")):]), flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
