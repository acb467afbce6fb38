"""The built-in long_tail synthetic task (data/synthetic.py, reward/synthetic.py): records, the
length distribution, the reward, the config and its errors. Torch-free."""
from pathlib import Path

import numpy as np
import pytest

from periodic_async.config import ConfigError, SyntheticTaskConfig, load_config
from periodic_async.config.validation import validate
from periodic_async.data.synthetic import TASKS, answer_for, long_tail_length_pmf, make_records
from periodic_async.reward.synthetic import compute_score, is_success

ROOT = Path(__file__).resolve().parents[1]
LONG_TAIL_YAML = str(ROOT / "configs" / "long_tail.yaml")


def _task(**kw) -> SyntheticTaskConfig:
    return SyntheticTaskConfig(task="long_tail", **kw)


def test_records_are_deterministic_in_the_seed_and_well_formed() -> None:
    a, b = make_records(_task(size=500), seed=3), make_records(_task(size=500), seed=3)
    assert a == b
    assert a != make_records(_task(size=500), seed=4)
    assert [r.index for r in a] == list(range(500))
    for r in a:
        d, n = r.prompt[-2], len(r.prompt) - 3
        assert d.isdigit() and r.prompt == "*" * n + ":" + d + "="
        assert r.answer == d * n == answer_for("long_tail", r.prompt[:-1])
        assert 1 <= n <= 40
    assert answer_for("long_tail", "***:7") == "777"
    # a smaller tail limit caps the lengths
    assert max(len(r.answer) for r in make_records(_task(size=500, long_tail_max=5), seed=3)) <= 5


def test_target_lengths_are_long_tailed() -> None:
    records = make_records(_task(), seed=1)  # the default size, 4096
    lengths = np.array([len(r.answer) for r in records])
    p50, p90, p99 = np.quantile(lengths, [0.5, 0.9, 0.99])
    assert p50 <= 2 and p90 >= 10 and p99 >= 30
    assert p99 / p50 >= 10
    assert (lengths <= 4).mean() >= 0.65          # most prompts need 1-4 tokens
    assert 0.03 <= (lengths >= 20).mean() <= 0.10  # a few need 20-40
    assert lengths.max() == 40
    # the tail carries a large share of the tokens a batch must generate
    assert lengths[lengths >= 20].sum() / lengths.sum() >= 0.3
    lens, probs = long_tail_length_pmf(40, 1.5)
    assert list(lens) == list(range(1, 41)) and probs.sum() == pytest.approx(1.0)
    assert probs[0] == pytest.approx(1 / sum(n ** -1.5 for n in range(1, 41)))
    assert np.all(np.diff(probs) < 0)
    # alpha 0 is uniform
    assert np.allclose(long_tail_length_pmf(4, 0.0)[1], 0.25)


@pytest.mark.parametrize("response, score", [
    # n = 4: 0.1 + 0.2 * p / 4 + 0.2 * p / max(L, 4), p = common prefix, L = length
    ("7777", 1.0), (" 7777 ", 1.0),                          # exact (whitespace stripped)
    ("7", 0.2), ("77", 0.3), ("777", 0.4),                   # stopped early: share matched
    ("77777", 0.46), ("7777777", 0.1 + 0.2 + 0.8 / 7),       # ran on: the sooner it stops, the more
    ("7" * 48, 0.1 + 0.2 + 0.8 / 48),                        # ran to the limit: every digit still counts
    ("7x" + "x" * 46, 0.1 + 0.05 + 0.2 / 48),                # the right digit, then junk: above a wrong digit
    ("7377", 0.2), ("77737777", 0.1 + 0.15 + 0.6 / 8),       # a wrong digit ends the match
    ("3777", 0.1), ("0", 0.1),                               # wrong first digit: format credit
    ("", 0.0), ("x777", 0.0), ("*", 0.0), ("=7777", 0.0),    # no digit first
])
def test_reward_hand_checked(response: str, score: float) -> None:
    assert compute_score(response, "7777") == pytest.approx(score)
    assert is_success(response, "7777") == (score == 1.0)


def test_reward_long_answer_and_one_digit_answers_unchanged() -> None:
    ans = "5" * 30
    assert compute_score(ans, ans) == 1.0
    assert compute_score("5" * 29, ans) == pytest.approx(0.1 + 0.4 * 29 / 30)
    assert compute_score("5" * 31, ans) == pytest.approx(0.1 + 0.2 + 0.2 * 30 / 31)
    assert compute_score("5" * 48, ans) == pytest.approx(0.1 + 0.2 + 0.2 * 30 / 48)
    # stopping sooner after the answer, and matching more of it, both score higher
    run_on = [compute_score("5" * k, ans) for k in range(31, 49)]
    assert run_on == sorted(run_on, reverse=True)
    short = [compute_score("5" * k, ans) for k in range(1, 30)]
    assert short == sorted(short)
    # partial credit stays below 0.5 < 1.0: success is exact
    assert max(compute_score("5" * k, ans) for k in range(1, 49) if k != 30) < 0.5
    # one-character answers (next_digit, copy_last, sum_mod10, long_tail with n = 1): the old rule
    for response, score in [("3", 1.0), ("3 ", 1.0), ("33", 0.5), ("3+", 0.5), ("34", 0.5),
                            ("4", 0.1), ("43", 0.1), ("", 0.0), ("=", 0.0), ("+3", 0.0)]:
        assert compute_score(response, "3") == score


def test_unknown_task_names_the_key_and_the_allowed_tasks() -> None:
    assert "long_tail" in TASKS
    cfg = load_config(LONG_TAIL_YAML, ["data.synthetic.task=long_tial"])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    msg = str(e.value)
    assert msg.startswith("data.synthetic.task: 'long_tial' is not allowed")
    assert all(t in msg for t in ("next_digit", "copy_last", "sum_mod10", "long_tail"))
    with pytest.raises(ValueError, match=r"data\.synthetic\.task: unknown 'long_tial'; allowed: .*long_tail"):
        make_records(SyntheticTaskConfig(task="long_tial"), seed=1)
    with pytest.raises(ConfigError, match="data.synthetic.long_tail_max: must be >= 1"):
        validate(load_config(LONG_TAIL_YAML, ["data.synthetic.long_tail_max=0"]))
    with pytest.raises(ConfigError, match="data.synthetic.long_tail_alpha: must be >= 0"):
        validate(load_config(LONG_TAIL_YAML, ["data.synthetic.long_tail_alpha=-1"]))


def test_long_tail_config_fits_the_tail() -> None:
    cfg = load_config(LONG_TAIL_YAML)
    task = cfg.data.synthetic
    assert cfg.data.source == "synthetic" and task.task == "long_tail" and cfg.reward.name == "synthetic"
    assert cfg.rollout.max_new_tokens > task.long_tail_max
    longest_prompt = max(len(r.prompt) for r in make_records(task, seed=cfg.data.seed))
    assert longest_prompt == task.long_tail_max + 3 <= cfg.data.max_prompt_length
    assert longest_prompt + cfg.rollout.max_new_tokens <= cfg.model.tiny.max_position_embeddings
    assert set("".join(r.prompt + r.answer for r in make_records(task, seed=1))) <= set("0123456789:*=")
