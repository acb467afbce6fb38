"""tools/warm_start.py: the SFT warm start for RL on countdown. Its loss learns the answer only,
falls in a few steps, never trains on the held-out records, the stop rule fires at the first check
>= target, sampling matches greedy decoding at temperature 0, and the saved directory loads
through the trainer's model.path path (checkpoint check, arch, Megatron load, char tokenizer)
with the trained model's logits."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from helpers import megatron_inputs

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import warm_start as ws  # noqa: E402

from periodic_async.config import load_config  # noqa: E402
from periodic_async.data import prompts as prompt_render  # noqa: E402
from periodic_async.data.dataset import load_records  # noqa: E402
from periodic_async.train.validation import split_validation  # noqa: E402

# a small tiny model and data set: every test here runs in seconds
SMALL = ["data.synthetic.size=400", "data.val_size=32", "model.tiny.hidden_size=32",
         "model.tiny.ffn_hidden_size=64", "model.tiny.num_layers=1"]


@pytest.fixture
def countdown(tmp_path):
    """(config, model, tokenizer, is_char, training pairs, held-out records) of the small countdown."""
    cfg = load_config("configs/countdown.yaml", SMALL)
    torch.manual_seed(0)
    model, tok, is_char = ws.load_start_model(cfg, str(tmp_path / "init"))
    train, val = split_validation(load_records(cfg.data), cfg.data)
    pairs = ws.encode_pairs(train, prompt_render.build(cfg.data, tok), tok)
    return cfg, model, tok, is_char, pairs, val


def test_sft_labels_are_the_answer_and_eos_only(countdown):
    _, _, tok, _, pairs, _ = countdown
    (prompt, answer), = pairs[:1]
    assert tok.decode(prompt) == "".join(tok.decode([i]) for i in prompt) and answer[-1] == tok.eos_token_id
    ids, mask, labels = ws.sft_batch([(prompt, answer), ([prompt[0]], answer[:1])], tok.pad_token_id)
    # row 0: the prompt is given (no loss), the answer + EOS is learnt; row 1 is padded after its 2 tokens
    assert labels[0, :len(prompt)].eq(-100).all() and labels[0, len(prompt):].tolist() == answer
    assert mask[1].tolist() == [1, 1] + [0] * (ids.shape[1] - 2) and labels[1, 2:].eq(-100).all()


def test_sft_loss_falls_in_a_handful_of_steps(countdown):
    _, model, tok, _, pairs, _ = countdown
    batch = pairs[:32]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        loss = ws.sft_loss(model, batch, tok.pad_token_id)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses


def test_the_stop_rule_fires_at_the_first_check_at_or_above_the_target():
    checks = iter([0.0, 0.1, 0.29, 0.3, 0.9])        # before step 1, then after steps 2, 4, 6, 8
    steps = []
    taken, acc, reached = ws.train_until(lambda s: steps.append(s) or 1.0, lambda: next(checks),
                                         target=0.3, eval_every=2, max_steps=100, log=lambda _: None)
    assert (taken, acc, reached) == (6, 0.3, True) and steps == [1, 2, 3, 4, 5, 6]
    # never reached: runs max_steps, says so
    taken, acc, reached = ws.train_until(lambda s: 1.0, lambda: 0.2, target=0.3, eval_every=2,
                                         max_steps=5, log=lambda _: None)
    assert (taken, acc, reached) == (5, 0.2, False)


def test_sampling_at_temperature_zero_is_greedy_decoding(countdown):
    _, model, tok, _, pairs, _ = countdown
    prompts = [p for p, _ in pairs[:3]]
    got = ws.sample_responses(model.eval(), prompts, n=2, temperature=0.0, top_k=-1, top_p=1.0,
                              max_new_tokens=6, eos_id=tok.eos_token_id, seed=0)
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        for _ in range(6):                             # greedy, a full forward per token (no cache)
            nxt = int(model(input_ids=ids).logits[0, -1].argmax())
            if nxt == tok.eos_token_id:
                break
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        assert got[2 * i] == got[2 * i + 1] == ids[0, len(p):].tolist()


def test_main_trains_on_the_training_records_only(tmp_path, monkeypatch):
    cfg = load_config("configs/countdown.yaml", SMALL)
    _, val = split_validation(load_records(cfg.data), cfg.data)
    held_out = {r.prompt for r in val}
    seen = []
    real_loss = ws.sft_loss
    monkeypatch.setattr(ws, "sft_loss", lambda model, pairs, pad: seen.extend(pairs) or real_loss(model, pairs, pad))
    rc = ws.main(["--config", "configs/countdown.yaml", "--out", str(tmp_path / "warm"), "--max-steps", "6",
                  "--eval-every", "3", "--eval-n", "1", "--batch-size", "64", *SMALL, "rollout.max_new_tokens=4"])
    assert rc == 1                                     # 6 steps: the target is not reached, and it says so
    tok = ws.load_tokenizer(str(tmp_path / "warm"))
    trained = {tok.decode(p) for p, _ in seen}
    assert len(seen) == 6 * 64 and trained and not trained & held_out


def test_the_saved_dir_loads_through_model_path_with_the_same_logits(countdown, tmp_path, megatron_tp1):
    from periodic_async.models.convert import check_checkpoint, load_hf_checkpoint
    from periodic_async.models.mcore import arch_from_hf_dir, build_gpt_model
    from periodic_async.models.tokenizer import load_tokenizer
    cfg, model, tok, is_char, pairs, _ = countdown
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):                                 # trained weights, not the random init
        loss = ws.sft_loss(model, pairs[:16], tok.pad_token_id)
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = str(tmp_path / "warm")
    ws.save_model_dir(model, tok, out, is_char)

    # the trainer's steps for model.path (Trainer._read_inputs, _validated_arch, the actor's load)
    check_checkpoint(out)
    arch = arch_from_hf_dir(out)
    cfg.validate(world_size=1, num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads,
                 vocab_size=arch.vocab_size, num_layers=arch.num_layers)
    mcore = build_gpt_model(arch)
    load_hf_checkpoint(mcore, arch, out)
    back = load_tokenizer(out)
    with open(os.path.join(out, "tokenizer_config.json")) as f:   # load_tokenizer's char-tokenizer tag
        assert json.load(f)["periodic_async_char_tokenizer"] is True
    assert back.get_vocab() == tok.get_vocab() and back.eos_token_id == tok.eos_token_id
    ids = torch.tensor([back.encode("c-g=gfedc"), back.encode("a-e=edcba")])
    with torch.no_grad():
        want = model.eval()(input_ids=ids).logits
        got = mcore.eval()(ids, *megatron_inputs(ids))
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())
