"""Tensor parallelism is exact: a TP=2 run (torchrun, 2 gloo processes, tests/dist_tp_worker.py)
gives the same logits, GRPO loss terms, grad norm and full gradients as TP=1 in-process, which in
turn match an independent transformers + autograd computation of the same loss; and the TP=2
HF-layout export equals the source checkpoint bit for bit.

Both sides run helpers.tp_parity_quantities. The reference model is a scaled copy of the policy
(init_std 0.18 vs 0.2, same seed) so the KL term and its gradient are non-zero but moderate."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import helpers
from helpers import make_hf_model_dir, tp_parity_quantities

TP = 2
WORKER = Path(__file__).with_name("dist_tp_worker.py")
REPO = WORKER.parent.parent
CASES = {
    "qwen2-tied": dict(arch="qwen2", tied=True, seed=0),
    "llama-untied": dict(arch="llama", tied=False, seed=1),
}
LOGIT_TOL = 1e-5        # relative to the largest |logit|
METRIC_RTOL, METRIC_ATOL = 1e-5, 1e-7
# Gradients: rtol 1e-4 plus an atol relative to each tensor's largest entry. A fixed atol of 1e-6
# is below fp32 rounding here: with init_std 0.2 the embedding gradient reaches |g| ~ 2.5 and
# individual entries come from cancelling O(1) terms, so the TP=2 all-reduce order moves them by up
# to ~4e-6 * max|g| - while TP=1 and TP=2 are each ~1e-5 away from a float64 computation (TP=2 is
# not less exact than TP=1). Real layout / reduction bugs give O(1) relative errors; a dropped
# entropy (coef 0.01) or KL (coef 0.1) gradient gives ~1e-2.
GRAD_RTOL, GRAD_ATOL_REL = 1e-4, 2e-5


def _tail(text: str, n: int = 8000) -> str:
    return text if len(text) <= n else "..." + text[-n:]


def _run_torchrun(cmd: list[str], timeout: float = 300.0) -> subprocess.CompletedProcess:
    """Run the launcher; fail with the tail of its stdout/stderr when it times out or exits non-zero.

    Output goes to files, not pipes: torchrun starts each worker in its own session, so a worker that
    outlives the launcher would keep a pipe open and block the read. On timeout the launcher gets
    SIGTERM first (it forwards it to the workers and reaps them), SIGKILL only if it is still alive
    after 40 s; the workers also exit by themselves once their launcher is gone (see the worker)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    with tempfile.TemporaryFile("w+") as fout, tempfile.TemporaryFile("w+") as ferr:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fout, stderr=ferr, text=True)
        try:
            proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        fout.seek(0)
        ferr.seek(0)
        out, err = fout.read(), ferr.read()
    what = f"timed out after {timeout:.0f} s" if timed_out else f"failed (rc={proc.returncode})"
    assert not timed_out and proc.returncode == 0, (
        f"torchrun worker {what}: {' '.join(cmd)}\n--- stdout ---\n{_tail(out)}\n--- stderr ---\n{_tail(err)}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    out = {}
    for name, kw in CASES.items():
        model = make_hf_model_dir(root / name, init_std=0.2, **kw)
        ref = make_hf_model_dir(root / f"{name}-ref", init_std=0.18, **kw)
        out[name] = (model, ref)
    return out


@pytest.fixture(scope="module")
def tp2(dirs, tmp_path_factory):
    """Run the worker once under torchrun for all cases; {case: result dict saved by rank 0}."""
    out_dir = tmp_path_factory.mktemp("tp2_out")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(TP),
           str(WORKER), "--tp", str(TP), "--out", str(out_dir)]
    for name, (model, ref) in dirs.items():
        cmd += ["--case", name, model, ref]
    proc = _run_torchrun(cmd)
    results = {}
    for name in dirs:
        path = out_dir / f"{name}.pt"
        assert path.exists(), f"worker wrote no {path}\n--- stdout ---\n{_tail(proc.stdout)}"
        results[name] = torch.load(path, weights_only=False)
    return results


@pytest.fixture(scope="module")
def tp1(dirs, dist_cpu):
    """The same quantities in-process at TP=1."""
    dist_cpu.init_model_parallel(1, 1, seed=0)
    return {name: tp_parity_quantities(model, ref) for name, (model, ref) in dirs.items()}


def _hf_reference(model_dir: str, ref_dir: str) -> dict:
    """An independent computation: transformers models (eager, fp32) + autograd of the same GRPO
    micro-batch loss TriModelActor.train_micro_step builds (on-policy, so old_logp = logp.detach())."""
    from periodic_async import algo
    from periodic_async.actor.logprobs import logprobs_entropy_full
    cfg = helpers.actor_config()
    policy, ref = helpers.load_hf_model(model_dir), helpers.load_hf_model(ref_dir)
    ids = helpers.fixed_input_ids(policy.config.vocab_size)
    with torch.no_grad():
        logits = policy(ids).logits
    mb = helpers.fixed_micro_batch()
    t = helpers.TEMPERATURE
    logp, ent = logprobs_entropy_full(policy(mb.input_ids).logits / t, mb.labels)
    with torch.no_grad():
        ref_logp, _ = logprobs_entropy_full(ref(mb.input_ids).logits / t, mb.labels, False)
    agg = lambda x: algo.aggregate(x, mb.loss_mask, cfg.loss_agg_mode, helpers.NORMALISER)  # noqa: E731
    pg_tok, clipped = algo.clipped_pg_loss(logp, logp.detach(), mb.advantages, cfg.clip_ratio)
    pg, kl, entropy = agg(pg_tok), agg(algo.kl_penalty(logp, ref_logp, cfg.kl_type)), agg(ent)
    loss = pg + cfg.kl_coef * kl - cfg.entropy_coef * entropy
    loss.backward()
    metrics = {"actor/pg_loss": pg.item(), "actor/pg_clipfrac": agg(clipped.float()).item(),
               "actor/kl_loss": kl.item(), "actor/entropy": entropy.item(), "actor/loss": loss.item()}
    grads = {n: p.grad for n, p in policy.named_parameters()}
    if policy.config.tie_word_embeddings:
        grads.pop("lm_head.weight", None)
    return {"logits": logits, "metrics": metrics, "grads": grads}


def _assert_logits_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, (what, got.shape, want.shape)
    scale = float(want.abs().max())
    err = float((got - want).abs().max())
    assert err <= LOGIT_TOL * scale, f"{what}: max |diff| = {err:.3g} (logit scale {scale:.3g})"


def _assert_metrics_close(got: dict, want: dict, what: str) -> None:
    assert set(want) <= set(got), (what, sorted(got), sorted(want))
    bad = {k: (got[k], want[k]) for k in want
           if not torch.isclose(torch.tensor(got[k], dtype=torch.float64), torch.tensor(want[k], dtype=torch.float64),
                                rtol=METRIC_RTOL, atol=METRIC_ATOL)}
    assert not bad, f"{what}: metrics differ (got, want): {bad}"


def _assert_grads_close(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), (what, sorted(set(got) ^ set(want)))
    bad = []
    for n, w in want.items():
        g = got[n]
        assert g.shape == w.shape, (what, n, g.shape, w.shape)
        assert float(w.abs().max()) > 0, f"{what}: {n} has an all-zero gradient"
        scale = float(w.abs().max())
        if not torch.allclose(g, w, rtol=GRAD_RTOL, atol=GRAD_ATOL_REL * scale):
            err = (g - w).abs()
            bad.append(f"{n}: max|diff|={float(err.max()):.3g} max|grad|={scale:.3g} "
                       f"max|diff|/max|grad|={float(err.max()) / scale:.3g}")
    assert not bad, f"{what}: gradients differ:\n" + "\n".join(bad)


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_equals_tp1_and_transformers(case, dirs, tp1, tp2):
    model_dir, ref_dir = dirs[case]
    one, two = tp1[case], tp2[case]
    assert (one["tp"], two["tp"]) == (1, TP)

    # the TP=2 export (gathered shards, fc1 regrouped, qkv split) is the source checkpoint, bit for bit
    from periodic_async.models.convert import SafetensorsReader
    reader = SafetensorsReader(model_dir)
    for res in (one, two):
        for n, t in res["weights"].items():
            assert torch.equal(t, reader(n)), (res["tp"], n)
    assert sorted(two["weights"]) == sorted(one["weights"])

    # logits: megatron's gather == a plain all_gather; TP=2 == TP=1 == transformers
    assert torch.equal(two["logits_mc"], two["logits"])
    hf = _hf_reference(model_dir, ref_dir)
    _assert_logits_close(one["logits"], hf["logits"], "TP=1 vs transformers")
    _assert_logits_close(two["logits"], hf["logits"], "TP=2 vs transformers")
    _assert_logits_close(two["logits"], one["logits"], "TP=2 vs TP=1")

    # vocab-parallel log-probs / entropy on those logits
    for key in ("logp", "entropy", "entropy_metric"):
        torch.testing.assert_close(two[key], one[key], rtol=1e-5, atol=2e-5, msg=lambda m: f"{key}: {m}")
    for res in (one, two):     # the metric-only entropy: the same values, no autograd graph
        torch.testing.assert_close(res["entropy_metric"], res["entropy"], rtol=1e-5, atol=2e-5)
        assert res["entropy_metric_grad"] is False

    # loss terms and the global grad norm
    _assert_metrics_close(two["metrics"], one["metrics"], "TP=2 vs TP=1")
    _assert_metrics_close(one["metrics"], hf["metrics"], "TP=1 vs transformers")
    assert one["metrics"]["actor/kl_loss"] > 1e-3         # the KL term is live
    assert one["metrics"]["actor/grad_norm"] > 0
    full_norm = torch.cat([g.double().flatten() for g in one["grads"].values()]).norm().item()
    # the norm is Megatron's get_grad_norm_fp32: squares summed and reduced in fp32 (HCCL has no
    # float64): ~1e-7 relative error against the float64 norm of the full gradient
    assert one["metrics"]["actor/grad_norm"] == pytest.approx(full_norm, rel=1e-6)

    # full HF-layout gradients
    assert two["replicated_grad_max_diff"] == 0.0          # norms: same gradient on every TP rank
    _assert_grads_close(two["grads"], one["grads"], "TP=2 vs TP=1")
    _assert_grads_close(one["grads"], hf["grads"], "TP=1 vs transformers")
