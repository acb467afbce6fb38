"""Prompt datasets: readers for JSONL, Parquet and local Hugging Face datasets, and a resumable loader.

Every reader returns `PromptRecord`s and fails with a `DatasetError` that names the file and the
line or row at fault, because a bad row found at step 3,000 of a run is far cheaper to fix when the
message says exactly where it is. `PromptLoader` walks epochs forever in an order fixed by
(seed, epoch), so that a run resumed from `state_dict()` sees exactly the batches it would have seen.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Optional

import numpy as np

from periodic_async.config import DataConfig
from periodic_async.data.gsm8k_task import extract_gsm8k_answer, sample_path
from periodic_async.data.records import DatasetError, PromptRecord
from periodic_async.data.synthetic import make_records

# The version the project is tested with; `datasets` is optional and only needed for source "hf".
DATASETS_PIN = "datasets==5.2.0"

_GSM8K_KEYS = ("question", "answer")

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- readers

def _require_file(path: str) -> None:
    """Fail with the path in the message, not a bare FileNotFoundError from deep inside a reader."""
    if not os.path.exists(path):
        raise DatasetError(f"{path}: file not found")


def _field(row: dict, key: str, where: str) -> str:
    """Return row[key] as text; `where` ('file:line' or 'file: row index N') prefixes any error."""
    if key not in row:
        present = ", ".join(str(k) for k in row) or "none"
        raise DatasetError(f"{where}: missing key '{key}' (keys present: {present})")
    value = row[key]
    if value is None:
        raise DatasetError(f"{where}: '{key}' is null")
    return value if isinstance(value, str) else str(value)


def _budget(row: dict, key: str, where: str) -> int:
    """row[key] as a generation budget: a positive integer (3 or "3"; not 2.5, true or 0)."""
    value = _field(row, key, where)
    if not value.isdigit() or int(value) < 1:
        raise DatasetError(f"{where}: '{key}' must be a positive integer (a generation budget in tokens), got {row[key]!r}")
    return int(value)


def _record(row: dict, prompt_key: str, answer_key: str, index: int, where: str,
            budget_key: Optional[str] = None) -> PromptRecord:
    return PromptRecord(prompt=_field(row, prompt_key, where), answer=_field(row, answer_key, where),
                        index=index, max_new_tokens=_budget(row, budget_key, where) if budget_key else None)


def _jsonl_row(line: str, where: str) -> dict:
    try:
        row = json.loads(line.rstrip("\r\n"))   # a column past the line end would read as "column 1"
    except json.JSONDecodeError as e:
        raise DatasetError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
    return row


def read_jsonl(path: str, prompt_key: str, answer_key: str,
               bad_rows: Optional[list[str]] = None, budget_key: Optional[str] = None) -> list[PromptRecord]:
    """One JSON object per line; blank lines are skipped and do not count as rows. `bad_rows`: None
    raises on the first bad row; a list collects each bad row's error and leaves the row out."""
    _require_file(path)
    records: list[PromptRecord] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                records.append(_record(_jsonl_row(line, where), prompt_key, answer_key, len(records), where, budget_key))
            except DatasetError as e:
                if bad_rows is None:
                    raise
                bad_rows.append(str(e))
    return records


def _records_from_columns(columns: dict[str, list[Any]], names: list[str], prompt_key: str,
                          answer_key: str, path: str, bad_rows: Optional[list[str]] = None,
                          budget_key: Optional[str] = None) -> list[PromptRecord]:
    """Shared by the Parquet and Hugging Face readers, which both hand over whole columns. A missing
    column is always an error; a bad row (null value) is one too unless `bad_rows` collects it."""
    keys = (prompt_key, answer_key) + ((budget_key,) if budget_key else ())
    for key in keys:
        if key not in names:
            raise DatasetError(f"{path}: missing column '{key}' (columns present: {', '.join(names) or 'none'})")
    records: list[PromptRecord] = []
    for i, values in enumerate(zip(*(columns[k] for k in keys))):
        try:
            records.append(_record(dict(zip(keys, values)), prompt_key, answer_key, len(records),
                                   f"{path}: row index {i}", budget_key))
        except DatasetError as e:
            if bad_rows is None:
                raise
            bad_rows.append(str(e))
    return records


def read_parquet(path: str, prompt_key: str, answer_key: str,
                 bad_rows: Optional[list[str]] = None, budget_key: Optional[str] = None) -> list[PromptRecord]:
    """A Parquet file read with pyarrow; only the needed columns are materialised."""
    import pyarrow.parquet as pq

    _require_file(path)
    try:
        names = pq.read_schema(path).names
        wanted = [k for k in (prompt_key, answer_key, budget_key) if k and k in names]
        table = pq.read_table(path, columns=wanted)
    except Exception as e:  # pyarrow raises several unrelated types for a corrupt file
        raise DatasetError(f"{path}: not a readable Parquet file ({e})") from None
    return _records_from_columns(table.to_pydict(), names, prompt_key, answer_key, path, bad_rows, budget_key)


def _hf_pick_split(ds: Any, split: str, path: str) -> Any:
    """A DatasetDict holds several splits; a plain Dataset is returned as it is."""
    if hasattr(ds, "column_names") and not isinstance(ds.column_names, dict):
        return ds
    if split not in ds:
        raise DatasetError(f"{path}: no split '{split}' (splits present: {', '.join(ds.keys())})")
    return ds[split]


_HF_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


def _hf_load(datasets: Any, path: str, split: str, cache_dir: Optional[str]) -> Any:
    """load_from_disk for a save_to_disk directory, else load_dataset on the local dir or file."""
    saved_markers = ("dataset_info.json", "state.json", "dataset_dict.json")
    if os.path.isdir(path) and any(os.path.exists(os.path.join(path, m)) for m in saved_markers):
        return _hf_pick_split(datasets.load_from_disk(path), split, path)
    if os.path.isdir(path):
        return datasets.load_dataset(path, split=split, cache_dir=cache_dir)
    ext = os.path.splitext(path)[1].lower()
    if ext not in _HF_FILE_BUILDERS:
        raise DatasetError(f"{path}: cannot load a '{ext}' file with datasets; "
                           f"allowed: {', '.join(sorted(_HF_FILE_BUILDERS))} or a directory")
    return datasets.load_dataset(_HF_FILE_BUILDERS[ext], data_files=path, split=split, cache_dir=cache_dir)


def read_hf(path: str, prompt_key: str, answer_key: str, split: str = "train",
            cache_dir: Optional[str] = None, bad_rows: Optional[list[str]] = None,
            budget_key: Optional[str] = None) -> list[PromptRecord]:
    """A Hugging Face dataset from a LOCAL path only; the hub is never contacted.

    The path must exist before `datasets` is called, which is what keeps a typo from turning into
    a hub download. `cache_dir` is passed to `load_dataset` (None: the datasets default).
    """
    _require_file(path)
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"{path}: data.source 'hf' needs the datasets package: "
                           f"pip install {DATASETS_PIN}") from None
    try:
        ds = _hf_load(datasets, path, split, cache_dir)
    except DatasetError:
        raise
    except Exception as e:  # datasets raises many types (FileNotFoundError, ValueError, its own)
        raise DatasetError(f"{path}: could not load with datasets ({type(e).__name__}: {e})") from None
    names = list(ds.column_names)
    columns = {k: ds[k] for k in (prompt_key, answer_key, budget_key) if k and k in names}
    return _records_from_columns(columns, names, prompt_key, answer_key, path, bad_rows, budget_key)


def load_gsm8k_sample() -> list[PromptRecord]:
    """The shipped GSM8K rows: the question as it is and the extracted gold answer ('72'). The
    '####' instruction is added by data.prompt_template (data/prompts.py), as for any other source,
    so that a prompt is templated in one place only."""
    path = sample_path()
    records = read_jsonl(path, *_GSM8K_KEYS)
    for rec in records:
        try:
            rec.answer = extract_gsm8k_answer(rec.answer)
        except ValueError as e:
            raise DatasetError(f"{path}: row index {rec.index}: {e}") from None
    return records


def load_records(cfg: DataConfig) -> list[PromptRecord]:
    """All records of the configured source, in source order. With
    data.skip_bad_rows a bad row (invalid JSON, missing key, null) is left out, and a warning says
    how many there were and which came first; a file with no good row is still an error."""
    if cfg.source == "synthetic":
        return make_records(cfg.synthetic, seed=cfg.seed)
    if cfg.source == "gsm8k":
        return load_gsm8k_sample()
    readers = {"jsonl": read_jsonl, "parquet": read_parquet, "hf": read_hf}
    if cfg.source not in readers:
        raise DatasetError(f"data.source: '{cfg.source}' is not allowed; "
                           f"allowed: synthetic, gsm8k, {', '.join(readers)}")
    path = cfg.path
    if not path:
        raise DatasetError(f"data.path: required when data.source is '{cfg.source}'")
    budget_key = cfg.max_new_tokens_key
    if not cfg.skip_bad_rows:
        return readers[cfg.source](path, cfg.prompt_key, cfg.answer_key, budget_key=budget_key)
    bad: list[str] = []
    records = readers[cfg.source](path, cfg.prompt_key, cfg.answer_key, bad_rows=bad, budget_key=budget_key)
    if bad:
        if not records:
            raise DatasetError(f"{path}: every row is bad ({len(bad)} rows; the first: {bad[0]})")
        log.warning("data.skip_bad_rows: left out %d bad row(s) of %s, e.g. %s", len(bad), path,
                    "; ".join(bad[:3]))
    return records


def check_budgets(records: list[PromptRecord], cfg: DataConfig, path: str, cap: int) -> None:
    """Every per-prompt budget (data.max_new_tokens_key) within rollout.max_new_tokens, which sizes
    the engines' KV caches and the trainer's sequences."""
    over = next((r for r in records if r.max_new_tokens is not None and r.max_new_tokens > cap), None)
    if over is not None:
        raise DatasetError(f"{path}: row index {over.index}: '{cfg.max_new_tokens_key}' is {over.max_new_tokens}, "
                           f"over rollout.max_new_tokens ({cap})")


# ---------------------------------------------------------------- loader

class PromptLoader:
    """Endless batches over `records`; epoch e's order is default_rng((seed, e)).permutation.

    Seeding each epoch from (seed, epoch) rather than advancing one generator means the order of any
    epoch is known from two integers, so the whole resume state is (epoch, position).
    """

    def __init__(self, records: list[PromptRecord], batch_size: int, shuffle: bool = True, seed: int = 0):
        if batch_size < 1:
            raise ValueError(f"PromptLoader: batch_size must be >= 1, got {batch_size}")
        if not records:
            raise ValueError("PromptLoader: no records to load (the dataset is empty)")
        if seed < 0:
            raise ValueError(f"PromptLoader: seed must be >= 0, got {seed}")
        self.records = records
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0  # index into the current epoch's order of the next record to hand out
        self._order_epoch = -1
        self._order: np.ndarray = np.arange(0)

    def _epoch_order(self) -> np.ndarray:
        """The current epoch's order, computed once per epoch."""
        if self._order_epoch != self.epoch:
            n = len(self.records)
            self._order = (np.random.default_rng((self.seed, self.epoch)).permutation(n)
                           if self.shuffle else np.arange(n))
            self._order_epoch = self.epoch
        return self._order

    def next_batch(self, n: Optional[int] = None) -> list[PromptRecord]:
        """Exactly n (default batch_size) records; a batch runs on into the next epoch when this one
        ends. The planner asks for single records to replace prompts it skips."""
        n = self.batch_size if n is None else n
        batch: list[PromptRecord] = []
        while len(batch) < n:
            order = self._epoch_order()
            take = min(n - len(batch), len(order) - self.position)
            batch.extend(self.records[i] for i in order[self.position:self.position + take])
            self.position += take
            if self.position == len(order):
                self.epoch, self.position = self.epoch + 1, 0
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "num_records": len(self.records),
                "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore (epoch, position); refuses a state from different data, seed or shuffle setting,
        since the resumed batches would then silently differ from the interrupted run's."""
        mine = self.state_dict()
        for key in ("num_records", "seed", "shuffle"):
            if state.get(key) != mine[key]:
                raise ValueError(f"PromptLoader.load_state_dict: saved {key}={state.get(key)!r} "
                                 f"but this loader has {key}={mine[key]!r}")
        if not 0 <= state["position"] < len(self.records) or state["epoch"] < 0:
            raise ValueError(f"PromptLoader.load_state_dict: bad epoch/position {state['epoch']}/{state['position']}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
