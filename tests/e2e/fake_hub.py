"""A Hugging Face Hub on 127.0.0.1, enough of it for huggingface_hub's download path.

Real HTTP (ThreadingHTTPServer), the Hub's URL layout and headers:
- ``GET /api/models/{org}/{name}[/revision/{rev}]``: repo info (``sha``, ``siblings``);
- ``GET /api/models/{org}/{name}/tree/{rev}``: the file listing (git blob oid, size, and
  ``lfs.oid`` = sha256 for LFS files, here every ``*.safetensors``);
- ``HEAD|GET /{org}/{name}/resolve/{rev}/{path}``: the file, with ``X-Repo-Commit``,
  ``ETag`` (the sha256 for LFS files, the blob oid otherwise), ``Content-Length``, and Range
  requests answered 206 (what a resumed download sends);
- unknown repo 401 ``X-Error-Code: RepoNotFound`` (what the Hub answers without a token),
  unknown revision 404 ``RevisionNotFound``, unknown file 404 ``EntryNotFound``.
Faults a test can set per file: ``corrupt`` (serve bytes whose sha256 is not the listed one),
``stall_after`` (send that many bytes, then hang until ``release()``: a pull to kill),
``drop_after`` (once: send that many bytes, then close the connection: a network drop).
Every request is recorded in ``requests`` (method, path, Range header).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeRepo:
    repo_id: str
    files: dict[str, bytes]
    # path -> bytes actually served when they differ from the listed content (corruption)
    served: dict[str, bytes] = field(default_factory=dict)
    stall_after: dict[str, int] = field(default_factory=dict)
    drop_after: dict[str, int] = field(default_factory=dict)  # one-shot: cut the connection there

    @property
    def commit(self) -> str:
        h = hashlib.sha1(self.repo_id.encode())
        for name in sorted(self.files):
            h.update(name.encode() + hashlib.sha256(self.files[name]).digest())
        return h.hexdigest()

    def is_lfs(self, path: str) -> bool:
        return path.endswith(".safetensors")

    def etag(self, path: str) -> str:
        data = self.files[path]
        return hashlib.sha256(data).hexdigest() if self.is_lfs(path) else git_blob_sha1(data)

    def listing(self) -> list[dict]:
        out = []
        for path in sorted(self.files):
            data = self.files[path]
            entry = {"type": "file", "oid": git_blob_sha1(data), "size": len(data), "path": path}
            if self.is_lfs(path):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            out.append(entry)
        return out


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        self._release = threading.Event()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                hub._handle(self, head=True)

            def do_GET(self) -> None:
                hub._handle(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, repo_id: str, files: dict[str, bytes]) -> FakeRepo:
        repo = FakeRepo(repo_id, dict(files))
        self.repos[repo_id] = repo
        return repo

    def release(self) -> None:
        """Let stalled downloads go (their connections then close short)."""
        self._release.set()

    def start(self) -> "FakeHub":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()

    def gets(self, repo_id: str, path: str | None = None) -> list[tuple[str, str, str | None]]:
        """Recorded GETs of a repo's files (optionally one file)."""
        prefix = f"/{repo_id}/resolve/"
        return [r for r in self.requests if r[0] == "GET" and r[1].startswith(prefix)
                and (path is None or r[1].endswith("/" + path))]

    # -- the routes ------------------------------------------------------------------
    def _handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        url = urlparse(h.path)
        path = unquote(url.path)
        self.requests.append(("HEAD" if head else "GET", path, h.headers.get("Range")))
        m = re.match(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?$", path)
        if m:
            return self._repo_info(h, m.group(1), m.group(2) or "main")
        m = re.match(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?$", path)
        if m:
            return self._tree(h, m.group(1), m.group(2))
        m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        if m:
            return self._resolve(h, m.group(1), m.group(2), m.group(3), head)
        self._error(h, 404, "NotFound", "no such route")

    def _repo(self, h, repo_id: str, revision: str) -> FakeRepo | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            self._error(h, 401, "RepoNotFound", "Repository not found")
            return None
        if revision not in ("main", repo.commit):
            self._error(h, 404, "RevisionNotFound", "Invalid rev id: " + revision, commit=None)
            return None
        return repo

    def _repo_info(self, h, repo_id: str, revision: str) -> None:
        repo = self._repo(h, repo_id, revision)
        if repo is not None:
            self._json(h, {"id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": False,
                           "siblings": [{"rfilename": p} for p in sorted(repo.files)]})

    def _tree(self, h, repo_id: str, revision: str) -> None:
        repo = self._repo(h, repo_id, revision)
        if repo is not None:
            self._json(h, repo.listing())

    def _resolve(self, h, repo_id: str, revision: str, fpath: str, head: bool) -> None:
        repo = self._repo(h, repo_id, revision)
        if repo is None:
            return
        if fpath not in repo.files:
            return self._error(h, 404, "EntryNotFound", f"{fpath} does not exist", commit=repo.commit)
        data = repo.served.get(fpath, repo.files[fpath])
        start, status = 0, 200
        rng = h.headers.get("Range")
        if rng and not head:
            m = re.match(r"bytes=(\d+)-(\d*)", rng)
            start = int(m.group(1))
            end = int(m.group(2)) + 1 if m.group(2) else len(data)
            if start >= len(data):
                return self._error(h, 416, "RangeNotSatisfiable", "range", commit=repo.commit)
            body, status = data[start:end], 206
        else:
            body = data
        h.send_response(status)
        h.send_header("X-Repo-Commit", repo.commit)
        h.send_header("ETag", f'"{repo.etag(fpath)}"')
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Length", str(len(body)))
        h.send_header("Content-Type", "application/octet-stream")
        if status == 206:
            h.send_header("Content-Range", f"bytes {start}-{start + len(body) - 1}/{len(data)}")
        h.end_headers()
        if head:
            return
        stall = repo.stall_after.get(fpath)
        drop = repo.drop_after.pop(fpath, None)
        try:
            if drop is not None and start < drop:
                h.wfile.write(body[: drop - start])
                h.wfile.flush()
                h.close_connection = True
                h.connection.shutdown(2)
                return
            if stall is not None and start < stall:
                h.wfile.write(body[: stall - start])
                h.wfile.flush()
                self._release.wait(120)
                h.close_connection = True
                return
            h.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            h.close_connection = True

    @staticmethod
    def _json(h, obj) -> None:
        body = json.dumps(obj).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    @staticmethod
    def _error(h, status: int, code: str, message: str, commit: str | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        h.send_response(status)
        h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        if commit:
            h.send_header("X-Repo-Commit", commit)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)
