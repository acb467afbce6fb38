"""Dataset readers, the GSM8K sample and PromptLoader: exact error locations and resumable order."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from periodic_async.config import DataConfig, SyntheticTaskConfig
from periodic_async.data.dataset import (DatasetError, PromptLoader, PromptRecord, load_records, read_hf,
                                         read_jsonl, read_parquet)
from periodic_async.data.gsm8k_task import extract_gsm8k_answer, format_gsm8k_prompt, sample_path


def _write_lines(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def _records(n: int) -> list[PromptRecord]:
    return [PromptRecord(prompt=f"p{i}", answer=str(i), index=i) for i in range(n)]


# ---------------------------------------------------------------- jsonl

def test_jsonl_round_trip_skips_blank_lines_and_stringifies(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "x.jsonl", [
        json.dumps({"q": "one?", "a": "1", "extra": True}),
        "",
        "   ",
        json.dumps({"q": "two?", "a": 2}),
    ])
    assert read_jsonl(path, "q", "a") == [PromptRecord("one?", "1", 0), PromptRecord("two?", "2", 1)]


def test_jsonl_missing_key_names_file_line_and_key(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "x.jsonl", [
        json.dumps({"question": "a", "answer": "1"}),
        "",
        json.dumps({"question": "b", "id": 7}),
    ])
    with pytest.raises(DatasetError) as e:
        read_jsonl(path, "question", "answer")
    assert str(e.value) == f"{path}:3: missing key 'answer' (keys present: question, id)"


def test_jsonl_invalid_json_names_file_and_line(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "x.jsonl", [json.dumps({"question": "a", "answer": "1"}), '{"question": "b",'])
    with pytest.raises(DatasetError, match=r"^.*x\.jsonl:2: invalid JSON \(") as e:
        read_jsonl(path, "question", "answer")
    assert str(e.value).startswith(f"{path}:2: invalid JSON")


def test_jsonl_rejects_non_object_and_null(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "x.jsonl", ["[1, 2]"])
    with pytest.raises(DatasetError, match="x.jsonl:1: expected a JSON object, got list"):
        read_jsonl(path, "question", "answer")
    path = _write_lines(tmp_path / "y.jsonl", [json.dumps({"question": "a", "answer": None})])
    with pytest.raises(DatasetError, match="y.jsonl:1: 'answer' is null"):
        read_jsonl(path, "question", "answer")


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.jsonl")
    for reader in (read_jsonl, read_parquet, read_hf):
        with pytest.raises(DatasetError, match="nope.jsonl: file not found"):
            reader(missing, "question", "answer")


# ---------------------------------------------------------------- parquet

def test_parquet_round_trip(tmp_path: Path) -> None:
    path = str(tmp_path / "x.parquet")
    pq.write_table(pa.table({"question": ["a", "b"], "answer": [1, 2], "id": [10, 11]}), path)
    assert read_parquet(path, "question", "answer") == [PromptRecord("a", "1", 0), PromptRecord("b", "2", 1)]


def test_parquet_missing_column_and_null_row(tmp_path: Path) -> None:
    path = str(tmp_path / "x.parquet")
    pq.write_table(pa.table({"question": ["a"], "id": [1]}), path)
    with pytest.raises(DatasetError) as e:
        read_parquet(path, "question", "answer")
    assert str(e.value) == f"{path}: missing column 'answer' (columns present: question, id)"

    pq.write_table(pa.table({"question": ["a", "b", "c"], "answer": ["1", None, "3"]}), path)
    with pytest.raises(DatasetError) as e:
        read_parquet(path, "question", "answer")
    assert str(e.value) == f"{path}: row index 1: 'answer' is null"


def test_parquet_corrupt_file(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "x.parquet", ["not parquet"])
    with pytest.raises(DatasetError, match="x.parquet: not a readable Parquet file"):
        read_parquet(path, "question", "answer")


# ---------------------------------------------------------------- hugging face (local only)

def test_hf_save_to_disk_round_trip(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = {"question": ["a", "b"], "answer": ["1", "2"]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "plain"))
    assert read_hf(str(tmp_path / "plain"), "question", "answer") == [PromptRecord("a", "1", 0),
                                                                        PromptRecord("b", "2", 1)]
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows),
                               "test": datasets.Dataset.from_dict({"question": ["t"], "answer": ["9"]})})
    dd.save_to_disk(str(tmp_path / "dict"))
    assert read_hf(str(tmp_path / "dict"), "question", "answer", split="test") == [PromptRecord("t", "9", 0)]
    with pytest.raises(DatasetError, match="no split 'valid' \\(splits present: train, test\\)"):
        read_hf(str(tmp_path / "dict"), "question", "answer", split="valid")


def test_hf_load_dataset_local_file_and_missing_column(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    path = _write_lines(tmp_path / "x.jsonl", [json.dumps({"question": "a", "answer": "1"}),
                                               json.dumps({"question": "b", "answer": "2"})])
    cache = str(tmp_path / "cache")
    assert read_hf(path, "question", "answer", cache_dir=cache) == [PromptRecord("a", "1", 0),
                                                                    PromptRecord("b", "2", 1)]
    with pytest.raises(DatasetError) as e:
        read_hf(path, "question", "solution", cache_dir=cache)
    assert str(e.value) == f"{path}: missing column 'solution' (columns present: question, answer)"


def test_hf_without_datasets_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write_lines(tmp_path / "x.jsonl", [json.dumps({"question": "a", "answer": "1"})])
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(DatasetError, match=r"pip install datasets==\d"):
        read_hf(path, "question", "answer")


# ---------------------------------------------------------------- gsm8k

def _sample_rows() -> list[dict]:
    with open(sample_path(), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_shipped_sample_is_packaged_next_to_the_module() -> None:
    path = Path(sample_path())
    assert path.parent.name == "gsm8k" and path.parent.parent.name == "data"
    assert (path.parent / "LICENSE").read_text().startswith("MIT License")
    rows = _sample_rows()
    assert len(rows) == 200 and all(set(r) == {"question", "answer"} for r in rows)
    assert rows[0]["question"].startswith("Natalia sold clips to 48 of her friends in April")


@pytest.mark.parametrize("row, gold", [(0, "72"), (1, "10"), (3, "42"), (7, "16"), (199, "150")])
def test_extract_gsm8k_answer_on_shipped_rows(row: int, gold: str) -> None:
    assert extract_gsm8k_answer(_sample_rows()[row]["answer"]) == gold


def test_extract_gsm8k_answer_edge_cases() -> None:
    assert extract_gsm8k_answer("a #### 5 then\n#### 1,000 ") == "1000"
    assert extract_gsm8k_answer("#### 1,234,567.5") == "1234567.5"
    assert extract_gsm8k_answer("#### -3") == "-3"
    with pytest.raises(ValueError, match="no '####' marker"):
        extract_gsm8k_answer("the answer is 5")


def test_format_gsm8k_prompt() -> None:
    assert format_gsm8k_prompt("What is 2+2?") == (
        "What is 2+2?\nLet's think step by step and output the final answer after \"####\".")


def test_load_records_gsm8k_extracts_gold_and_keeps_the_question() -> None:
    records = load_records(DataConfig(source="gsm8k"))
    rows = _sample_rows()
    assert len(records) == 200
    assert records[0].answer == "72" and records[199].answer == "150"
    # the '####' instruction is the source's default data.prompt_template (tests/test_prompts.py)
    assert records[0].prompt == rows[0]["question"]
    assert [r.index for r in records] == list(range(200))


def test_load_records_file_sources(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "x.jsonl", [json.dumps({"prompt": "a", "gold": "1"})])
    cfg = DataConfig(source="jsonl", path=path, prompt_key="prompt", answer_key="gold")
    assert load_records(cfg) == [PromptRecord("a", "1", 0)]
    pq.write_table(pa.table({"prompt": ["b"], "gold": ["2"]}), str(tmp_path / "x.parquet"))
    cfg = DataConfig(source="parquet", path=str(tmp_path / "x.parquet"), prompt_key="prompt", answer_key="gold")
    assert load_records(cfg) == [PromptRecord("b", "2", 0)]
    with pytest.raises(DatasetError, match="missing.jsonl: file not found"):
        load_records(DataConfig(source="jsonl", path=str(tmp_path / "missing.jsonl")))
    with pytest.raises(DatasetError, match="data.path: required"):
        load_records(DataConfig(source="parquet"))


def test_per_prompt_budgets_are_read_from_every_file_source_and_bad_ones_named(tmp_path: Path) -> None:
    """data.max_new_tokens_key: each row's own generation budget (jsonl, parquet), checked per row."""
    path = _write_lines(tmp_path / "x.jsonl", [json.dumps({"q": "a", "a": "1", "n": 3}),
                                                json.dumps({"q": "b", "a": "2", "n": "12"})])
    cfg = DataConfig(source="jsonl", path=path, prompt_key="q", answer_key="a", max_new_tokens_key="n")
    assert [r.max_new_tokens for r in load_records(cfg)] == [3, 12]
    assert [r.max_new_tokens for r in read_jsonl(path, "q", "a")] == [None, None]     # no key: none read
    pq.write_table(pa.table({"q": ["a", "b"], "a": ["1", "2"], "n": [5, 7]}), str(tmp_path / "x.parquet"))
    pcfg = DataConfig(source="parquet", path=str(tmp_path / "x.parquet"), prompt_key="q", answer_key="a",
                      max_new_tokens_key="n")
    assert [r.max_new_tokens for r in load_records(pcfg)] == [5, 7]
    for bad in (0, -2, 2.5, True, "x"):
        _write_lines(tmp_path / "x.jsonl", [json.dumps({"q": "a", "a": "1", "n": 3}), json.dumps({"q": "b", "a": "2", "n": bad})])
        with pytest.raises(DatasetError, match=rf"x.jsonl:2: 'n' must be a positive integer .*got {bad!r}"):
            load_records(cfg)
    _write_lines(tmp_path / "x.jsonl", [json.dumps({"q": "a", "a": "1"})])
    with pytest.raises(DatasetError, match="x.jsonl:1: missing key 'n'"):
        load_records(cfg)
    pq.write_table(pa.table({"q": ["a"], "a": ["1"]}), str(tmp_path / "x.parquet"))
    with pytest.raises(DatasetError, match="missing column 'n'"):
        load_records(pcfg)


def test_load_records_synthetic_is_the_seeded_task() -> None:
    from periodic_async.data.synthetic import answer_for, make_records
    task = SyntheticTaskConfig(size=5, num_digits=3)
    records = load_records(DataConfig(source="synthetic", synthetic=task, seed=9))
    assert records == make_records(task, seed=9) and len(records) == 5
    assert records != make_records(task, seed=10)
    assert all(r.answer == answer_for("next_digit", r.prompt[:-1]) and r.prompt.endswith("=") for r in records)


# ---------------------------------------------------------------- PromptLoader

def _indices(batch: list[PromptRecord]) -> list[int]:
    return [r.index for r in batch]


def test_loader_epochs_follow_seeded_permutations_and_straddle() -> None:
    loader = PromptLoader(_records(10), batch_size=4, shuffle=True, seed=3)
    stream = [i for _ in range(5) for i in _indices(loader.next_batch())]  # 20 records = 2 epochs
    expected = [int(i) for e in range(2) for i in np.random.default_rng((3, e)).permutation(10)]
    assert stream == expected
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:]) == list(range(10))
    assert stream[:10] != stream[10:]  # a new order each epoch
    assert loader.state_dict()["epoch"] == 2 and loader.state_dict()["position"] == 0


def test_loader_straddling_batch_and_identity_order_without_shuffle() -> None:
    loader = PromptLoader(_records(5), batch_size=3, shuffle=False, seed=0)
    assert [_indices(loader.next_batch()) for _ in range(4)] == [[0, 1, 2], [3, 4, 0], [1, 2, 3], [4, 0, 1]]


def test_loader_batch_larger_than_dataset_spans_epochs() -> None:
    loader = PromptLoader(_records(2), batch_size=5, shuffle=False)
    assert _indices(loader.next_batch()) == [0, 1, 0, 1, 0]


def test_loader_is_deterministic_per_seed() -> None:
    def first(seed: int) -> list[list[int]]:
        loader = PromptLoader(_records(50), batch_size=7, shuffle=True, seed=seed)
        return [_indices(loader.next_batch()) for _ in range(10)]
    assert first(1) == first(1)
    assert first(1) != first(2)


def test_loader_resume_gives_identical_next_batches() -> None:
    original = PromptLoader(_records(10), batch_size=4, shuffle=True, seed=5)
    for _ in range(3):  # ends mid-epoch-1, after a straddling batch
        original.next_batch()
    state = json.loads(json.dumps(original.state_dict()))  # survives a checkpoint round trip
    expected = [_indices(original.next_batch()) for _ in range(6)]

    resumed = PromptLoader(_records(10), batch_size=4, shuffle=True, seed=5)
    resumed.load_state_dict(state)
    assert [_indices(resumed.next_batch()) for _ in range(6)] == expected


def test_loader_rejects_bad_arguments_and_foreign_state() -> None:
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        PromptLoader(_records(3), batch_size=0, shuffle=True, seed=0)
    with pytest.raises(ValueError, match="no records"):
        PromptLoader([], batch_size=1, shuffle=True, seed=0)
    state = PromptLoader(_records(3), batch_size=1, shuffle=True, seed=0).state_dict()
    with pytest.raises(ValueError, match="saved num_records=3 but this loader has num_records=4"):
        PromptLoader(_records(4), batch_size=1, shuffle=True, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="saved seed=0 but this loader has seed=1"):
        PromptLoader(_records(3), batch_size=1, shuffle=True, seed=1).load_state_dict(state)


def test_skip_bad_rows_leaves_out_each_bad_row_and_counts_them(tmp_path: Path, caplog) -> None:
    good = [{"question": f"q{i}", "answer": str(i)} for i in range(4)]
    path = _write_lines(tmp_path / "x.jsonl", [
        json.dumps(good[0]), '{"question": "b",', json.dumps(good[1]), "[1]", "",
        json.dumps({"question": "c"}), json.dumps(good[2]), json.dumps({"question": None, "answer": "1"}),
        json.dumps(good[3])])
    strict = DataConfig(source="jsonl", path=path)
    with pytest.raises(DatasetError, match=r"x\.jsonl:2: invalid JSON"):
        load_records(strict)
    with caplog.at_level("WARNING"):
        records = load_records(DataConfig(source="jsonl", path=path, skip_bad_rows=True))
    # the good rows, in order, renumbered 0.. (the loader's indices stay contiguous)
    assert records == [PromptRecord(g["question"], g["answer"], i) for i, g in enumerate(good)]
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert "left out 4 bad row(s)" in warning and f"{path}:2: invalid JSON" in warning
    assert f"{path}:4: expected a JSON object" in warning and f"{path}:6: missing key 'answer'" in warning

    # Parquet: a null is a bad row; a missing column stays an error
    pq.write_table(pa.table({"question": ["a", None, "c"], "answer": ["1", "2", "3"]}), str(tmp_path / "x.parquet"))
    cfg = DataConfig(source="parquet", path=str(tmp_path / "x.parquet"), skip_bad_rows=True)
    assert load_records(cfg) == [PromptRecord("a", "1", 0), PromptRecord("c", "3", 1)]
    pq.write_table(pa.table({"question": ["a"]}), str(tmp_path / "y.parquet"))
    with pytest.raises(DatasetError, match="missing column 'answer'"):
        load_records(DataConfig(source="parquet", path=str(tmp_path / "y.parquet"), skip_bad_rows=True))
    # nothing good left: an error, not an empty dataset
    bad = _write_lines(tmp_path / "z.jsonl", ["[1]", "{"])
    with pytest.raises(DatasetError, match=r"z\.jsonl: every row is bad \(2 rows; the first: .*z\.jsonl:1: expected"):
        load_records(DataConfig(source="jsonl", path=bad, skip_bad_rows=True))


@pytest.mark.parametrize("selection", ["none", "backfill"])
def test_each_prompt_is_generated_to_its_own_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, selection: str) -> None:
    """A run with per-prompt budgets and rollout.ignore_eos: every response is exactly its prompt's
    budget long, through the plain batch plan and the selection rules' plan (backfill), and a budget
    over rollout.max_new_tokens stops the run naming the row."""
    from periodic_async.config import load_config
    from periodic_async.rollout.hf_engine import HFRolloutEngine
    from periodic_async.train.trainer import Trainer
    # question "7" * j + "=" (j + 1 characters) has budget j + 1, so with the char tokenizer every
    # response is as long as its prompt's ids minus a constant; 2..9 tokens under a cap of 10
    rows = [{"question": "7" * j + "=", "answer": "7", "n": j + 1} for j in range(1, 9)]
    path = _write_lines(tmp_path / "b.jsonl", [json.dumps(r) for r in rows])
    overrides = [f"trainer.run_dir={tmp_path / 'run'}", "data.source=jsonl", f"data.path={path}", "data.chat_template=none",
                 "data.max_new_tokens_key=n", "data.train_batch_size=8", "rollout.n=2", "rollout.max_new_tokens=10",
                 "rollout.ignore_eos=true", "trainer.mode=sync", "trainer.total_steps=2", "reward.num_workers=0",
                 "trainer.save_final=false", "trainer.progress_bar=false"]
    if selection != "none":
        overrides.append(f"rollout.selection={selection}")
    seen: list[tuple[int, int]] = []
    serve = HFRolloutEngine.serve

    def recording(self, *args, **kwargs):
        for finished in serve(self, *args, **kwargs):
            seen.extend((len(r.prompt_ids), len(r.response_ids)) for r in finished)
            yield finished
    monkeypatch.setattr(HFRolloutEngine, "serve", recording)
    Trainer(load_config("configs/default.yaml", overrides)).fit()
    assert len(seen) >= 2 * 8 * 2
    assert len({p - r for p, r in seen}) == 1, seen          # each as long as its own budget
    assert len({r for _, r in seen}) > 4                     # and the budgets differ
    with pytest.raises(DatasetError, match=r"b.jsonl: row index 7: 'n' is 9, over rollout.max_new_tokens \(8\)"):
        Trainer(load_config("configs/default.yaml", overrides + ["rollout.max_new_tokens=8"]))
    from periodic_async.config import ConfigError
    with pytest.raises(ConfigError, match="data.max_new_tokens_key: .* not from data.source 'synthetic'"):
        load_config("configs/default.yaml", ["data.max_new_tokens_key=n"]).validate(world_size=1)
