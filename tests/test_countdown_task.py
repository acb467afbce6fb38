"""The countdown synthetic task (data/synthetic.py), the binary `exact` reward, and the tiny
model's per-task alphabet: records, lengths set by the prompt, hand-checked scores, and that the
other tasks keep today's vocabulary (so today's models and numbers)."""
import collections

import pytest

from periodic_async.config import load_config
from periodic_async.config.loading import ConfigError
from periodic_async.config.sections import Config, SyntheticTaskConfig
from periodic_async.data.synthetic import LETTERS, answer_for, make_records, tiny_alphabet
from periodic_async.models.tiny import tiny_arch
from periodic_async.models.tokenizer import DEFAULT_ALPHABET
from periodic_async.reward.manager import BUILTIN_REWARDS
from periodic_async.reward.synthetic import compute_score, exact_score


def test_answers_count_down_from_the_letter_before_the_equals_sign():
    assert answer_for("countdown", "c-g") == "gfedc"
    assert answer_for("countdown", "e-e") == "e"
    assert answer_for("countdown", "a-z") == LETTERS[::-1]


def test_records_are_deterministic_well_formed_and_long_tailed():
    cfg = SyntheticTaskConfig(task="countdown", size=4000, long_tail_max=26, long_tail_alpha=1.5)
    records = make_records(cfg, seed=5)
    assert [(r.prompt, r.answer) for r in records] == [(r.prompt, r.answer) for r in make_records(cfg, seed=5)]
    for r in records:
        last, dash, first, eq = r.prompt
        assert dash == "-" and eq == "=" and last <= first
        assert r.answer == answer_for("countdown", r.prompt[:-1])
        assert len(r.answer) == ord(first) - ord(last) + 1          # the length is set by the prompt
    lengths = collections.Counter(len(r.answer) for r in records)
    assert max(lengths) <= 26 and lengths[1] > lengths[2] > lengths[4] > lengths[8] > 0
    assert sorted(lengths.elements())[len(records) // 2] <= 2       # median 1-2, tail to 20+
    assert max(lengths) >= 20
    assert len({r.prompt for r in records}) > 150                  # many distinct prompts


@pytest.mark.parametrize("response, score", [("gfedc", 1.0), (" gfedc\n", 1.0), ("gfed", 0.0), ("gfedcb", 0.0),
                                             ("", 0.0), ("x", 0.0)])
def test_the_exact_reward_is_binary(response, score):
    assert exact_score(response, "gfedc") == score
    assert BUILTIN_REWARDS["exact"] == ("periodic_async.reward.synthetic", "exact_score")


def test_the_shaped_reward_gives_letter_answers_format_credit_for_a_letter_only():
    assert compute_score("x", "gfedc") == 0.1 and compute_score("7", "gfedc") == 0.0
    assert compute_score("g", "gfedc") == pytest.approx(0.1 + 0.2 / 5 + 0.2 / 5)
    # digit answers: unchanged (a digit earns the format credit, a letter does not)
    assert compute_score("3", "7") == 0.1 and compute_score("x", "7") == 0.0
    assert compute_score("3777", "7777") == 0.1


def test_only_countdown_extends_the_tiny_models_alphabet():
    base = Config()
    assert tiny_alphabet(base.data) == DEFAULT_ALPHABET
    cd = load_config("configs/countdown.yaml", [])
    assert tiny_alphabet(cd.data) == DEFAULT_ALPHABET + LETTERS
    assert tiny_arch(base.model.tiny).vocab_size == 24                          # today's vocabulary
    assert tiny_arch(cd.model.tiny, tiny_alphabet(cd.data)).vocab_size == 48


def test_countdown_lengths_past_the_alphabet_are_refused():
    cfg = load_config("configs/countdown.yaml", ["data.synthetic.long_tail_max=27"])
    with pytest.raises(ConfigError, match="data.synthetic.long_tail_max: countdown answers are at most 26"):
        cfg.validate(world_size=1, num_heads=2, num_kv_heads=2, vocab_size=48, num_layers=2)


def test_reverse_answers_are_the_prompt_backwards():
    assert answer_for("reverse", "qzbk") == "kbzq"
    assert answer_for("reverse", "e") == "e"


def test_reverse_records_are_distinct_letters_long_tailed_and_rarely_repeated():
    cfg = SyntheticTaskConfig(task="reverse", size=4000, long_tail_max=26, long_tail_alpha=1.5)
    records = make_records(cfg, seed=5)
    assert [(r.prompt, r.answer) for r in records] == [(r.prompt, r.answer) for r in make_records(cfg, seed=5)]
    assert [r.prompt for r in records] != [r.prompt for r in make_records(cfg, seed=6)]
    for r in records:
        body = r.prompt[:-1]
        assert r.prompt[-1] == "=" and set(body) <= set(LETTERS) and len(set(body)) == len(body)
        assert r.answer == body[::-1]
    lengths = collections.Counter(len(r.answer) for r in records)
    assert max(lengths) <= 26 and lengths[1] > lengths[2] > lengths[4] > lengths[8] > 0
    assert sorted(lengths.elements())[len(records) // 2] <= 2 and max(lengths) >= 20
    # unlike countdown's 351, prompts of 3+ letters are almost never repeated: held-out ones are new
    long = [r.prompt for r in records if len(r.prompt) >= 4]
    assert len(set(long)) >= 0.98 * len(long)


def test_reverse_uses_the_letter_alphabet_and_refuses_lengths_past_it():
    cfg = load_config("configs/reverse_warm.yaml", [])
    assert cfg.data.synthetic.task == "reverse" and cfg.reward.name == "exact"
    assert tiny_alphabet(cfg.data) == DEFAULT_ALPHABET + LETTERS
    bad = load_config("configs/reverse_warm.yaml", ["data.synthetic.long_tail_max=27"])
    with pytest.raises(ConfigError, match="data.synthetic.long_tail_max: reverse answers are at most 26"):
        bad.validate(world_size=1, num_heads=2, num_kv_heads=2, vocab_size=48, num_layers=2)
