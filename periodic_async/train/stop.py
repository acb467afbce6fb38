"""A clean stop at the next step boundary, for SIGTERM and Ctrl-C during training.

The first signal while the training loop runs asks it to finish the current step, write a
checkpoint and stop (every rank agrees at the boundary, train/trainer.py); a second signal, or
one outside the loop (set-up), stops at once by raising KeyboardInterrupt, so every `finally`
still closes the workers. A preempted job thus loses no finished step, and a resumed one starts
where it stopped.
"""
from __future__ import annotations

import sys


class StopRequest:
    def __init__(self):
        self.requested = False
        self.in_loop = False        # set by Trainer.fit while steps run

    def handle_signal(self, signum, frame) -> None:
        if self.in_loop and not self.requested:
            self.requested = True
            print(f"signal {signum}: stopping after this step, with a checkpoint (send it again to stop now)",
                  file=sys.stderr, flush=True)
            return
        raise KeyboardInterrupt(f"signal {signum}")


STOP = StopRequest()
