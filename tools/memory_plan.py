"""What each device of a run holds, before the run: model state (exact), activations, logits and the
rollout engines' weights + KV cache (estimates), against the device's memory
(periodic_async/memory_plan.py). The trainer refuses at start-up a config that does not fit; this
prints the table, on any machine (no accelerator, no checkpoint needed: a known checkpoint's
architecture comes from a built-in table when model.path is not here).

    python tools/memory_plan.py --config configs/qwen2.5-7b-910b.yaml
    python tools/memory_plan.py --config configs/qwen2.5-7b-910b.yaml parallel.tensor_model_parallel_size=2
    python tools/memory_plan.py --config configs/qwen2.5-0.5b-gpu.yaml --device-memory-gb 40
    python tools/memory_plan.py --config configs/qwen2.5-7b-910b.yaml rollout.num_workers=2 rollout.tensor_parallel_size=2

Exit status: 0 fits (or nothing to check), 1 does not fit, 2 config error.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# per backend when --device-memory-gb is not given: a 910B's HBM, an A100 / H100's; cpu: no limit
DEFAULT_DEVICE_GIB = {"npu": 64.0, "cuda": 80.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="YAML config (default: the built-in defaults)")
    p.add_argument("--device-memory-gb", type=float, default=None,
                   help="memory per device in GiB (default: 64 on npu, 80 on cuda, none on cpu)")
    p.add_argument("--worker-memory-gb", type=float, default=None,
                   help="memory per rollout-worker device in GiB (default: --device-memory-gb)")
    p.add_argument("--nproc", type=int, default=None,
                   help="trainer processes on the node (NPROC_PER_NODE; default TP x PP)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. actor.micro_batch_size=2")
    a = p.parse_args(argv)

    from periodic_async.config import ConfigError, load_config
    from periodic_async.memory_plan import GiB, plan_memory, resolve_arch
    from periodic_async.errors import InputError
    try:
        cfg = load_config(a.config, a.overrides)
        arch, source = resolve_arch(cfg)
        tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
        nproc = a.nproc or tp * pp
        cfg.validate(world_size=nproc, num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads,
                     vocab_size=arch.vocab_size, num_layers=arch.num_layers)
    except (ConfigError, InputError) as e:   # InputError: an unreadable or unsupported config.json
        print(f"config error: {e}", file=sys.stderr)
        return 2
    gib = a.device_memory_gb if a.device_memory_gb is not None else DEFAULT_DEVICE_GIB.get(cfg.backend)
    worker_gib = a.worker_memory_gb if a.worker_memory_gb is not None else gib
    plan = plan_memory(cfg, arch, None if gib is None else int(gib * GiB),
                       None if worker_gib is None else int(worker_gib * GiB), world_size=nproc,
                       local_world_size=nproc, arch_source=source)
    print(f"memory plan of {a.config or 'the default config'}" + (f" {' '.join(a.overrides)}" if a.overrides else ""))
    print(plan.format())
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
