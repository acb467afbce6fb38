"""Check the per-platform pin sets against each other and against what their packages declare.

    python tools/check_pins.py static     offline: the pin files agree with setup.py and each other
    python tools/check_pins.py resolve    the Ascend stack resolves as locked (needs PyPI and uv)
    python tools/check_pins.py lock       rewrite requirements/ascend-constraints.txt (needs PyPI and uv)

The pin sets (docs/running-on-910b.md, docs/running-on-gpus.md):
- constraints.txt: the CPU development and CI set (torch 2.13.0, the local CPU wheel);
- requirements/cuda.txt: the project's packages for a GPU cluster, without torch (the cluster's);
- requirements/ascend.txt: what docker/Dockerfile.ascend installs on quay.io/ascend/vllm-ascend:v0.11.0,
  requirements/ascend-image.txt what that image provides, requirements/upstream/*.txt what vLLM
  0.11.0, vllm-ascend 0.11.0 and MindSpeed core_r0.16.0 declare, and
  requirements/ascend-constraints.txt the lock of all of them together.

`resolve` asks uv's resolver (`uv pip compile --universal`, Python 3.11, any Linux machine: the
910B hosts are aarch64 or x86_64) for one environment in which every declared requirement of the
stack holds, constrained to the lock: it fails when the lock stops resolving (a pin changed, a
release yanked, an upstream list edited). uv rather than pip: pip evaluates environment markers for
the machine it runs on even with --platform (torch 2.7.1's x86_64-only triton pin is then asked of
aarch64), and downloads whole wheels to resolve; uv resolves for every platform from metadata.
Exit status 1 with one line per problem.
"""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQ = os.path.join(ROOT, "requirements")
CPU = os.path.join(ROOT, "constraints.txt")
CUDA = os.path.join(REQ, "cuda.txt")
ASCEND = os.path.join(REQ, "ascend.txt")
ASCEND_IMAGE = os.path.join(REQ, "ascend-image.txt")
ASCEND_LOCK = os.path.join(REQ, "ascend-constraints.txt")
UPSTREAM = os.path.join(REQ, "upstream")
# Installed by the cluster, never by a pin file of ours on top of it: a pin would replace its build.
CLUSTER_OWNED = {"torch", "torch-npu", "triton", "torchvision", "torchaudio", "vllm", "vllm-ascend"}
# The Ascend image's interpreter (quay.io/ascend/cann:8.3.rc2-910b-ubuntu22.04-py3.11), on both host kinds
ASCEND_ENVS = [dict(default_environment(), python_version="3.11", python_full_version="3.11.13",
                    sys_platform="linux", platform_system="Linux", platform_machine=m) for m in ("aarch64", "x86_64")]
UV = "uv==0.13.9"


def read_requirements(path: str) -> list[tuple[int, Requirement]]:
    """(line number, requirement) of a requirements / constraints file; comments, blank lines and
    pip options are skipped; a line that does not parse stops with its file and line."""
    out = []
    with open(path) as f:
        for no, line in enumerate(f, 1):
            text = re.split(r"(^|\s)#", line, maxsplit=1)[0].strip()
            if not text or text.startswith("-"):
                continue
            try:
                out.append((no, Requirement(text)))
            except InvalidRequirement as e:
                raise SystemExit(f"{os.path.relpath(path, ROOT)}:{no}: not a requirement: {e}") from None
    return out


def pins(path: str) -> dict[str, Version]:
    """name -> version of every `name==version` line (markers ignored: a lock holds one version)."""
    out = {}
    for no, req in read_requirements(path):
        spec = list(req.specifier)
        if len(spec) == 1 and spec[0].operator == "==" and "*" not in spec[0].version:
            out[canonicalize_name(req.name)] = Version(spec[0].version)
    return out


def setup_requirements() -> list[Requirement]:
    """setup.py's install_requires (the CORE list), read without running setup()."""
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "CORE" for t in node.targets):
            return [Requirement(s) for s in ast.literal_eval(node.value)]
    raise SystemExit("setup.py: no CORE list")


def _rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


def static_problems() -> list[str]:
    """Offline checks of the pin files; an empty list when they agree."""
    problems = []
    core = setup_requirements()
    core_names = {canonicalize_name(r.name) for r in core}
    if "torch" in core_names and any(s.operator == "==" for r in core if r.name == "torch" for s in r.specifier):
        problems.append("setup.py: torch is pinned exactly; a cluster's torch would be replaced (use a range)")
    sets = {CPU: pins(CPU), CUDA: pins(CUDA), ASCEND: pins(ASCEND)}
    for path, pinned in sets.items():
        for req in core:
            name = canonicalize_name(req.name)
            if name == "torch" and path != CPU:
                continue
            if name not in pinned:
                problems.append(f"{_rel(path)}: no pin for {req.name}, which setup.py requires")
            elif not req.specifier.contains(pinned[name], prereleases=True):
                problems.append(f"{_rel(path)}: {req.name}=={pinned[name]} is outside setup.py's {req}")
    for path in (CUDA, ASCEND):
        for name in sorted(CLUSTER_OWNED & set(sets[path])):
            problems.append(f"{_rel(path)}: pins {name}, which the cluster provides (its build would be replaced)")
        for name in sorted(n for n in sets[path] if n.startswith("nvidia-")):
            problems.append(f"{_rel(path)}: pins {name}, which belongs to the cluster's torch")
    lock = pins(ASCEND_LOCK)
    for path in (ASCEND, ASCEND_IMAGE):
        for name, version in pins(path).items():
            if lock.get(name) != version:
                problems.append(f"{_rel(path)}: {name}=={version} but the lock {_rel(ASCEND_LOCK)} has "
                                f"{lock.get(name, 'none')} (run tools/check_pins.py lock)")
    # every requirement the stack's packages declare holds for the locked versions, on both host kinds
    declared = [(p, no, r) for p in _ascend_inputs() for no, r in read_requirements(p)] + \
               [(os.path.join(ROOT, "setup.py"), 0, r) for r in core]
    for path, no, req in declared:
        name = canonicalize_name(req.name)
        if name not in lock:
            if any(req.marker is None or req.marker.evaluate(env) for env in ASCEND_ENVS):
                problems.append(f"{_rel(path)}:{no}: {req} is not in the lock {_rel(ASCEND_LOCK)}")
            continue
        for env in ASCEND_ENVS:
            if (req.marker is None or req.marker.evaluate(env)) and not req.specifier.contains(lock[name], prereleases=True):
                problems.append(f"{_rel(path)}:{no}: {req} does not hold for the locked {name}=={lock[name]}")
                break
    return problems


def _ascend_inputs() -> list[str]:
    return [ASCEND, ASCEND_IMAGE] + sorted(os.path.join(UPSTREAM, f) for f in os.listdir(UPSTREAM) if f.endswith(".txt"))


def _uv() -> list[str]:
    exe = shutil.which("uv")
    if exe:
        return [exe]
    try:
        import uv  # noqa: F401  (the PyPI package ships the binary)
        from uv import find_uv_bin
        return [find_uv_bin()]
    except ImportError:
        raise SystemExit(f"tools/check_pins.py: needs uv ({sys.executable} -m pip install {UV})") from None


def compile_lock(out: str, constrained: bool) -> subprocess.CompletedProcess:
    cmd = _uv() + ["pip", "compile", "--universal", "--python-version", "3.11", "--no-header", "--quiet",
                   "--index-url", "https://pypi.org/simple", "--no-config", "-o", out, *_ascend_inputs()]
    if constrained:
        cmd += ["-c", ASCEND_LOCK]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)


def resolve_problems() -> list[str]:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "lock.txt")
        res = compile_lock(out, constrained=True)
        if res.returncode:
            tail = [ln for ln in res.stderr.strip().splitlines() if ln.strip()][-6:]
            return [f"the Ascend stack does not resolve within {_rel(ASCEND_LOCK)}:"] + ["  " + ln for ln in tail]
        fresh, lock = pins(out), pins(ASCEND_LOCK)
        return [f"{_rel(ASCEND_LOCK)}: {n}=={lock.get(n, 'none')} but the stack resolves to {n}=={v} "
                f"(run tools/check_pins.py lock)" for n, v in sorted(fresh.items()) if lock.get(n) != v]


def main(argv: list[str]) -> int:
    cmd = argv[0] if argv else "static"
    if cmd == "lock":
        res = compile_lock(ASCEND_LOCK + ".new", constrained=False)
        if res.returncode:
            print(res.stderr, file=sys.stderr)
            return 1
        header = ("# The Ascend stack's lock (generated: python tools/check_pins.py lock; do not edit): every package\n"
                  "# of requirements/ascend.txt, ascend-image.txt and upstream/*.txt with what they pull in, resolved\n"
                  "# together by uv for Python 3.11 on Linux (aarch64 and x86_64). Used as `pip install -c`.\n")
        with open(ASCEND_LOCK + ".new") as f:
            body = f.read()
        with open(ASCEND_LOCK, "w") as f:
            f.write(header + body.replace(REQ + "/", "requirements/"))
        os.remove(ASCEND_LOCK + ".new")
        print(f"wrote {_rel(ASCEND_LOCK)}")
        return 0
    if cmd not in ("static", "resolve"):
        print(f"tools/check_pins.py: unknown command {cmd!r}; allowed: static, resolve, lock", file=sys.stderr)
        return 2
    problems = static_problems() if cmd == "static" else resolve_problems()
    for p in problems:
        print(p, file=sys.stderr)
    if not problems:
        print(f"check_pins {cmd}: ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
