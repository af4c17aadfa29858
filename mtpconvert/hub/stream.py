"""`pull-and-quantize --stream`: raw shards arrive just before they are read and go once used.

The plan is built from sparse stubs (each shard's header, fetched with one range request,
at the shard's full size with holes for the data), so it knows every tensor's shard before
any data is downloaded. Execution then asks for a shard when it first reads from it; the
shard is downloaded and moved over its stub. When the last item that reads a shard has been
written, the shard is deleted. The next shard (in first-use order) is prefetched in the
background only while fewer than ``keep`` downloaded shards are on disk, so raw data on disk
never exceeds the ``keep`` largest shards, unless one item reads from more than ``keep``
shards at once (then exactly those are present).

``keep`` is ``options.RawPolicy.shards_held``, ``1 + prefetch_shards`` (``--prefetch-shards``): 1 (the
default) downloads the next shard while one converts; 0 holds one raw shard at a time, each download
starting when the previous shard is deleted (no overlap of download and conversion).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Callable, Dict, List, Optional

from ..errors import ConvertError
from ..logs import mute_abandoned


class ShardStream:
    """Downloads shards on demand (plus one ahead) and deletes them after their last use.

    ``fetch(name, dest)`` downloads one shard to ``dest`` (a path beside the stub), raising
    on failure. ``order`` lists the stub paths in the order execution first reads them.
    """

    def __init__(self, order: List[Path], fetch: Callable[[str, Path], None], keep: int = 2):
        self.order = list(order)
        self.fetch = fetch
        self.keep = keep
        self._lock = threading.Condition()
        self._state: Dict[Path, str] = {p: "stub" for p in self.order}  # stub|fetching|ready|released
        self._errors: Dict[Path, BaseException] = {}
        self._threads: List[threading.Thread] = []
        self._closed = False  # no new downloads once the conversion is over
        self.present_bytes = 0
        self.peak_bytes = 0  # most downloaded raw bytes on disk at once

    # -- called by execution: whole shards need no per-block bookkeeping
    def expect(self, blocks) -> None:
        pass

    def acquire(self, key: object) -> None:
        pass

    def done(self, key: object) -> None:
        pass

    # -- called by the reader
    def ensure(self, stub: Path) -> None:
        """Block until ``stub`` holds the real shard (download it now if nobody is)."""
        with self._lock:
            state = self._state.get(stub)
            if state is None:
                return  # not a streamed file
            if state == "released":
                raise ConvertError(f"{stub.name} was read after its last planned use", file=stub)
            if state == "stub":
                self._start(stub)
            while self._state[stub] == "fetching":
                self._lock.wait()
            if stub in self._errors:
                raise self._errors.pop(stub)
            self._prefetch()

    def admits(self, stub: Path) -> bool:
        """Whether reading ``stub`` now keeps within ``keep`` raw shards: it is here or on its way,
        or fewer than ``keep`` are. When not, the reader finishes the items in flight first (their
        last use releases shards) and then reads it anyway: an item may need more shards than ``keep``."""
        with self._lock:
            state = self._state.get(stub)
            return state is None or state in ("fetching", "ready") or self._held() < self.keep

    def release(self, stub: Path) -> None:
        """The last item reading ``stub`` is written: delete the shard, maybe fetch the next."""
        with self._lock:
            if self._state.get(stub) != "ready":
                return
            size = stub.stat().st_size
            stub.unlink()
            self._state[stub] = "released"
            self.present_bytes -= size
            self._prefetch()

    def close(self) -> None:
        """After a finished conversion: wait for downloads still running (a prefetch nobody read)."""
        self._closed = True
        for t in self._threads:
            t.join()

    def abandon(self) -> None:
        """After a failure or Ctrl-C: start nothing more and wait for nothing. A download in flight
        may take minutes; its daemon thread finishes (or ends with the process) on its own, unheard."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        mute_abandoned(threads)

    # -- internals (lock held)
    def _held(self) -> int:
        return sum(1 for s in self._state.values() if s in ("fetching", "ready"))

    def _prefetch(self) -> None:
        if self._closed:
            return
        nxt = next((p for p in self.order if self._state[p] == "stub"), None)
        if nxt is not None and self._held() < self.keep:
            self._start(nxt)

    def _start(self, stub: Path) -> None:
        self._errors.pop(stub, None)  # a failed prefetch is retried when the shard is needed
        self._state[stub] = "fetching"
        t = threading.Thread(target=self._download, args=(stub,), name=f"fetch {stub.name}", daemon=True)
        self._threads.append(t)
        t.start()

    def _download(self, stub: Path) -> None:
        part = stub.with_name(stub.name + ".download")
        error: Optional[BaseException] = None
        try:
            self.fetch(stub.name, part)
            os.replace(part, stub)
        except BaseException as e:  # noqa: BLE001 - handed to the reader that waits for it
            error = e
        with self._lock:
            if error is not None:
                self._errors[stub] = error
                self._state[stub] = "stub"
            else:
                self._state[stub] = "ready"
                self.present_bytes += stub.stat().st_size
                self.peak_bytes = max(self.peak_bytes, self.present_bytes)
            self._lock.notify_all()


def raw_feed(pulled, plan, ckpt, *, token: Optional[str], timeout: float, keep: int, window: Optional[int],
             on_download: Callable[[int, Optional[int]], None]):
    """Where a streamed conversion reads raw data from: byte ranges at most ``window`` bytes ahead
    (``ranges.RangeStream``), or whole shards, ``keep`` on disk at once (``ShardStream``).
    ``on_download(bytes, total)`` as data arrives: first (0, the total, when whole shards make it known)."""
    from . import pull
    from .ranges import RangeStream
    from .sparse import RangeReader

    if window is not None:
        on_download(0, None)
        ranges = RangeReader(pulled.repo_id, pulled.sha, token=token)

        def fetch_range(name: str, start: int, end: int) -> bytes:
            data = ranges.read(name, start, end)
            on_download(len(data), None)
            return data

        return RangeStream(fetch_range, window)
    order = first_use_order(plan, ckpt)
    sizes = {f.name: f.size or 0 for f in pulled.files}
    on_download(0, sum(sizes.get(p.name, 0) for p in order) or None)

    def fetch_shard(name: str, dest: Path) -> None:
        pull.fetch_file(pulled, name, dest, token=token, timeout=timeout)
        on_download(sizes.get(name, 0), None)

    return ShardStream(order, fetch_shard, keep=keep)


def first_use_order(plan, ckpt) -> List[Path]:
    """Source files in the order execution first reads them."""
    seen: Dict[Path, None] = {}
    for item in plan.items:
        for s in item.sources:
            seen.setdefault(ckpt.tensors[s.key].file, None)
    return list(seen)
