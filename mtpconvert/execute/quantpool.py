"""npquant's worker processes, returning their results through shared memory.

A worker reads its block's source rows itself and writes the packed weights, scales and
biases into one slot of a shared segment; the parent hands those bytes to the shard
writer as they are, and frees the slot once they are on disk. Only the task and a flag
cross the pipe: sending each ~4 MB result through it cost the parent's result thread
~2.4 CPU-s per 8 GiB converted, and the workers their pickling, on two shared cores.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import List, Optional, Tuple

import numpy as np

from ..errors import ConvertError
from . import npquant

class WorkerDied(ConvertError):
    default_code = "worker-died"


@contextmanager
def interrupts_blocked():
    """Hold off Ctrl-C and SIGTERM in this thread while worker processes are started: they inherit
    the mask, so a signal to the group cannot kill one while it starts, before ``worker_init``
    makes it ignore them. The parent gets a signal held meanwhile as soon as the block ends."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, npquant.INTERRUPTS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


Task = Tuple[list, str, str, int, int]  # npquant.quantize_file_rows's arguments: reads, dtypes, bits, group size


@dataclass
class Pending:
    """A block being quantized in a worker, and the slot its result goes to."""

    future: Future
    slot: int
    groups: int
    task: Task


class QuantizerPool:
    """``workers`` npquant processes sharing ``slots`` result slots of ``slot_bytes`` each.

    The caller takes a slot with each ``submit`` (check ``has_free_slot`` first: a slot is
    only free again after ``release``) and releases it once the result's bytes are written.
    """

    def __init__(self, workers: int, slots: int, slot_bytes: int):
        self.slot_bytes, self.workers = slot_bytes, workers
        self._free: List[int] = list(range(slots))
        self._shm = shared_memory.SharedMemory(create=True, size=slots * slot_bytes)
        self._buf = np.ndarray((slots * slot_bytes,), np.uint8, self._shm.buf)
        self._procs = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                          initializer=npquant.worker_init)
        with interrupts_blocked():  # start every worker now, none on a later submit
            for _ in range(workers):
                self._procs.submit(os.getpid)

    def has_free_slot(self) -> bool:
        return bool(self._free)

    def submit(self, task: Task) -> Pending:
        reads, _, _, _, group_size = task
        slot = self._free.pop()
        groups = npquant.task_groups(reads, group_size)
        future = self._procs.submit(npquant.quantize_file_rows_into, *task, self._shm.name, slot * self.slot_bytes,
                                    self.slot_bytes)
        return Pending(future, slot, groups, task)

    def result(self, pending: Pending) -> Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(packed, scales, biases) as views of the slot, or None (the slot freed) where a
        group holds a NaN or an infinity."""
        try:
            made = pending.future.result()
        except BrokenProcessPool:
            raise WorkerDied("a quantization worker process died (killed from outside, or by the system when "
                             "memory ran out)", hint="rerun with --resume; MTPCONVERT_NUMPY_QUANT=0 quantizes "
                             "in this process instead") from None
        if not made:
            self.release(pending)
            return None
        _, _, target_dtype, bits, group_size = pending.task
        start = pending.slot * self.slot_bytes
        return npquant.result_views(self._buf[start:start + self.slot_bytes], pending.groups, bits, group_size,
                                    target_dtype)

    def release(self, pending: Pending) -> None:
        self._free.append(pending.slot)

    def close(self) -> None:
        """Stop the workers, then free the segment (also where a view of it is still held:
        unlinking does not wait for the last mapping to go)."""
        self._procs.shutdown(wait=True, cancel_futures=True)
        self._buf = None
        try:
            self._shm.close()
        except BufferError:  # a view in a traceback: the mapping goes with it
            pass
        self._shm.unlink()


def slots_that_fit(wanted: int, slot_bytes: int, shm_dir: str = "/dev/shm") -> int:
    """At most ``wanted`` slots, and no more than half of the shared-memory filesystem's free
    space holds (a container's /dev/shm is often 64 MiB; writing past it would kill a worker)."""
    try:
        st = os.statvfs(shm_dir)
    except OSError:  # no such mount (macOS keeps POSIX shared memory elsewhere)
        return wanted
    return min(wanted, st.f_bavail * st.f_frsize // 2 // slot_bytes)
