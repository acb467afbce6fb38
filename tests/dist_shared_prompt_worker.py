"""Shared-prompt TP worker, run under torchrun by tests/test_shared_prompt.py (not a test file):

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist_shared_prompt_worker.py \
        --out OUT.json POLICY_DIR REF_DIR

With tensor parallelism 2 it runs the unshared engine and the shared-prompt engine (sdpa kernel, each
rank holding heads/2 and vocab/2) on the same groups and compares per-token log-probs, the GRPO loss
terms and every local parameter-gradient shard. Rank r writes OUT.json.rank{r}: {"tp", "failures", "checked_params", ...}.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_tp_worker import _exit_when_orphaned  # noqa: E402,F401  (also guards this worker)

import torch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("policy_dir")
    ap.add_argument("ref_dir")
    args = ap.parse_args()

    from periodic_async.backend import get_backend
    backend = get_backend("cpu")
    rank, _, _ = backend.init_distributed()
    backend.init_model_parallel(args.tp, 1, seed=0)

    from megatron.core import parallel_state as ps
    import test_shared_prompt as t
    from periodic_async.actor.packing import pack_shared, pack_unshared

    groups = t.make_groups(t.CASES["k8_mixed_several_groups"], seed=11)
    samples = [s for g in groups for s in g]
    unshared, shared = t._actor((args.policy_dir, args.ref_dir), False), t._actor((args.policy_dir, args.ref_dir), True)
    mb_u, mb_s = pack_unshared(samples, t.PAD), pack_shared(groups, t.PAD)
    failures = []
    lp_u, lp_s = unshared.compute_logprobs(mb_u), shared.compute_logprobs(mb_s)
    for key in ("policy", "ref"):
        for i, (a, e) in enumerate(zip(t._per_response(lp_s[key], mb_s), t._per_response(lp_u[key], mb_u))):
            if not torch.allclose(a, e, **t.LOGP_TOL):
                failures.append(f"rank {rank}: {key} logp of response {i}: max diff {float((a - e).abs().max()):.3g}")
    m_u = unshared.train_micro_step(mb_u, t.NORMALISER)
    m_s = shared.train_micro_step(mb_s, t.NORMALISER)
    for key, want in m_u.items():
        if abs(m_s[key] - want) > t.METRIC_TOL["atol"] + t.METRIC_TOL["rtol"] * abs(want):
            failures.append(f"rank {rank}: {key} {m_s[key]!r} != {want!r}")
    g_u, g_s = t._grads(unshared), t._grads(shared)
    try:
        t._assert_grads_close(g_s, g_u, f"rank {rank} TP={args.tp}")
    except AssertionError as e:
        failures.append(str(e))
    # each rank writes its own file: an object collective right before the end is what torch 2.7.1's
    # gloo teardown can deadlock on (backend.Backend.shutdown_distributed)
    with open(f"{args.out}.rank{rank}", "w") as f:
        json.dump({"tp": ps.get_tensor_model_parallel_world_size(), "failures": failures,
                   "checked_params": len(g_u), "metrics_unshared": m_u, "metrics_shared": m_s}, f, indent=1)
    backend.shutdown_distributed()

if __name__ == "__main__":
    main()
