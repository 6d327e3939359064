"""Rank 1 is killed (SIGKILL) in the middle of Gluon training, as the OOM killer would.

No Python code runs in a killed process, so nothing in the store can react:
the launcher must see the death and end the other ranks, which wait in a
collective for it. The job must end within seconds, non-zero.
"""
import os
import signal

from fault_exception import FAILING_RANK, FAILING_STEP, announce, batches, train

from common import RANK


def kill_at(step):
    if RANK == FAILING_RANK and step == FAILING_STEP:
        announce('is killed')
        os.kill(os.getpid(), signal.SIGKILL)


train(batches(), kill_at)
