"""A loopback server speaking the part of the Hub's HTTP API that huggingface_hub uses.

Serves repos from memory: model info (``/api/models/{repo}/revision/{rev}``), file
resolution with HEAD + ranged GET (``/{repo}/resolve/{rev}/{path}``), repo creation,
preupload, the LFS batch API with basic ``PUT`` transfers (content-addressed by sha256, as the
Hub: an object it holds gets no upload action), and commit (NDJSON: files inline as base64, or
``lfsFile`` lines naming an uploaded object). Every request is logged so tests
can assert what was asked for; faults (401, 404, dropped connections) are injectable.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Dict, List, Optional


@dataclass
class Repo:
    files: Dict[str, bytes]
    sha: str = "0123456789abcdef0123456789abcdef01234567"
    private_token: Optional[str] = None  # if set, requests need "Bearer <token>"
    commits: List[dict] = field(default_factory=list)


@dataclass
class Request:
    method: str
    path: str
    range: Optional[str]
    auth: Optional[str]


class FakeHub:
    def __init__(self):
        self.repos: Dict[str, Repo] = {}
        self.log: List[Request] = []
        self.drop_after: Dict[str, int] = {}  # filename -> bytes to send before cutting the connection once
        self.bytes_per_s: Optional[float] = None  # throttle file downloads (GET without a Range) to this rate
        self.throttle_ranges = False  # throttle ranged GETs too
        self.created: List[dict] = []
        self.validated_yaml: List[str] = []
        self.fail_commits = False  # commits answer 403: an upload that fails after the repo was created
        self.lfs: Dict[str, Dict[str, bytes]] = {}  # repo -> sha256 -> uploaded LFS object (committed or not)
        self.lfs_puts: List[str] = []  # oids whose bytes were sent, in order
        self.fail_lfs_puts_after: Optional[int] = None  # PUTs accepted before every later one answers 403
        self._digests: Dict[tuple, tuple] = {}
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def digest(self, data, algo: str) -> str:
        """A file's sha1/sha256, computed once per file object (large served files are hashed on every request otherwise)."""
        key = (id(data), len(data), algo)
        if key not in self._digests:
            self._digests[key] = (data, hashlib.new(algo, data).hexdigest())
        return self._digests[key][1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def add_folder(self, repo_id: str, folder: Path, **kw) -> Repo:
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        self.repos[repo_id] = Repo(files, **kw)
        return self.repos[repo_id]

    def downloaded(self) -> List[str]:
        """Files whose bytes were requested (GET on resolve)."""
        out = []
        for r in self.log:
            m = re.match(r"^/([^/]+/[^/]+)/resolve/[^/]+/(.+)$", r.path)
            if r.method == "GET" and m:
                out.append(m.group(2))
        return out

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()

    def _handler(hub):  # noqa: N805 - closure over the FakeHub
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _record(self):
                hub.log.append(Request(self.command, self.path.split("?")[0], self.headers.get("Range"),
                                       self.headers.get("Authorization")))

            def _json(self, obj, status=200):
                body = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                if status >= 400:
                    self.send_header("X-Error-Code", obj.get("code", ""))
                    self.send_header("X-Error-Message", obj.get("error", ""))
                self.end_headers()
                self.wfile.write(body)

            def _repo(self, repo_id) -> Optional[Repo]:
                repo = hub.repos.get(repo_id)
                if repo is None:
                    self._json({"error": "Repository not found", "code": "RepoNotFound"}, 404)
                    return None
                if repo.private_token and self.headers.get("Authorization") != f"Bearer {repo.private_token}":
                    self._json({"error": "Invalid credentials", "code": "RepoNotFound"}, 401)
                    return None
                return repo

            def _body(self) -> bytes:
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n)

            def do_HEAD(self):
                self._record()
                self._resolve(head=True)

            def do_GET(self):
                self._record()
                path = self.path.split("?")[0]
                m = re.match(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?$", path)
                if m:  # listing used by HfFileSystem (range reads)
                    repo = self._repo(m.group(1))
                    if repo is None:
                        return
                    prefix = (m.group(3) or "").strip("/")
                    entries = [{"type": "file", "path": n, "size": len(b), "oid": hub.digest(b, "sha1")}
                               for n, b in sorted(repo.files.items())
                               if (n.rsplit("/", 1)[0] if "/" in n else "") == prefix]
                    return self._json(entries)
                m = re.match(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?$", path)
                if m:
                    repo = self._repo(m.group(1))
                    if repo is None:
                        return
                    siblings = [{"rfilename": n, "size": len(b), "blobId": hub.digest(b, "sha1")}
                                for n, b in sorted(repo.files.items())]
                    return self._json({"id": m.group(1), "modelId": m.group(1), "sha": repo.sha,
                                       "siblings": siblings, "private": bool(repo.private_token), "tags": []})
                self._resolve(head=False)

            def _resolve(self, head: bool):
                path = self.path.split("?")[0]
                m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
                if not m:
                    return self._json({"error": "not found"}, 404)
                repo = self._repo(m.group(1))
                if repo is None:
                    return
                name = m.group(3)
                if name not in repo.files:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("X-Error-Message", "Entry not found")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = repo.files[name]
                start, status = 0, 200
                rng = self.headers.get("Range")
                if rng:
                    rm = re.match(r"bytes=(\d+)-(\d*)", rng)
                    start = int(rm.group(1))
                    end = int(rm.group(2)) + 1 if rm.group(2) else len(data)
                    data, status = data[start:end], 206
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("X-Repo-Commit", repo.sha)
                self.send_header("ETag", '"' + hub.digest(repo.files[name], "sha256") + '"')
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{start + len(data) - 1}/{len(repo.files[name])}")
                self.end_headers()
                if head:
                    return
                cut = hub.drop_after.pop(name, None)
                if cut is not None:
                    self.wfile.write(data[:cut])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                if hub.bytes_per_s and (not rng or hub.throttle_ranges):
                    return self._trickle(data, hub.bytes_per_s)
                self.wfile.write(data)

            def _trickle(self, data: bytes, rate: float, chunk: int = 4096):
                """Send ``data`` at ``rate`` bytes/s; stop quietly when the client hangs up."""
                for i in range(0, len(data), chunk):
                    try:
                        self.wfile.write(data[i:i + chunk])
                        self.wfile.flush()
                    except (BrokenPipeError, ConnectionResetError):
                        self.close_connection = True
                        return
                    time.sleep(chunk / rate)

            def do_POST(self):
                self._record()
                path = self.path.split("?")[0]
                body = self._body()
                if path == "/api/repos/create":
                    req = json.loads(body)
                    repo_id = f"{req.get('organization') or 'user'}/{req['name']}" if "/" not in req["name"] else req["name"]
                    hub.created.append(req)
                    hub.repos.setdefault(repo_id, Repo({}))
                    return self._json({"url": f"{hub.url}/{repo_id}", "name": repo_id})
                if path == "/api/validate-yaml":  # model card metadata check made before uploading README.md
                    hub.validated_yaml.append(json.loads(body).get("content", ""))
                    return self._json({"errors": [], "warnings": []})
                m = re.match(r"^/api/models/([^/]+/[^/]+)/preupload/([^/]+)$", path)
                if m:  # like the Hub's default .gitattributes: safetensors and files of 10 MB or more go to LFS
                    files = json.loads(body).get("files", [])
                    mode = lambda f: "lfs" if f["path"].endswith(".safetensors") or f["size"] >= 10 << 20 else "regular"  # noqa: E731
                    return self._json({"files": [{"path": f["path"], "uploadMode": mode(f), "shouldIgnore": False}
                                                 for f in files], "commitOid": hub.repos[m.group(1)].sha})
                m = re.match(r"^/([^/]+/[^/]+)\.git/info/lfs/objects/batch$", path)
                if m:
                    objects = []
                    for o in json.loads(body)["objects"]:
                        entry = {"oid": o["oid"], "size": o["size"]}
                        if o["oid"] not in hub.lfs.get(m.group(1), {}):  # no action: the Hub has this object
                            href = f"{hub.url}/lfs-upload/{m.group(1)}/{o['oid']}"
                            entry["actions"] = {"upload": {"href": href, "header": {}}}
                        objects.append(entry)
                    return self._json({"transfer": "basic", "objects": objects})
                m = re.match(r"^/api/models/([^/]+/[^/]+)/commit/([^/]+)$", path)
                if m and hub.fail_commits:
                    return self._json({"error": "You have no write access to this repository", "code": "Forbidden"}, 403)
                if m:
                    repo = self._repo(m.group(1))
                    if repo is None:
                        return
                    lines = [json.loads(x) for x in body.decode().splitlines() if x.strip()]
                    commit = {"header": None, "files": {}}
                    for line in lines:
                        if line["key"] == "header":
                            commit["header"] = line["value"]
                        elif line["key"] == "file":
                            v = line["value"]
                            commit["files"][v["path"]] = base64.b64decode(v["content"])
                        elif line["key"] == "lfsFile":
                            v = line["value"]
                            if v["oid"] not in hub.lfs.get(m.group(1), {}):
                                return self._json({"error": f"LFS object {v['oid']} for {v['path']} was never uploaded",
                                                   "code": "BadRequest"}, 400)
                            commit["files"][v["path"]] = hub.lfs[m.group(1)][v["oid"]]
                    repo.commits.append(commit)
                    repo.files.update(commit["files"])
                    return self._json({"commitUrl": f"{hub.url}/{m.group(1)}/commit/abc", "commitOid": "abc" * 13 + "a",
                                       "success": True})
                return self._json({"error": "unsupported"}, 404)

            def do_PUT(self):
                self._record()
                body = self._body()
                m = re.match(r"^/lfs-upload/([^/]+/[^/]+)/([0-9a-f]{64})$", self.path.split("?")[0])
                if not m:
                    return self._json({"error": "not found"}, 404)
                if hub.fail_lfs_puts_after is not None and len(hub.lfs_puts) >= hub.fail_lfs_puts_after:
                    return self._json({"error": "storage refused the object", "code": "Forbidden"}, 403)
                if hashlib.sha256(body).hexdigest() != m.group(2):
                    return self._json({"error": "sha256 mismatch", "code": "BadRequest"}, 400)
                hub.lfs.setdefault(m.group(1), {})[m.group(2)] = body
                hub.lfs_puts.append(m.group(2))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        return Handler


@contextlib.contextmanager
def served_hub(tmp_path: Path, monkeypatch):
    """A ``FakeHub`` that huggingface_hub talks to for the test: its endpoint, a cache under ``tmp_path``, no
    token, telemetry or Xet storage (uploads go to this server)."""
    with FakeHub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
        # where huggingface_hub looks when given no cache_dir (a streamed shard's download copies a cached file): read
        # from the environment once, at its import, which may be in an earlier test's tmp_path
        monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "cache"))
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.setattr("huggingface_hub.constants.HF_HUB_DISABLE_XET", True)
        yield hub
