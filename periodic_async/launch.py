"""torchrun for periodic-async: `python -m periodic_async.launch [torchrun args] -m periodic_async ...`.

The same launcher (torch.distributed.run, same arguments), with one difference in how a failed
run ends. A rank that stops on bad input (a config key, a dataset line, a model file: errors.py)
has already printed its one-line error and exited 2; plain torchrun would then print its
ChildFailedError summary and exit 1, burying that line. Here the launcher exits 2 without the
summary when any rank exited 2, and otherwise prints the summary and exits with the first failed
rank's exit code (130 for a stopped run, 1 for a crash, 1 when a rank died of a signal).
"""
from __future__ import annotations

import sys

from .errors import INPUT_ERROR_EXIT_CODE


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
        if INPUT_ERROR_EXIT_CODE in codes:
            return INPUT_ERROR_EXIT_CODE
        print(e.format_msg(), file=sys.stderr)
        _, first = e.get_first_failure()
        return first.exitcode if first.exitcode > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
