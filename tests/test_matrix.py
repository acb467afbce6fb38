"""Every training mode x every producer plug-in, through the one producer core and one train loop
(torchtitan's feature matrix): each cell trains; every eta-0 cell (sync_split, periodic, async with
max_staleness 0) equals `sync` with the same plug-ins - the same group sizes, allocation decisions,
losses and parameters; an async cell with eta 2 keeps its staleness bound (with pilot / backfill
too: the selection rule's steps overlap). No cell is refused.

Plug-ins: group sizing fixed | sagc, selection none | pilot | backfill, and the shared-prompt
attention on for the plain cells (with sagc under a token budget: actor.micro_batch_tokens packs
whole groups of varying K). Runs are tiny (3 steps of 8 prompts, the long_tail task, whose
partial-credit rewards make pilots of every verdict and equal-reward groups for backfill).
"""
import sys

import pytest

from periodic_async.config import ConfigError, load_config
from periodic_async.train.trainer import Trainer

from helpers import stop_after_step
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
    # a group is at most 48 + 4 x 8 = 80 tokens: 2 per micro-batch at the most
    "sagc-none-shared": SAGC + ["rollout.sagc.candidates=[2, 4]", "actor.shared_prompt=true",
                                "actor.micro_batch_tokens=170"],
}
CELLS = [(m, p) for m in MODES if m != "sync" for p in PLUGINS]


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
        if "pilot" in plugin or "backfill" in plugin:     # the rule decided in every step
            assert all(_decisions(h) for h in history)
        return
    assert max(stale) == 0, stale
    ref_history, ref_params = sync_reference(plugin)
    _assert_same_training(history, params, ref_history, ref_params)
    for step, (h, r) in enumerate(zip(history, ref_history), 1):
        assert _sagc(h) == _sagc(r), f"step {step}: the group sizer decided differently"
    if plugin.startswith("sagc"):
        assert all("sagc/group_size" in h for h in history)


# ---------------------------------------------------------------------- a new selection rule
# A rule is one file that registers a name (scheduling/selection/); this one lives in the test: it
# draws B prompts, sends each a full group of K and trains only the groups whose mean reward
# reaches a threshold (a per-group verdict, so arrival order cannot change it). Its state is keyed
# by step; it counts what it dropped and saves that count in checkpoints.
from periodic_async.scheduling.alloc_types import FULL, AllocRequest, Outcome, TrainableGroup  # noqa: E402
from periodic_async.scheduling.selection import SELECTIONS, register_selection  # noqa: E402


class MeanRewardFloor:
    floor = 0.05

    def __init__(self, batch_size: int, group_size: int):
        self.batch_size, self.group_size = batch_size, group_size
        self._steps: dict[int, dict] = {}       # step -> {slot: (key, K)}, {"dropped": n}
        self.dropped_total = 0

    def begin_step(self, step, draw, group_size=None):
        k = group_size or self.group_size
        slots = {}
        for slot in range(self.batch_size):
            got = draw()
            if got is None:
                break
            slots[slot] = (got.key, k)
        self._steps[step] = {"slots": slots, "dropped": 0, "open": set(slots)}
        return [AllocRequest(s, key, FULL, k, tuple(range(k))) for s, (key, k) in slots.items()]

    def on_group(self, step, slot, phase, rewards):
        st = self._steps[step]
        st["open"].discard(slot)
        key, k = st["slots"][slot]
        ready = []
        if sum(rewards) / len(rewards) >= self.floor:
            ready = [TrainableGroup(slot, key, k, (AllocRequest(slot, key, FULL, k, tuple(range(k))),), tuple(rewards))]
        else:
            st["dropped"] += 1
        return Outcome(ready=ready, done=not st["open"])

    def end_step(self, step):
        st = self._steps.pop(step)
        self.dropped_total += st["dropped"]
        return {"alloc/test_floor_dropped": float(st["dropped"])}

    def state_dict(self):
        return {"dropped_total": self.dropped_total}

    def load_state_dict(self, state):
        self.dropped_total = state["dropped_total"]


if "test_mean_reward_floor" not in SELECTIONS:
    register_selection("test_mean_reward_floor")(
        lambda rollout_cfg, batch_size, group_size, num_prompts: MeanRewardFloor(batch_size, group_size))
PLUGINS["fixed-floor"] = ["rollout.selection=test_mean_reward_floor"]


@pytest.mark.parametrize("mode", ["sync_split", "periodic", "async0", "async2"])
def test_a_selection_rule_registered_in_a_test_runs_in_every_mode(mode, sync_reference, tmp_path):
    """The rule above runs through the producer core in sync (the reference) and every other
    mode; each eta-0 mode equals sync (the same groups dropped, losses and parameters), and with
    eta 2 its steps overlap within the bound."""
    ref_history, ref_params = sync_reference("fixed-floor")
    dropped = [h["alloc/test_floor_dropped"] for h in ref_history]
    assert 0 < sum(dropped) < 8 * STEPS, dropped        # the rule acted, and left something to train
    history, params = _train(tmp_path, mode, "fixed-floor")
    if mode == "async2":
        assert len(history) == STEPS and all("alloc/test_floor_dropped" in h for h in history)
        assert max(h["training/off_policy/trajectory_staleness/max"] for h in history) <= 2
        return
    _assert_same_training(history, params, ref_history, ref_params)
    assert [h["alloc/test_floor_dropped"] for h in history] == dropped


def test_an_unknown_selection_rule_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="rollout.selection: unknown rule 'nonesuch'; registered: .*backfill"):
        Trainer(load_config("configs/default.yaml", [f"trainer.run_dir={tmp_path}", "rollout.selection=nonesuch"]))


# ---------------------------------------------------------------------- DP = 2 under torchrun
# One cell of each mode with two trainer ranks (periodic's is in test_tri_model.py): the same
# decisions as single-process sync with the same plug-ins, and its losses up to DP's summation order.
DP2_CELLS = [("sync", "sagc-none"), ("sync_split", "fixed-backfill"), ("async0", "fixed-pilot"),
             ("async2", "sagc-none"), ("periodic", "sagc-none-shared")]


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


def test_async2_with_backfill_stopped_and_resumed_loses_and_repeats_no_prompt(tmp_path, monkeypatch):
    """eta 2 with backfill, stopped after step 2 while later batches (and their backfills) are in
    flight, then resumed: the checkpoint kept the prompts those batches drew (plan.py `redraw`), so
    the prompts requested by steps 1-2 of the first run and steps 3-5 of the resumed one are
    exactly the first ones of the loader's order, each once."""
    import copy

    from periodic_async.scheduling.plan import AllocatedPlan
    from periodic_async.train.stop import STOP
    requested = []                      # (run, step, record index) of every request of a drawn prompt
    run = [0]
    to_request = AllocatedPlan.to_request

    def recording(self, req):
        requested.append((run[0], self.step, req.key))
        return to_request(self, req)
    monkeypatch.setattr(AllocatedPlan, "to_request", recording)
    overrides = [f"trainer.run_dir={tmp_path}", *BASE, *MODES["async2"], *PLUGINS["fixed-backfill"],
                 "trainer.total_steps=5", "trainer.save_every=1"]
    trainer = Trainer(load_config("configs/long_tail.yaml", overrides))
    loader = copy.deepcopy(trainer.planner.loader)
    order = [loader.next_batch(1)[0].index for _ in range(200)]
    stop_after_step(trainer, 2)
    try:
        with pytest.raises(KeyboardInterrupt, match="stopped after step 2"):
            trainer.fit()
    finally:
        STOP.requested = False
    assert any(s > 2 for r, s, _ in requested), "no later batch was in flight at the stop"
    run[0] = 1
    history = Trainer(load_config("configs/long_tail.yaml", overrides)).fit()
    assert len(history) == 3
    kept = [k for r, s, k in requested if (r, s <= 2) in ((0, True), (1, False))]
    assert sorted(kept) == sorted(order[:len(kept)]), "a prompt was lost or drawn twice"
    assert sum(h["rollout/backfilled"] for h in history) > 0       # backfills drew during the steps
