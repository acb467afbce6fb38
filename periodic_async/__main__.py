"""`python -m periodic_async [--config FILE] [--backend cpu|cuda|npu] [key=value ...]`.

Under torchrun every rank runs this; a plain python run is a single-process job.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import warnings

from .errors import INPUT_ERROR_EXIT_CODE


def _quiet_third_party() -> None:
    # Megatron-core warns about Apex / Transformer Engine being absent once per module with a
    # fallback; they are optional here, and one line says so (main, once the Trainer is built).
    # Its FSDP package logs at INFO that it found Megatron-core and no Transformer Engine: FSDP is
    # not used.
    from .backend_setup import quiet_megatron_fallbacks
    quiet_megatron_fallbacks()
    warnings.filterwarnings("ignore", message=r".*Apex is not installed.*")
    logging.getLogger("megatron.core.distributed.fsdp").setLevel(logging.WARNING)
    # Megatron's distributed checkpoints go through torch.distributed.checkpoint's ShardedTensor
    # path, which torch marks deprecated at every save and load.
    warnings.filterwarnings("ignore", message=r".*deprecating ShardedTensor.*")
    warnings.filterwarnings("ignore", message=r".*`load_state_dict` is deprecated.*", category=FutureWarning)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="periodic_async", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="YAML config (default: configs/default.yaml settings)")
    parser.add_argument("--backend", default=None, choices=["cpu", "cuda", "npu"],
                        help="device backend (overrides the config's `backend`)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. actor.lr=1e-3")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _quiet_third_party()

    from .backend import BackendUnavailable
    from .config import ConfigError, load_config
    overrides = list(args.overrides) + ([f"backend={args.backend}"] if args.backend else [])
    try:
        cfg = load_config(args.config, overrides)   # validated by the Trainer, against the model
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return INPUT_ERROR_EXIT_CODE
    # SIGTERM unwinds like Ctrl-C, so that every `finally` runs and the rollout workers and reward
    # processes are stopped and joined (no orphans).
    # During training the first SIGTERM / Ctrl-C finishes the step, writes a checkpoint and stops
    # (train/stop.py); otherwise, or the second time, it unwinds like Ctrl-C.
    from .train.stop import STOP
    signal.signal(signal.SIGTERM, STOP.handle_signal)
    # and Ctrl-C / SIGINT does the same even when the launching shell ignored it (a background job)
    signal.signal(signal.SIGINT, STOP.handle_signal)
    from .errors import InputError
    from .train.trainer import Trainer
    # An input error (a missing or truncated model file, a bad dataset row: errors.py) is one line
    # and exit 2 like a config error, on every rank: caught here, it never reaches torch's
    # excepthook, which under torchrun prints the whole traceback with a [rankN]: prefix.
    try:
        trainer = Trainer(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return INPUT_ERROR_EXIT_CODE
    except (BackendUnavailable, InputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return INPUT_ERROR_EXIT_CODE
    except KeyboardInterrupt:   # e.g. torchrun stopping this rank because another one failed
        print("interrupted during set-up", file=sys.stderr)
        return 130
    # said once the set-up stands (an input error above stays the one line a failed start prints)
    from .backend_setup import megatron_fallback_note
    note = megatron_fallback_note()
    if note and int(os.environ.get("RANK", "0")) == 0:
        logging.getLogger("periodic_async").info(note)
    from .train.trainer import NonFiniteTraining
    try:
        history = trainer.fit()
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return INPUT_ERROR_EXIT_CODE
    except NonFiniteTraining as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: rollout workers and reward processes stopped", file=sys.stderr)
        return 130
    from .backend import Backend
    Backend.shutdown_distributed()
    if history and int(os.environ.get("RANK", "0")) == 0:
        first, last = (h.get("critic/score/mean", float("nan")) for h in (history[0], history[-1]))
        print(f"done: {len(history)} steps, score {first:.3f} -> {last:.3f}, metrics in "
              f"{os.path.join(cfg.trainer.run_dir, 'metrics.jsonl')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
