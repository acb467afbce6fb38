"""Every training mode x every producer plug-in, through the one producer core and one train loop
(torchtitan's feature matrix): each cell trains; every eta-0 cell (sync_split, periodic, async with
max_staleness 0) equals `sync` with the same plug-ins - the same group sizes, allocation decisions,
losses and parameters; an async cell with eta 2 keeps its staleness bound. The one combination the
config refuses (async eta > 0 with pilot / backfill) is checked to be refused with its reason.

Plug-ins: group sizing fixed | sagc, selection none | pilot | backfill, and the shared-prompt
attention on for the plain cells. Runs are tiny (3 steps of 8 prompts, the long_tail task, whose
partial-credit rewards make pilots of every verdict and equal-reward groups for backfill).
"""
import sys

import pytest

from periodic_async.config import ConfigError, load_config
from periodic_async.train.trainer import Trainer

from test_allocation_training import BASE, LOSS_KEYS, SWITCHES, _assert_same_training, _decisions

STEPS = 3
MODES = {
    "sync": ["trainer.mode=sync"],
    "sync_split": ["trainer.mode=sync_split", "rollout.num_workers=1", "rollout.cpu_cores=split"],
    "periodic": ["trainer.mode=periodic", "rollout.num_workers=2", "rollout.arrival_jitter_s=0.01"],
    "async0": ["trainer.mode=async", "trainer.max_staleness=0", "rollout.num_workers=2",
               "rollout.arrival_jitter_s=0.01"],
    "async2": ["trainer.mode=async", "trainer.max_staleness=2", "rollout.num_workers=2"],
}
SAGC = ["rollout.group_sizing=sagc"]
PLUGINS = {
    "fixed-none": [],
    "fixed-pilot": SWITCHES["pilot"],
    "fixed-backfill": SWITCHES["backfill"],
    "sagc-none": SAGC + ["rollout.sagc.candidates=[2, 4]"],
    # K > n_pilot = 2, and K = 3 budgets B * 3 = 24 rollouts: 10 pilots of 2 leave room for commits
    "sagc-pilot": SWITCHES["pilot"] + SAGC + ["rollout.sagc.candidates=[3, 4]", "rollout.pilot.num_candidates=10"],
    "sagc-backfill": SWITCHES["backfill"] + SAGC + ["rollout.sagc.candidates=[2, 4]"],   # starts at n = 2
    "fixed-none-shared": ["actor.shared_prompt=true"],
    "sagc-none-shared": SAGC + ["rollout.sagc.candidates=[2, 4]", "actor.shared_prompt=true"],
}
REFUSED = {("async2", "fixed-pilot"), ("async2", "fixed-backfill"), ("async2", "sagc-pilot"),
           ("async2", "sagc-backfill")}
CELLS = [(m, p) for m in MODES if m != "sync" for p in PLUGINS if (m, p) not in REFUSED]


def _cfg(run_dir, mode, plugin):
    return load_config("configs/long_tail.yaml", [f"trainer.run_dir={run_dir}", f"trainer.total_steps={STEPS}",
                                                  *BASE, *MODES[mode], *PLUGINS[plugin]])


def _train(run_dir, mode, plugin):
    trainer = Trainer(_cfg(run_dir, mode, plugin))
    history = trainer.fit()
    params = {n: p.detach().clone() for n, p in trainer.actor.policy.named_parameters()}
    return history, params


_SYNC: dict = {}


@pytest.fixture
def sync_reference(tmp_path_factory):
    def get(plugin):
        if plugin not in _SYNC:
            _SYNC[plugin] = _train(tmp_path_factory.mktemp(f"sync-{plugin}"), "sync", plugin)
        return _SYNC[plugin]
    return get


def _sagc(h):
    return {k: v for k, v in h.items() if k.startswith("sagc/")}


@pytest.mark.parametrize("mode, plugin", CELLS, ids=[f"{m}-{p}" for m, p in CELLS])
def test_cell_trains_and_keeps_its_promise(mode, plugin, sync_reference, tmp_path):
    history, params = _train(tmp_path, mode, plugin)
    assert len(history) == STEPS
    stale = [h["training/off_policy/trajectory_staleness/max"] for h in history]
    if mode == "async2":
        assert max(stale) <= 2, stale
        if plugin.startswith("sagc"):
            assert all("sagc/group_size" in h for h in history)
        return
    assert max(stale) == 0, stale
    ref_history, ref_params = sync_reference(plugin)
    _assert_same_training(history, params, ref_history, ref_params)
    for step, (h, r) in enumerate(zip(history, ref_history), 1):
        assert _sagc(h) == _sagc(r), f"step {step}: the group sizer decided differently"
    if plugin.startswith("sagc"):
        assert all("sagc/group_size" in h for h in history)


@pytest.mark.parametrize("mode, plugin", sorted(REFUSED))
def test_refused_cell_says_why(mode, plugin, tmp_path):
    with pytest.raises(ConfigError, match="not supported with trainer.mode async and trainer.max_staleness > 0"):
        _cfg(tmp_path, mode, plugin).validate(world_size=1)


# ---------------------------------------------------------------------- DP = 2 under torchrun
# One cell of each mode with two trainer ranks (periodic's is in test_tri_model.py): the same
# decisions as single-process sync with the same plug-ins, and its losses up to DP's summation order.
DP2_CELLS = [("sync", "sagc-none"), ("sync_split", "fixed-backfill"), ("async0", "fixed-pilot"),
             ("async2", "sagc-none")]


@pytest.mark.parametrize("mode, plugin", DP2_CELLS, ids=[f"{m}-{p}" for m, p in DP2_CELLS])
def test_dp2_cell_under_torchrun(mode, plugin, sync_reference, tmp_path):
    from periodic_async.telemetry.logger import read_metrics
    from test_tensor_parallel import _run_torchrun
    run_dir = tmp_path / "dp2"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "periodic_async", "--config", "configs/long_tail.yaml", f"trainer.run_dir={run_dir}",
           f"trainer.total_steps={STEPS}", *BASE, *MODES[mode], *PLUGINS[plugin]]
    _run_torchrun(cmd, timeout=400)
    par = read_metrics(str(run_dir))
    assert [r["step"] for r in par] == list(range(1, STEPS + 1))
    stale = [r["training/off_policy/trajectory_staleness/max"] for r in par]
    if mode == "async2":
        assert max(stale) <= 2, stale
        return
    assert max(stale) == 0, stale
    ref_history, _ = sync_reference(plugin)
    for step, (p, r) in enumerate(zip(par, ref_history), 1):
        p, r = dict(p), dict(r)
        # summed in arrival order
        assert p.pop("alloc/score_all/mean", 0.0) == pytest.approx(r.pop("alloc/score_all/mean", 0.0), rel=1e-12)
        assert _decisions(p) == _decisions(r) and _sagc(p) == _sagc(r), f"step {step}: decided differently"
        for k in LOSS_KEYS:
            assert p[k] == pytest.approx(r[k], rel=1e-4, abs=2e-5), f"step {step} {k}: {p[k]} vs {r[k]}"
