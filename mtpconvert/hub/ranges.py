"""`pull-and-quantize --stream --raw-window GB`: raw data fetched by byte ranges, just before it is read.

The executor tells the stream every block it will make, in order, with the byte ranges each
reads (``expect``). Ranges are fetched ahead in first-use order, a few requests at a time, with
adjacent ranges joined up to ``MAX_REQUEST_BYTES``, stopping at the window. Each block waits for
its own ranges (``acquire``); once written (``done``), its ranges are punched out of the sparse
stub, widened over freed neighbours to whole pages, so raw data on disk follows the window, not
the shard size.
"""

from __future__ import annotations

import bisect
import functools
import os
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

from ..errors import ConvertError, OptionsError
from ..logs import mute_abandoned

MAX_REQUEST_BYTES = 16 << 20  # adjacent ranges fetched in one request, up to this much (held in memory meanwhile, twice while it arrives)
PAGE = 4096  # filesystem block a hole is punched in
RANGE_THREADS = 4  # requests in flight: one range request does not fill a link


@functools.lru_cache(maxsize=1)
def _fallocate():
    """libc's fallocate(2), or None (not Linux)."""
    import ctypes
    import ctypes.util

    call = getattr(ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True), "fallocate", None)
    if call is not None:
        call.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    return call


def punch_hole(path: Path, start: int, end: int) -> bool:
    """Give bytes ``start:end`` of a file back to the filesystem (they read as zeros after). False
    where the platform or filesystem cannot: the bytes then stay until the file is deleted."""
    fallocate = _fallocate()
    if fallocate is None:
        return False
    fd = os.open(path, os.O_WRONLY)
    try:
        keep_size_punch_hole = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE (linux/falloc.h)
        return fallocate(fd, keep_size_punch_hole, start, end - start) == 0
    finally:
        os.close(fd)


@dataclass(eq=False)  # one object per range: compared and hashed by identity
class _Interval:
    """Bytes of one source file that planned blocks read (overlapping reads merged), fetched once."""

    file: Path
    start: int
    end: int
    users: int = 0  # planned blocks not done with it
    state: str = "pending"  # pending|fetching|ready|failed|freed, or fetching-freed: freed while its request runs
    forced: bool = False  # an acquired block waits for it: fetched even beyond the window

    @property
    def size(self) -> int:
        return self.end - self.start


class RangeStream:
    """Fills the byte ranges each block reads into the sparse shard stubs just before the block is
    made, and punches them out again once it is written: raw data on disk stays within ``window``
    bytes (plus the blocks in flight), whatever the shard size.

    ``expect`` is told every block in execution order (its key and ``execute.blocks.block_ranges``);
    ranges are then fetched in first-use order by ``threads`` requests at a time, as far ahead as
    the window allows. ``acquire(key)`` blocks until the block's ranges hold data; ``done(key)``
    frees what no later block reads (also for a block that was never made: a reused output shard).
    ``fetch(name, start, end)`` returns those bytes of the source file ``name``.

    File-level hooks (``TensorReader``'s): ``ensure`` (the stub is there already), ``admits``
    (always: the window is counted in bytes) and ``release`` (the stub is deleted).
    """

    def __init__(self, fetch: Callable[[str, int, int], bytes], window: int, threads: int = RANGE_THREADS,
                 max_request: int = MAX_REQUEST_BYTES):
        if window <= 0:
            raise OptionsError(f"--raw-window must be more than 0, not {window!r}")
        self.fetch, self.window, self.max_request = fetch, window, max_request
        self._lock = threading.Condition()
        self._order: List[_Interval] = []  # first-use order
        self._blocks: Dict[object, List[_Interval]] = {}
        self._errors: Dict[_Interval, BaseException] = {}  # why a range's fetch failed
        self._position: Dict[_Interval, int] = {}  # a range's index in _order
        self._by_file: Dict[Path, List[_Interval]] = {}  # each file's ranges by offset
        self._file_index: Dict[_Interval, int] = {}  # a range's index in its file's list
        self._forced: Deque[_Interval] = deque()  # pending ranges an acquired block waits for, oldest first
        self._next = 0  # every range before this index of _order has left "pending"
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"range-fetch-{i}", daemon=True)
                         for i in range(threads)]
        self.held_bytes = 0  # fetching or holding data, not yet freed
        self.peak_bytes = 0
        self.fetched_bytes = 0
        self.requests = 0
        self.punched = True  # every freed range went back to the filesystem

    # -- planning
    def expect(self, blocks: Sequence[Tuple[object, Sequence[Tuple[str, int, int]]]]) -> None:
        """Every block execution will make, in order: ``(key, [(file, start, end), ...])``."""
        blocks = list(blocks)
        by_file: Dict[Path, List[Tuple[int, int]]] = {}
        for _, ranges in blocks:
            for file, start, end in ranges:
                by_file.setdefault(Path(file), []).append((start, end))
        merged: Dict[Path, List[_Interval]] = {}
        for file, spans in by_file.items():
            out: List[_Interval] = []
            for start, end in sorted(spans):
                if out and start < out[-1].end:  # read by two blocks: one fetch, freed after both
                    out[-1].end = max(out[-1].end, end)
                else:
                    out.append(_Interval(file, start, end))
            merged[file] = out
        starts = {file: [iv.start for iv in spans] for file, spans in merged.items()}
        self._by_file = merged
        self._file_index = {iv: i for spans in merged.values() for i, iv in enumerate(spans)}
        first: Dict[_Interval, int] = {}
        for n, (key, ranges) in enumerate(blocks):
            found = []
            for file, start, end in ranges:
                spans = merged[Path(file)]
                iv = spans[bisect.bisect_right(starts[Path(file)], start) - 1]
                if iv not in found:
                    found.append(iv)
                    iv.users += 1
                    first.setdefault(iv, n)
            if key in self._blocks:
                raise ValueError(f"block {key!r} planned twice")
            self._blocks[key] = found
        self._order = sorted((iv for spans in merged.values() for iv in spans), key=lambda iv: first[iv])
        self._position = {iv: i for i, iv in enumerate(self._order)}
        for t in self._threads:
            t.start()

    # -- called by execution
    def acquire(self, key: object) -> None:
        """Block until every range ``key`` reads holds data (fetched now if the prefetch has not)."""
        with self._lock:
            intervals = self._blocks.get(key)
            if intervals is None:
                raise ConvertError(f"block {key!r} was not planned for the ranged stream")
            for iv in intervals:
                if iv.state == "freed":
                    raise ConvertError(f"{iv.file.name} bytes {iv.start}-{iv.end} were read after their last "
                                       "planned use", file=iv.file)
                if iv.state == "failed":  # a prefetch that failed is tried once more, now that it is needed
                    self._errors.pop(iv, None)
                    iv.state = "pending"
                if iv.state == "pending":
                    iv.forced = True
                    self._forced.append(iv)
            self._lock.notify_all()
            while any(iv.state in ("pending", "fetching") for iv in intervals):
                self._lock.wait()
            for iv in intervals:
                if iv.state == "failed":
                    raise self._errors.pop(iv)

    def done(self, key: object) -> None:
        """The block is written (or will never be made): free the ranges no later block reads."""
        with self._lock:
            for iv in self._blocks.get(key, ()):
                iv.users -= 1
                if iv.users == 0:
                    self._free(iv)
            self._lock.notify_all()

    def ensure(self, file: Path) -> None:
        """The stub is the file: ranges are filled in by ``acquire``."""

    def admits(self, file: Path) -> bool:
        return True

    def release(self, file: Path) -> None:
        """No item reads ``file`` any more: delete its stub."""
        Path(file).unlink(missing_ok=True)

    def close(self) -> None:
        """After a finished conversion: stop the fetch threads (nothing is left to fetch)."""
        self.abandon()
        for t in self._threads:
            if t.is_alive():
                t.join()

    def abandon(self) -> None:
        """After a failure or Ctrl-C: start no more requests; those in flight end on their own, unheard."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        mute_abandoned(self._threads)

    # -- internals (lock held)
    def _free(self, iv: _Interval) -> None:
        if iv.state == "fetching":  # the request in flight frees it when it lands
            iv.state = "fetching-freed"
            return
        if iv.state == "ready":
            self.held_bytes -= iv.size
            if iv.file.exists():
                self.punched = punch_hole(iv.file, *self._punch_span(iv)) and self.punched
        iv.state = "freed"

    def _punch_span(self, iv: _Interval) -> Tuple[int, int]:
        """``iv``'s bytes, widened over freed neighbours to whole filesystem pages where it can: a punch
        only zeroes a partly covered page, so small ranges punched one by one would each keep theirs."""
        spans, i = self._by_file[iv.file], self._file_index[iv]
        lo, hi = iv.start, iv.end
        floor, ceil = lo - lo % PAGE, hi + (-hi) % PAGE
        j = i - 1
        while lo > floor and j >= 0:  # before the first range lies the header: never widened into
            left = spans[j]
            lo = max(floor, left.end if left.state != "freed" else left.start)
            if left.state != "freed":
                break
            j -= 1
        j = i + 1
        while hi < ceil:
            right = spans[j] if j < len(spans) else None
            hi = min(ceil, right.start if right is not None and right.state != "freed"
                     else right.end if right is not None else ceil)
            if right is None or right.state != "freed":
                break
            j += 1
        return lo, hi

    def _take(self) -> Optional[List[_Interval]]:
        """The next request: the oldest range an acquired block waits for, else the next in first-use
        order if it fits the window; with the ranges right after it in the same file, in one request."""
        while self._forced and self._forced[0].state != "pending":
            self._forced.popleft()
        while self._next < len(self._order) and self._order[self._next].state != "pending":
            self._next += 1
        if self._forced:
            head = self._forced.popleft()
        elif self._next < len(self._order) and self.held_bytes + self._order[self._next].size <= self.window:
            head = self._order[self._next]
        else:
            return None
        batch, size = [head], head.size
        i = self._position[head] + 1
        while i < len(self._order):
            iv = self._order[i]
            if (iv.state != "pending" or iv.file != head.file or iv.start != batch[-1].end
                    or size + iv.size > self.max_request
                    or (not iv.forced and self.held_bytes + size + iv.size > self.window)):
                break
            batch.append(iv)
            size += iv.size
            i += 1
        for iv in batch:
            iv.state = "fetching"
        self.held_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return batch

    def _work(self) -> None:
        while True:
            with self._lock:
                batch = None
                while not self._closed and (batch := self._take()) is None:
                    self._lock.wait()
                if self._closed:
                    return
            first, error = batch[0], None
            start, end = first.start, batch[-1].end
            try:
                fd = os.open(first.file, os.O_WRONLY)
                try:
                    for at in range(start, end, self.max_request):  # a range over the request size: in parts
                        upto = min(at + self.max_request, end)
                        data = self.fetch(first.file.name, at, upto)
                        if len(data) != upto - at:
                            raise ConvertError(f"asked for bytes {at}-{upto}, got {len(data)}", file=first.file)
                        view, written = memoryview(data), 0
                        while written < len(data):
                            written += os.pwrite(fd, view[written:], at + written)
                finally:
                    os.close(fd)
            except BaseException as e:  # noqa: BLE001 - raised by the block that waits for it
                error = e
            with self._lock:
                self.requests += 1
                for iv in batch:
                    freed = iv.state == "fetching-freed"  # a block that will never be made (a reused shard)
                    if error is not None:
                        self.held_bytes -= iv.size
                        iv.state = "freed" if freed else "failed"
                        if not freed:
                            self._errors[iv] = error
                    else:
                        self.fetched_bytes += iv.size
                        iv.state = "ready"
                        if freed:
                            self._free(iv)
                self._lock.notify_all()
