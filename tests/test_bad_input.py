"""Bad input reads like a config error: a missing or corrupt model directory, a truncated
safetensors file, an invalid JSONL line or a row missing its field raise an InputError naming the
file (and line), and `python -m periodic_async` prints it as one line on stderr and exits 2 - also
under torchrun, on every rank - before any model is built or worker started."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from periodic_async.errors import InputError
from periodic_async.models.convert import SafetensorsReader, check_checkpoint
from periodic_async.models.mcore import CheckpointError, UnsupportedModel, arch_from_hf_dir
from periodic_async.models.tokenizer import load_tokenizer

from helpers import make_hf_model_dir

REPO = Path(__file__).resolve().parents[1]
DEFAULT = str(REPO / "configs" / "default.yaml")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_hf_model_dir(tmp_path_factory.mktemp("ckpt") / "m", vocab=24, hidden=64, heads=2, kv_heads=2)


def _copy(src: str, dst: Path) -> Path:
    dst.mkdir()
    for fn in os.listdir(src):
        (dst / fn).write_bytes((Path(src) / fn).read_bytes())
    return dst


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


def _shard(src: str, dst: Path) -> Path:
    """`src` rewritten as a two-file sharded checkpoint with an index."""
    import torch
    from safetensors.torch import load_file, save_file
    out = _copy(src, dst)
    (out / "model.safetensors").unlink()
    tensors = load_file(str(Path(src) / "model.safetensors"))
    names = sorted(tensors)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fn, part in parts.items():
        save_file({n: tensors[n].contiguous() for n in part}, str(out / fn), metadata={"format": "pt"})
    weight_map = {n: fn for fn, part in parts.items() for n in part}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert torch.equal(SafetensorsReader(str(out))(names[0]), tensors[names[0]])
    return out


# ---------------------------------------------------------------------- the errors, in-process

def test_input_errors_are_one_type():
    from periodic_async.data.records import DatasetError
    from periodic_async.reward.manager import RewardFnError
    for cls in (DatasetError, CheckpointError, UnsupportedModel, RewardFnError):
        assert issubclass(cls, InputError)


def test_missing_model_directory_or_config_names_it(tmp_path):
    with pytest.raises(CheckpointError, match=r"^model.path: /nonexistent/m is not a directory"):
        arch_from_hf_dir("/nonexistent/m")
    with pytest.raises(CheckpointError, match=rf"^model.path: {tmp_path} has no config.json"):
        arch_from_hf_dir(str(tmp_path))


def test_corrupt_config_json_names_file_and_line(model_dir, tmp_path):
    bad = _copy(model_dir, tmp_path / "bad")
    (bad / "config.json").write_text('{\n  "model_type": "qwen2",\n  "hidden_size": 64,,\n}\n')
    with pytest.raises(CheckpointError, match=rf"^{bad}/config.json:3: invalid JSON \("):
        arch_from_hf_dir(str(bad))
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    del cfg["num_attention_heads"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModel, match=rf"^{bad}/config.json: missing key 'num_attention_heads'"):
        arch_from_hf_dir(str(bad))


def test_missing_weights_name_the_directory(model_dir, tmp_path):
    bad = _copy(model_dir, tmp_path / "bad")
    (bad / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=rf"^model.path: {bad} has no model.safetensors or "
                                              r"model.safetensors.index.json"):
        check_checkpoint(str(bad))


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.0])
def test_truncated_safetensors_names_the_file(model_dir, tmp_path, keep):
    bad = _copy(model_dir, tmp_path / "bad")
    _truncate(bad / "model.safetensors", keep)
    with pytest.raises(CheckpointError, match=rf"^{bad}/model.safetensors: not a readable safetensors file "
                                              r"\(.*\); re-download or re-save the checkpoint$"):
        check_checkpoint(str(bad))
    with pytest.raises(CheckpointError, match=rf"^{bad}/model.safetensors: not a readable"):
        SafetensorsReader(str(bad))


def test_sharded_checkpoint_missing_or_truncated_shard_names_it(model_dir, tmp_path):
    good = _shard(model_dir, tmp_path / "sharded")
    check_checkpoint(str(good))
    missing = _copy(str(good), tmp_path / "missing")
    (missing / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=rf"^{missing}/model-00002-of-00002.safetensors: file not found "
                                              r"\(listed in model.safetensors.index.json\)"):
        check_checkpoint(str(missing))
    truncated = _copy(str(good), tmp_path / "truncated")
    _truncate(truncated / "model-00001-of-00002.safetensors")
    with pytest.raises(CheckpointError, match=rf"^{truncated}/model-00001-of-00002.safetensors: not a readable"):
        check_checkpoint(str(truncated))
    (truncated / "model.safetensors.index.json").write_text('{"weight_map": {"a": ')
    with pytest.raises(CheckpointError, match=rf"^{truncated}/model.safetensors.index.json:1: invalid JSON"):
        check_checkpoint(str(truncated))


def test_missing_or_corrupt_tokenizer_names_the_file(model_dir, tmp_path):
    """Without its files transformers would build an empty one-token tokenizer without a word."""
    bad = _copy(model_dir, tmp_path / "bad")
    (bad / "tokenizer_config.json").write_text('{"periodic_async_char_tokenizer": true,\n')
    with pytest.raises(CheckpointError, match=rf"^{bad}/tokenizer_config.json:2: invalid JSON"):
        load_tokenizer(str(bad))
    for fn in os.listdir(bad):
        if fn.startswith(("tokenizer", "special_tokens")):
            (bad / fn).unlink()
    with pytest.raises(CheckpointError, match=rf"^model.path: {bad} has no tokenizer \(tokenizer.json, "):
        load_tokenizer(str(bad))


# ---------------------------------------------------------------------- the command line

def _cli(*overrides: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "periodic_async", "--config", DEFAULT,
                           f"trainer.run_dir={tmp_path / 'run'}", "trainer.progress_bar=false", *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def _assert_one_line(proc: subprocess.CompletedProcess, expected: str) -> None:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [expected], proc.stderr[-3000:]


def _bad_jsonl(tmp_path: Path) -> tuple[Path, Path]:
    invalid = tmp_path / "invalid.jsonl"
    invalid.write_text('{"question": "1+1", "answer": "2"}\n{"question": "2+2", "answer": \n')
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"question": "1+1", "answer": "2"}\n\n{"question": "2+2"}\n')
    return invalid, missing


def test_cli_missing_model_dir_is_one_line_exit_2(tmp_path):
    proc = _cli("model.path=/nonexistent", tmp_path=tmp_path)
    _assert_one_line(proc, "error: model.path: /nonexistent is not a directory (expected a Hugging Face model "
                           "directory)")
    assert not (tmp_path / "run").exists()       # nothing was started or written


def test_cli_truncated_safetensors_is_one_line_exit_2(model_dir, tmp_path):
    bad = _copy(model_dir, tmp_path / "bad")
    _truncate(bad / "model.safetensors")
    proc = _cli(f"model.path={bad}", tmp_path=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"error: {bad}/model.safetensors: not a readable safetensors file ("), line


def test_cli_invalid_or_incomplete_jsonl_is_one_line_exit_2(tmp_path):
    invalid, missing = _bad_jsonl(tmp_path)
    proc = _cli("data.source=jsonl", f"data.path={invalid}", tmp_path=tmp_path)
    _assert_one_line(proc, f"error: {invalid}:2: invalid JSON (Expecting value at column 31)")
    proc = _cli("data.source=jsonl", f"data.path={missing}", tmp_path=tmp_path)
    _assert_one_line(proc, f"error: {missing}:3: missing key 'answer' (keys present: question)")
    assert not (tmp_path / "run").exists()


def test_cli_bad_jsonl_under_torchrun_every_rank_exits_2_with_one_line(tmp_path):
    """Each rank reads the dataset before the process group exists, so every rank fails alike (no
    rank waits on rank 0 and is killed with a traceback). Each rank's stderr (--redirects) is just
    the one line, and the launcher run.sh uses (periodic_async.launch) exits 2 as the ranks did,
    without torchrun's ChildFailedError summary (plain torchrun: exit 1 and the summary)."""
    invalid, _ = _bad_jsonl(tmp_path)
    logs = tmp_path / "logs"
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    # --monitor-interval 10: the launcher stops the other ranks as soon as it sees one fail; looking
    # first after 10 s, it finds both failed by themselves (in ~5 s) rather than one still reading
    proc = subprocess.run([sys.executable, "-m", "periodic_async.launch", "--standalone", "--nproc_per_node", "2",
                           "--monitor-interval", "10", "--log-dir", str(logs), "--redirects", "2",
                           "-m", "periodic_async", "--config", DEFAULT, f"trainer.run_dir={tmp_path / 'run'}",
                           "data.source=jsonl", f"data.path={invalid}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    stderr_files = sorted(logs.rglob("stderr.log"))
    assert len(stderr_files) == 2, (sorted(logs.rglob("*")), proc.stderr[-3000:])
    for f in stderr_files:
        assert f.read_text().splitlines() == [f"error: {invalid}:2: invalid JSON (Expecting value at column 31)"], \
            (f, f.read_text()[-3000:])
    assert "ChildFailedError" not in proc.stderr and "Root Cause" not in proc.stderr, proc.stderr[-3000:]


def test_launcher_exit_codes(monkeypatch, capsys):
    """periodic_async.launch: a rank's input error (2) is the launcher's exit code, without the
    summary; any other failure prints torchrun's summary and keeps the first failed rank's code."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    from periodic_async import launch

    def failing(codes):
        def run(args):
            failures = {rank: ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file="")
                        for rank, code in enumerate(codes)}
            raise ChildFailedError("periodic_async", failures)
        return run

    argv = ["--standalone", "--nproc_per_node", "2", "-m", "periodic_async"]
    for codes, expected, summary in (([2, -15], 2, False), ([-15, 2], 2, False), ([130, 130], 130, True),
                                     ([1, -15], 1, True), ([-9, -15], 1, True)):
        monkeypatch.setattr(torchrun, "run", failing(codes))
        assert launch.main(argv) == expected, codes
        err = capsys.readouterr().err
        assert ("exitcode" in err) == summary, (codes, err)
