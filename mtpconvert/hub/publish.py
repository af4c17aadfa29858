"""`pull-and-quantize --stream --upload-repo`: output shards go to the Hub as they are finished.

Each finished model shard is pre-uploaded with huggingface_hub's ``preupload_lfs_files`` (LFS,
or Xet where ``hf_xet`` is installed; both content-addressed by sha256) in a background thread
while the next shard is written. Once the Hub holds it, the shard is replaced in place by a
*header stub*: its safetensors header and its 1-D tensors (norms, biases) at the file's full
size, the matrices a hole (a few filesystem blocks on disk), so ``verify`` runs unchanged: it
reads headers and the norm vectors. At most two finished model shards hold
data at once: the one uploading and the one being written.

Nothing is visible in the repo until the end: one ``create_commit`` adds every file (the
pre-uploaded shards by their sha256, the MTP sidecar uploaded once and committed under both
``mtp.safetensors`` and ``mtp/weights.safetensors``, config, tokenizer, index and the card
from memory). A failure before it leaves no commit.

Retries: a shard the Hub already holds is not sent again (its LFS batch answer has no upload
action; Xet skips the chunks it has). With ``--resume``, a ledger record beside each shard's
resume record (sha256, size, first 512 bytes) lets the next run skip rebuilding a shard whose
stub is there and whose object the Hub still reports holding.

The smoke needs the weights, and no Hub API serves an object before it is committed. With a
``consumer`` (``runtime.smoke.streamed.StreamedLayerwise``: the layerwise smoke fed shard by shard) each
finished shard is fed to it first, and a shard is stubbed once it is both uploaded and released
by the consumer (it no longer reads from it: it has run the layers the shard completes and holds in
memory what it reads later): disk stays two output shards and the sidecar (plus the consumer's copy
of an in-model head). With ``keep_files`` (the full smoke, which loads the whole folder) shards are
kept until the end.
"""

from __future__ import annotations

import base64
import json
import os
import threading
from pathlib import Path
from typing import Callable, Dict, List, Optional

from ..io.output_folder import RESUME_DIR
from ..io.checkpoint import MTP_FILE
from ..options import PublishOptions
from ..plan.head import MTP_LINK
from .errors import HubError, hub_api, hub_error
from .upload import folder_operations

LEDGER_SUFFIX = ".upload.json"


def uploaded_op(path_in_repo: str, size: int, sample: bytes, sha256: bytes):
    """A commit entry for bytes the Hub already holds: committed by sha256, never read or sent again.

    The same state ``preupload_lfs_files(free_memory=True)`` leaves an operation in."""
    from huggingface_hub import CommitOperationAdd
    from huggingface_hub.lfs import UploadInfo

    op = CommitOperationAdd(path_in_repo=path_in_repo, path_or_fileobj=b"")
    op.upload_info = UploadInfo(size=size, sample=sample, sha256=sha256)
    op._upload_mode, op._should_ignore, op._is_uploaded = "lfs", False, True
    return op


def stub_in_place(path: Path) -> None:
    """Free a shard's matrices, keep its header and its vectors at the full size; same inode.

    ``verify`` reads headers and the norm vectors (their centre tells the layout), so the 1-D
    tensors (norms, biases: a few KB each) keep their bytes; everything else becomes a hole."""
    with open(path, "r+b") as f:
        header_len = 8 + int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len - 8))
        vectors = [(header_len + a, header_len + b) for key, t in header.items()
                   if key != "__metadata__" for a, b in [t["data_offsets"]] if len(t["shape"]) <= 1]
        kept = []
        for start, stop in vectors:
            f.seek(start)
            kept.append((start, f.read(stop - start)))
        size = os.fstat(f.fileno()).st_size
        f.truncate(header_len)
        f.truncate(size)
        for start, data in kept:
            f.seek(start)
            f.write(data)


def allocated_bytes(path: Path) -> int:
    return path.stat().st_blocks * 512


class ShardPublisher:
    """Pre-uploads finished shards to ``repo_id`` (one in flight) and commits the folder once at the end.

    ``execute`` calls ``delivered``/``finished`` (its ``ShardSink``); the caller calls ``drain``
    before the checks, ``commit`` after them, ``abandon`` on failure. ``keep_files``: keep each
    shard's data after its upload (the full smoke reads the folder) instead of stubbing it.
    ``consumer``: fed each finished shard before its upload starts (``feed(shard, path)`` returns
    the shards it no longer needs); a shard is stubbed when uploaded and no longer needed.
    """

    def __init__(self, repo_id: str, partial: Path, *, token: Optional[str] = None, private: bool = False,
                 keep_files: bool = False, consumer=None):
        self.repo_id, self.token, self.private, self.keep_files = repo_id, token, private, keep_files
        self.consumer = consumer
        self._lock = threading.Lock()
        self._paths: Dict[str, Path] = {}
        self._uploaded: set = set()  # shards the Hub holds (this run)
        self._free: set = set()  # shards whose local data nothing reads any more
        self.ledger = Path(partial) / RESUME_DIR
        self.api = hub_api(token)
        self.ops: Dict[str, object] = {}  # shard -> its commit entry, once the Hub holds it
        self.stubbed: List[str] = []  # shards whose local data was freed
        self.sent = 0  # shards whose upload this run started (held ones are answered without bytes)
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._held: Optional[Dict[str, bool]] = None  # sha256 -> the Hub holds it (asked once, on resume)

    def open(self) -> None:
        """Create the repo (an error here costs no conversion work)."""
        try:
            self.api.create_repo(self.repo_id, repo_type="model", private=self.private, exist_ok=True,
                                 token=self.token)
        except Exception as e:  # noqa: BLE001
            raise hub_error(e, self.repo_id, "create repo") from e

    # -- execute's ShardSink
    def delivered(self, shard: str, fingerprint: str) -> Optional[int]:
        if self.consumer is not None:
            return None  # its stub cannot be fed: rebuilt (the Hub answers that it holds it: nothing sent)
        record = self._ledger_record(shard)
        stub = self.ledger.parent / shard
        if (record is None or record.get("fingerprint") != fingerprint or record.get("repo") != self.repo_id
                or not stub.is_file() or stub.stat().st_size != record["size"]):
            return None
        if not self._hub_holds(record["sha256"]):
            return None  # e.g. never committed and since removed by the Hub: rebuild and send it again
        self.ops[shard] = uploaded_op(shard, record["size"], base64.b64decode(record["sample"]),
                                      bytes.fromhex(record["sha256"]))
        return record["size"]

    def finished(self, shard: str, path: Path, fingerprint: str) -> None:
        self._paths[shard] = Path(path)
        # the consumer first, while this shard and the one before hold data (a layer may span both)
        free = self.consumer.feed(shard, path) if self.consumer is not None else [] if self.keep_files else [shard]
        self._wait()  # the previous shard's upload: at most one shard uploads while the next is written
        with self._lock:
            self._free.update(free)
        self._stub_ready()
        self._thread = threading.Thread(target=self._upload, args=(shard, Path(path), fingerprint),
                                        name=f"upload {shard}", daemon=True)
        self.sent += 1
        self._thread.start()

    # -- the caller's
    def drain(self) -> None:
        """Wait for the last upload; raise its error."""
        self._wait()

    def abandon(self) -> None:
        """After a failure or Ctrl-C: wait for nothing (an upload in flight ends with the process)."""
        self._thread = None

    def commit(self, folder: Path, card: Optional[str], message: str) -> str:
        """One commit with every file of ``folder`` (hidden ones left out) and the card; return its url."""
        self._wait()
        ops = [self.ops.get(op.path_in_repo, op) for op in folder_operations(Path(folder), card)]
        ops = self._head_once(Path(folder), ops)
        try:
            info = self.api.create_commit(repo_id=self.repo_id, operations=ops, repo_type="model", token=self.token,
                                          commit_message=message)
        except Exception as e:  # noqa: BLE001
            raise hub_error(e, self.repo_id, "commit") from e
        return str(getattr(info, "commit_url", info))

    # -- internals
    def _wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _upload(self, shard: str, path: Path, fingerprint: str) -> None:
        try:
            op = self._preupload(shard, str(path))
            if op._upload_mode != "lfs":  # the Hub wants it inline in the commit: it stays on disk
                return
            info = op.upload_info
            self._write_ledger(shard, {"fingerprint": fingerprint, "repo": self.repo_id, "size": info.size,
                                       "sha256": info.sha256.hex(),
                                       "sample": base64.b64encode(info.sample).decode()})
            self.ops[shard] = uploaded_op(shard, info.size, info.sample, info.sha256)
            with self._lock:
                self._uploaded.add(shard)
            self._stub_ready()
        except BaseException as e:  # noqa: BLE001 - raised in the converting thread by the next _wait
            self._error = e

    def _stub_ready(self) -> None:
        """Stub every shard the Hub holds and nothing reads any more (either thread may get here last)."""
        with self._lock:
            for shard in sorted((self._uploaded & self._free) - set(self.stubbed)):
                stub_in_place(self._paths[shard])
                self.stubbed.append(shard)

    def _preupload(self, path_in_repo: str, local: str):
        from huggingface_hub import CommitOperationAdd

        op = CommitOperationAdd(path_in_repo=path_in_repo, path_or_fileobj=local)
        try:
            self.api.preupload_lfs_files(self.repo_id, [op], token=self.token, repo_type="model", free_memory=False)
        except Exception as e:  # noqa: BLE001
            raise _upload_error(e, self.repo_id, path_in_repo) from e
        return op

    def _head_once(self, folder: Path, ops: list) -> list:
        """The MTP sidecar and its hard link are the same bytes: send them once, commit both paths."""
        names = [op.path_in_repo for op in ops]
        if MTP_FILE not in names or MTP_LINK not in names:
            return ops
        if not os.path.samefile(folder / MTP_FILE, folder / MTP_LINK):
            return ops
        head = self._preupload(MTP_FILE, str(folder / MTP_FILE))
        if head._upload_mode != "lfs":
            return ops
        info = head.upload_info
        by_name = {MTP_FILE: uploaded_op(MTP_FILE, info.size, info.sample, info.sha256),
                   MTP_LINK: uploaded_op(MTP_LINK, info.size, info.sample, info.sha256)}
        return [by_name.get(op.path_in_repo, op) for op in ops]

    def _ledger_record(self, shard: str) -> Optional[dict]:
        try:
            return json.loads((self.ledger / f"{shard}{LEDGER_SUFFIX}").read_text())
        except (OSError, ValueError):
            return None

    def _write_ledger(self, shard: str, record: dict) -> None:
        tmp = self.ledger / f".{shard}{LEDGER_SUFFIX}.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.ledger / f"{shard}{LEDGER_SUFFIX}")

    def _hub_holds(self, sha256: str) -> bool:
        """Ask the LFS batch endpoint once for every recorded object: an object it holds has no upload action."""
        if self._held is None:
            from huggingface_hub.lfs import UploadInfo, post_lfs_batch_info

            records = [r for r in (self._ledger_record(p.name[: -len(LEDGER_SUFFIX)])
                                   for p in self.ledger.glob(f"*{LEDGER_SUFFIX}")) if r]
            infos = [UploadInfo(size=r["size"], sample=b"", sha256=bytes.fromhex(r["sha256"])) for r in records]
            try:
                actions, _, _ = post_lfs_batch_info(infos, token=self.token, repo_type="model", repo_id=self.repo_id,
                                                    endpoint=self.api.endpoint,
                                                    headers=self.api._build_hf_headers(token=self.token))
            except Exception as e:  # noqa: BLE001
                raise hub_error(e, self.repo_id, "LFS batch") from e
            self._held = {a["oid"]: a.get("actions") is None for a in actions}
        return self._held.get(sha256, False)


def _upload_error(e: Exception, repo_id: str, name: str) -> Exception:
    """huggingface_hub wraps a failed transfer in RuntimeError('Error while uploading ...'): name the file."""
    mapped = hub_error(e.__cause__ if isinstance(e, RuntimeError) and e.__cause__ else e, repo_id, name)
    if isinstance(mapped, HubError):
        return mapped
    return HubError(f"uploading {name} to {repo_id} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
                    file=name)


def shard_publisher(publish: PublishOptions, partial: Path, token: Optional[str], plan, checks) -> ShardPublisher:
    """Shards go up as they are written. With the smoke on, the layerwise smoke is fed each shard as it
    is finished and the shard's data is freed once uploaded and consumed (disk: two output shards);
    only ``--smoke-mode full``, which loads the whole folder, keeps every shard until the end."""
    from ..execute.run import index_json
    from ..runtime.smoke.streamed import StreamedLayerwise

    smoke = checks.smoke and plan.mtp_layers > 0
    consumer = None
    if smoke and checks.smoke_mode != "full":
        consumer = StreamedLayerwise(index_json(plan)["weight_map"], plan.family, prompts=checks.prompts,
                                     min_acceptance=checks.floor_for("layerwise"), min_mlp_gain=checks.min_mlp_gain)
    return ShardPublisher(publish.repo_id, partial, token=token, private=publish.private,
                          keep_files=smoke and consumer is None, consumer=consumer)


def committer(publisher: ShardPublisher, on_stage: Callable[[str], None]) -> Callable:
    """After the checks pass, on the temp folder: the card (from the folder and the checks) and the one commit."""
    from .card import model_card

    def commit(folder: Path, record) -> None:
        card = model_card(folder, publisher.repo_id, smoke_acceptance=record.smoke_acceptance,
                          verify_ok=record.verify_ok)
        on_stage(f"committing to {publisher.repo_id}")
        publisher.commit(folder, card, "Upload MLX conversion with MTP head (mtpconvert)")

    return commit
