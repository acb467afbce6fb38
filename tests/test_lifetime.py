"""lifetime.die_with_parent: a spawned child whose parent was SIGKILLed before the child asked for
PR_SET_PDEATHSIG (a rollout worker imports torch first) does not run on without it."""
import multiprocessing as mp
import os
import signal
import sys
import time

import pytest


def _child(path):
    time.sleep(1.0)                      # the parent is SIGKILLed meanwhile
    from periodic_async.lifetime import die_with_parent
    die_with_parent()
    with open(path, "w") as f:
        f.write("ran on")


def _parent(path):
    mp.get_context("spawn").Process(target=_child, args=(path,)).start()
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_child_of_an_already_dead_parent_dies_at_die_with_parent(tmp_path):
    path = str(tmp_path / "ran_on")
    p = mp.get_context("spawn").Process(target=_parent, args=(path,))
    p.start()
    p.join(30)
    time.sleep(4)                        # the child: spawn start-up + 1 s + die_with_parent
    assert not os.path.exists(path)
