"""Prompt rendering (data/prompts.py): the prompt template, the tokenizer's chat template (ids
checked against apply_chat_template itself), the length limit's three modes, the planner's
replacement of skipped prompts, and the Trainer using it all."""
import pytest

from periodic_async.config import ConfigError, DataConfig, load_config
from periodic_async.data import prompts
from periodic_async.data.dataset import PromptLoader, load_records
from periodic_async.data.gsm8k_task import PROMPT_SUFFIX
from periodic_async.data.records import DatasetError, PromptRecord
from periodic_async.models.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer, load_tokenizer, mark_char_tokenizer
from periodic_async.rollout.base import SamplingParams
from periodic_async.scheduling.plan import BatchPlanner

# Qwen2.5's layout, in plain characters the char tokenizer encodes one by one
QWEN_LIKE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
             "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ<|>_\n.'\""


def _save(tok, path, chat_template=None) -> str:
    """Save as a model directory would hold it and reload the way the Trainer does."""
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.save_pretrained(str(path))
    mark_char_tokenizer(str(path))
    return str(path)


@pytest.fixture
def chat_tok(tmp_path):
    tok = load_tokenizer(_save(build_char_tokenizer(DEFAULT_ALPHABET + LETTERS), tmp_path / "chat", QWEN_LIKE))
    assert tok.chat_template == QWEN_LIKE
    return tok


@pytest.fixture
def plain_tok(tmp_path):
    tok = load_tokenizer(_save(build_char_tokenizer(DEFAULT_ALPHABET + LETTERS), tmp_path / "plain"))
    assert tok.chat_template is None
    return tok


def _rec(prompt: str, index: int = 0) -> PromptRecord:
    return PromptRecord(prompt, "1", index)


def _chat_ids(tok, messages) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
    return list(out["input_ids"])


def test_chat_template_ids_equal_apply_chat_template(chat_tok):
    r = prompts.build(DataConfig(max_prompt_length=200), chat_tok)
    ids = r.render(_rec("What is 2+2?"))
    assert ids == _chat_ids(chat_tok, [{"role": "user", "content": "What is 2+2?"}])
    assert chat_tok.decode(ids) == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert chat_tok.unk_token_id not in ids

    r = prompts.build(DataConfig(max_prompt_length=200, system_prompt="Be brief."), chat_tok)
    ids = r.render(_rec("What is 2+2?"))
    assert ids == _chat_ids(chat_tok, [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "What is 2+2?"}])
    assert chat_tok.decode(ids).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")


def test_prompt_template_goes_inside_the_user_message(chat_tok):
    cfg = DataConfig(max_prompt_length=200, prompt_template="Q: {prompt}\nAnswer after \"####\".")
    ids = prompts.build(cfg, chat_tok).render(_rec("1+1?"))
    assert ids == _chat_ids(chat_tok, [{"role": "user", "content": "Q: 1+1?\nAnswer after \"####\"."}])


def test_no_chat_template_is_the_raw_text(chat_tok, plain_tok):
    text = "Q: 1+1?"
    raw = chat_tok(text, add_special_tokens=False).input_ids
    cfg = DataConfig(max_prompt_length=200, prompt_template="Q: {prompt}", chat_template="none")
    assert prompts.build(cfg, chat_tok).render(_rec("1+1?")) == raw
    # auto on a tokenizer that has no chat template (the embedded run's char tokenizer)
    cfg = DataConfig(max_prompt_length=200, prompt_template="Q: {prompt}", chat_template="auto")
    assert prompts.build(cfg, plain_tok).render(_rec("1+1?")) == plain_tok(text, add_special_tokens=False).input_ids
    assert prompts.build(DataConfig(), build_char_tokenizer()).render(_rec("12=")) == [
        build_char_tokenizer().convert_tokens_to_ids(c) for c in "12="]
    with pytest.raises(ConfigError, match="data.system_prompt: the model's tokenizer has no chat template"):
        prompts.build(DataConfig(system_prompt="Be brief."), plain_tok)


def test_gsm8k_source_default_template_is_the_hash_instruction(plain_tok):
    cfg = DataConfig(source="gsm8k", max_prompt_length=2000)
    rec = load_records(cfg)[0]
    assert not rec.prompt.endswith(PROMPT_SUFFIX)        # the record is the question as it is
    ids = prompts.build(cfg, plain_tok).render(rec)
    assert ids == plain_tok(rec.prompt + PROMPT_SUFFIX, add_special_tokens=False).input_ids
    # the configs' explicit template is the same one (no doubled instruction)
    explicit = load_config("configs/qwen2.5-0.5b-gpu.yaml").data.prompt_template
    assert explicit.format(prompt="Q") == "Q" + PROMPT_SUFFIX


@pytest.mark.parametrize("template, message", [
    ("Answer this:", "must contain {prompt}"),
    ("{prompt} {answer}", "KeyError"),
    ("{prompt} \\boxed{}", "IndexError"),
    ("{prompt", "ValueError"),
])
def test_bad_prompt_template_is_a_config_error(template, message):
    with pytest.raises(ConfigError, match="data.prompt_template") as e:
        load_config("configs/default.yaml", [f"data.prompt_template={template!r}"]).validate()
    assert message in str(e.value)
    with pytest.raises(ConfigError, match="data.prompt_template"):
        prompts.build(DataConfig(prompt_template=template), build_char_tokenizer())
    # literal braces, doubled, are allowed
    load_config("configs/default.yaml", ["data.prompt_template='{prompt} \\boxed{{}}'"]).validate()


@pytest.mark.parametrize("override, message", [
    ("data.chat_template=qwen", "data.chat_template: 'qwen' is not allowed; allowed: auto, none"),
    ("data.overlong_prompt=cut", "data.overlong_prompt: 'cut' is not allowed; allowed: error, skip, truncate_left"),
])
def test_prompt_choices_validated(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/default.yaml", [override]).validate()
    with pytest.raises(ConfigError, match="data.system_prompt: a system prompt needs a chat template"):
        load_config("configs/default.yaml", ["data.chat_template=none", "data.system_prompt=hi"]).validate()


def test_overlong_prompt_modes(chat_tok):
    long_rec = PromptRecord("x" * 40, "1", 7)
    n = len(_chat_ids(chat_tok, [{"role": "user", "content": "x" * 40}]))
    with pytest.raises(DatasetError) as e:
        prompts.build(DataConfig(source="jsonl", path="/data/q.jsonl", max_prompt_length=60), chat_tok).render(long_rec)
    assert str(e.value).startswith(f"/data/q.jsonl: row index 7: the prompt has {n} tokens after templating, "
                                   "more than data.max_prompt_length=60")
    with pytest.raises(DatasetError, match="data.source synthetic: record 7: .*data.max_prompt_length=60"):
        prompts.build(DataConfig(max_prompt_length=60), chat_tok).render(long_rec)

    # 51 tokens of template around "x": under the limit; 90 around the long one
    r = prompts.build(DataConfig(max_prompt_length=60, overlong_prompt="truncate_left"), chat_tok)
    full = r.token_ids(long_rec)
    assert len(full) == n == 90
    kept = r.render(long_rec)
    assert kept == full[-60:] and r.render(_rec("x")) == r.token_ids(_rec("x"))
    assert chat_tok.decode(kept).endswith("xx<|im_end|>\n<|im_start|>assistant\n")
    assert r.pop_counts() == {"data/overlong_prompts_skipped": 0, "data/overlong_prompts_truncated": 1}
    assert r.pop_counts()["data/overlong_prompts_truncated"] == 0

    r = prompts.build(DataConfig(max_prompt_length=60, overlong_prompt="skip"), chat_tok)
    assert r.render(long_rec) is None and r.render(_rec("x")) is not None
    assert r.pop_counts() == {"data/overlong_prompts_skipped": 1, "data/overlong_prompts_truncated": 0}


def test_planner_replaces_skipped_prompts_and_keeps_the_batch_size(plain_tok):
    records = [_rec("1" * (20 if i % 3 == 0 else 2), i) for i in range(9)]   # 0, 3, 6 are too long
    r = prompts.build(DataConfig(max_prompt_length=10, overlong_prompt="skip"), plain_tok)
    loader = PromptLoader(records, batch_size=4, shuffle=False)
    planner = BatchPlanner(loader, r.render, SamplingParams(), seed=0, default_n=2)
    plan = planner.plan(1)
    assert plan.num_groups == 4 and [g for g in plan.group_sizes] == [0, 1, 2, 3]
    assert [len(q.prompt_ids) for q in plan.requests] == [2, 2, 2, 2]
    assert r.pop_counts()["data/overlong_prompts_skipped"] == 2            # records 0 and 3
    assert loader.position == 6                                            # 1, 2, 4, 5 taken
    assert len(planner.plan(2).requests) == 4                              # 7, 8, (next epoch) 1, 2
    assert r.pop_counts()["data/overlong_prompts_skipped"] == 2            # 6 and 0

    only_long = PromptLoader([_rec("1" * 20, i) for i in range(3)], batch_size=2)
    with pytest.raises(DatasetError, match="data.overlong_prompt: skip left out every one of the 3 records"):
        BatchPlanner(only_long, r.render, SamplingParams(), seed=0, default_n=2).plan(1)


def test_trainer_renders_prompts_with_the_models_chat_template(tmp_path):
    from helpers import make_hf_model_dir
    from periodic_async.train.trainer import Trainer

    model_dir = make_hf_model_dir(tmp_path / "model", hidden=64, heads=2, kv_heads=2, layers=1, ffn=64)
    # a chat template in characters of the model's own (default) alphabet
    template = ("{% for m in messages %}{{ ('?' if m['role'] == 'system' else ':') + m['content'] + ',' }}"
                "{% endfor %}{% if add_generation_prompt %}{{ '*' }}{% endif %}")
    _save(load_tokenizer(model_dir), model_dir, template)
    cfg = load_config("configs/default.yaml", [
        f"model.path={model_dir}", "trainer.mode=sync", f"trainer.run_dir={tmp_path / 'run'}", "trainer.total_steps=1",
        "trainer.progress_bar=false", "trainer.save_every=0", "data.train_batch_size=2", "rollout.n=2",
        "actor.micro_batch_size=4", "data.prompt_template='{prompt}?'", "data.system_prompt='0'",
        "data.max_prompt_length=14", "data.synthetic.num_digits=4"])
    trainer = Trainer(cfg)
    try:
        tok = load_tokenizer(model_dir)
        records = list(trainer.planner.loader.records)
        plan, _ = trainer.producer.batch(1)
        by_prompt = {tuple(_chat_ids(tok, [{"role": "system", "content": "0"},
                                           {"role": "user", "content": rec.prompt + "?"}])): rec for rec in records}
        for req in plan.requests:
            rec = by_prompt[tuple(req.prompt_ids)]
            assert tok.decode(req.prompt_ids) == f"?0,:{rec.prompt}?,*"
            assert plan.answers[req.group_index] == rec.answer
        metrics = trainer.step(1)
        assert metrics["data/overlong_prompts_skipped"] == 0 and metrics["data/overlong_prompts_truncated"] == 0
    finally:
        trainer.close()
