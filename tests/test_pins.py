"""The per-platform pin sets (tools/check_pins.py): they agree with setup.py and with what the Ascend
stack's packages declare, the documented install lines are the ones that were checked, and (in the
Ascend-stack environment, where uv is installed) the stack resolves as locked."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("check_pins", os.path.join(ROOT, "tools", "check_pins.py"))
check_pins = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_pins)

# The install lines, once: the docs, the Dockerfile and run.sh's Ascend-stack environment use these.
ASCEND_LINE = "pip install -c requirements/ascend-constraints.txt -r requirements/ascend.txt"
CUDA_LINE = "pip install -r requirements/cuda.txt"
PROJECT_LINE = "pip install --no-deps -e ."


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A copy of the pin files that a test may break; check_pins reads it instead of the repo's."""
    shutil.copytree(os.path.join(ROOT, "requirements"), tmp_path / "requirements")
    for name in ("setup.py", "constraints.txt"):
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    root = str(tmp_path)
    req = os.path.join(root, "requirements")
    for attr, path in dict(ROOT=root, REQ=req, CPU=os.path.join(root, "constraints.txt"),
                           CUDA=os.path.join(req, "cuda.txt"), ASCEND=os.path.join(req, "ascend.txt"),
                           ASCEND_IMAGE=os.path.join(req, "ascend-image.txt"),
                           ASCEND_LOCK=os.path.join(req, "ascend-constraints.txt"),
                           UPSTREAM=os.path.join(req, "upstream")).items():
        monkeypatch.setattr(check_pins, attr, path)
    return tmp_path


def _edit(path, old, new):
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new))


def test_the_repository_pin_sets_agree():
    assert check_pins.static_problems() == []


def test_setup_py_never_pins_torch_exactly():
    torch_req = [r for r in check_pins.setup_requirements() if r.name == "torch"]
    assert torch_req and not any(s.operator == "==" for s in torch_req[0].specifier)


def test_a_package_missing_from_a_cluster_pin_set_is_named(tree):
    """docs/running-on-910b.md once listed its packages by hand and left out pebble: rank 0 died on import."""
    _edit(tree / "requirements" / "ascend.txt", "pebble==5.2.3", "")
    _edit(tree / "requirements" / "cuda.txt", "pebble==5.2.3", "")
    problems = check_pins.static_problems()
    assert "requirements/ascend.txt: no pin for pebble, which setup.py requires" in problems
    assert "requirements/cuda.txt: no pin for pebble, which setup.py requires" in problems


def test_a_pin_against_an_upstream_declaration_is_named(tree):
    """numpy 1.26.4 breaks MindSpeed core_r0.16.0's numpy<=1.26.0 (and leaves the lock)."""
    _edit(tree / "requirements" / "ascend.txt", "numpy==1.26.0", "numpy==1.26.4")
    _edit(tree / "requirements" / "ascend-constraints.txt", "numpy==1.26.0", "numpy==1.26.4")
    problems = check_pins.static_problems()
    assert any(p.startswith("requirements/upstream/mindspeed-core_r0.16.0.txt:") and "numpy<=1.26.0" in p
               for p in problems), problems


def test_transformers_5_on_the_ascend_stack_is_refused(tree):
    _edit(tree / "requirements" / "ascend.txt", "transformers==4.57.1", "transformers==5.19.0")
    _edit(tree / "requirements" / "ascend-constraints.txt", "transformers==4.57.1", "transformers==5.19.0")
    problems = check_pins.static_problems()
    assert any("vllm-ascend-0.11.0.txt" in p and "transformers<=4.57.1" in p for p in problems), problems


def test_a_cluster_owned_package_in_a_cluster_pin_set_is_refused(tree):
    """The GPU install line once replaced the cluster's torch."""
    with open(tree / "requirements" / "cuda.txt", "a") as f:
        f.write("torch==2.13.0\ntriton==3.9.0\nnvidia-nccl-cu12==2.28.9\n")
    problems = check_pins.static_problems()
    for name in ("torch", "triton", "nvidia-nccl-cu12"):
        assert any(p.startswith("requirements/cuda.txt: pins " + name) for p in problems), (name, problems)


def test_a_pin_outside_setup_py_s_range_is_named(tree):
    _edit(tree / "constraints.txt", "megatron-core==0.16.1", "megatron-core==0.19.2")
    assert "constraints.txt: megatron-core==0.19.2 is outside setup.py's megatron-core<0.17,>=0.16.0" in \
        check_pins.static_problems()


def _pip_lines(path):
    text = open(os.path.join(ROOT, path)).read().replace("\\\n", " ")
    return [re.sub(r"\s+", " ", m).strip() for m in re.findall(r"pip install[^\n&;]*", text)]


@pytest.mark.parametrize("path", ["docs/running-on-910b.md", "docker/Dockerfile.ascend"])
def test_the_ascend_install_lines_are_the_checked_ones(path):
    lines = _pip_lines(path)
    assert any(line.startswith(ASCEND_LINE) for line in lines), lines
    assert any(PROJECT_LINE in line for line in lines), lines
    for line in lines:   # nothing installed on the image without the lock, nothing that replaces its stack
        assert "-c requirements/ascend-constraints.txt" in line or "--no-deps" in line, line
        assert not re.search(r"\b(torch|torch-npu|torch_npu|vllm|vllm-ascend|transformers|numpy)==", line), line


def test_run_sh_builds_the_ascend_stack_environment_with_the_documented_line():
    text = open(os.path.join(ROOT, "run.sh")).read()
    assert "-c requirements/ascend-constraints.txt" in text and "-r requirements/ascend.txt" in text


def test_the_gpu_install_line_leaves_the_cluster_torch_alone():
    lines = _pip_lines("docs/running-on-gpus.md")
    assert any(line.startswith(CUDA_LINE) for line in lines), lines
    assert any(PROJECT_LINE in line for line in lines), lines
    for line in lines:
        assert "constraints.txt" not in line.replace("ascend-constraints.txt", ""), \
            f"{line}: constraints.txt pins the CPU torch and triton"
        assert "-e ." not in line or "--no-deps" in line, f"{line}: would resolve setup.py's torch range"


@pytest.mark.skipif(os.environ.get("PERIODIC_ASYNC_STACK") != "ascend",
                    reason="runs in the Ascend-stack environment (./run.sh test-ascend-stack), which has uv")
def test_the_ascend_stack_resolves_as_locked():
    """uv's resolver over vllm-ascend 0.11.0, vLLM 0.11.0's and MindSpeed core_r0.16.0's declared
    requirements, the image's torch / torch-npu and requirements/ascend.txt, constrained to the lock
    (needs PyPI, as CI has)."""
    assert check_pins.resolve_problems() == []
