"""A local stand-in for the Hugging Face Hub on 127.0.0.1: enough of its HTTP API for huggingface_hub's own client
(``HF_ENDPOINT=http://127.0.0.1:PORT``) to resolve, list and download model repositories (docs/deployment.md,
"Models by name"). It speaks what ``snapshot_download`` and ``hf_hub_download`` ask for:

    GET  /api/models/{repo}[/revision/{rev}][?blobs=True] the repository's commit and siblings (with sizes)
    GET  /api/models/{repo}/tree/{rev}[?recursive=...]    the file listing snapshot_download caches
    HEAD /{repo}/resolve/{rev}/{file}                     X-Repo-Commit, ETag / X-Linked-Etag, X-Linked-Size,
                                                          Content-Length (what get_hf_file_metadata reads)
    GET  /{repo}/resolve/{rev}/{file}                     the bytes; ``Range: bytes=N-`` answers 206 (resume)

Errors carry the Hub's ``X-Error-Code`` header (RepoNotFound, RevisionNotFound, GatedRepo, EntryNotFound), which
huggingface_hub maps to its exception classes. A gated repository answers 401 without ``Authorization: Bearer
<token>``. ``drop_once`` names files ("org/name/file") whose first GET is cut mid-body (the connection closed),
once each.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin")  # files served as LFS objects (X-Linked-Etag / X-Linked-Size), as the Hub does


@dataclass
class Repo:
    """A model repository: commits (sha -> {path: bytes}) and refs (branch or tag -> sha)."""

    commits: dict[str, dict[str, bytes]]
    refs: dict[str, str]
    gated: bool = False

    def resolve(self, rev: str) -> str | None:
        return self.refs.get(rev) or (rev if rev in self.commits else None)


def read_dir(path: str | pathlib.Path) -> dict[str, bytes]:
    """A checkpoint directory's files as a commit's {path: bytes} (subdirectories included)."""
    root = pathlib.Path(path)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def commit_sha(files: dict[str, bytes], salt: str = "") -> str:
    h = hashlib.sha1(salt.encode())
    for name in sorted(files):
        h.update(name.encode() + b"\0" + hashlib.sha1(files[name]).digest())
    return h.hexdigest()


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _entry(name: str, data: bytes) -> dict:
    """A sibling / tree entry with the metadata huggingface_hub reads (size, blob id, LFS sha256 and size)."""
    e: dict = {"size": len(data), "oid": _git_oid(data), "blobId": _git_oid(data)}
    if name.endswith(LFS_SUFFIXES):
        e["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "sha256": hashlib.sha256(data).hexdigest(),
                    "size": len(data), "pointerSize": 134}  # fmt: skip
    return e


@dataclass
class HubStandIn:
    """The stand-in server. ``start()`` binds 127.0.0.1 on an ephemeral port; ``endpoint`` is its base URL."""

    repos: dict[str, Repo] = field(default_factory=dict)
    token: str = "hf_standin_token"  # the one token that opens gated repositories
    drop_once: set[str] = field(default_factory=set)  # "org/name/file": files whose first GET is cut mid-body
    hold: threading.Event | None = None  # when given: GETs of *.safetensors wait for it (a download in progress)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # (method, path, Range header)
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None

    def add(self, repo_id: str, files: dict[str, bytes], refs: tuple[str, ...] = ("main",), gated: bool = False) -> str:
        """Add a commit of ``files`` to ``repo_id`` (created if new), pointing ``refs`` at it; its sha."""
        repo = self.repos.setdefault(repo_id, Repo({}, {}, gated))
        sha = commit_sha(files, salt=f"{repo_id}:{len(repo.commits)}")
        repo.commits[sha] = dict(files)
        repo.refs.update(dict.fromkeys(refs, sha))
        repo.gated = repo.gated or gated
        return sha

    @property
    def endpoint(self) -> str:
        assert self._server is not None, "start() first"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> HubStandIn:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="hub-standin", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> HubStandIn:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _handler(hub: HubStandIn):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet: the test reads hub.requests
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        # -------------------------------------------------------------- routes

        def _serve(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path, self.headers.get("Range")))
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) == 4:  # no revision: the default branch
                parts += ["revision", "main"]
            if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
                repo_id, kind, rev = f"{parts[2]}/{parts[3]}", parts[4], parts[5]
                found = self._repo(repo_id, rev)
                if found is not None:
                    self._api(repo_id, kind, *found)
            elif len(parts) >= 5 and parts[2] == "resolve":
                repo_id, rev, name = f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:])
                found = self._repo(repo_id, rev)
                if found is not None:
                    self._file(f"{repo_id}/{name}", name, *found, body=body)
            else:
                self._error(404, "RepoNotFound", "no such route")

        def _repo(self, repo_id: str, rev: str) -> tuple[str, dict[str, bytes]] | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", "Repository not found")
                return None
            if repo.gated and self.headers.get("Authorization") != f"Bearer {hub.token}":
                self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must be authenticated.")
                return None
            sha = repo.resolve(rev)
            if sha is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                return None
            return sha, repo.commits[sha]

        def _api(self, repo_id: str, kind: str, sha: str, files: dict[str, bytes]) -> None:
            if kind == "revision":
                siblings = []
                for name, data in sorted(files.items()):
                    e = _entry(name, data)
                    siblings.append({"rfilename": name, "size": e["size"], "blobId": e["blobId"], "lfs": e.get("lfs")})
                gated = "manual" if hub.repos[repo_id].gated else False
                doc: object = {"id": repo_id, "modelId": repo_id, "sha": sha, "private": False, "gated": gated,
                               "siblings": siblings}  # fmt: skip
            else:
                doc = [{"type": "file", "path": n, **_entry(n, d)} for n, d in sorted(files.items())]
            raw = json.dumps(doc).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _file(self, path: str, name: str, sha: str, files: dict[str, bytes], body: bool) -> None:
            """One file's HEAD or GET (``path``: "org/name/file", what ``drop_once`` names)."""
            if name not in files:
                self._error(404, "EntryNotFound", f"{name} does not exist")
                return
            data, e = files[name], _entry(name, files[name])
            start = 0
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes=") and body:
                start = int(rng[6:].split("-")[0])
            part = data[start:]
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", sha)
            self.send_header("ETag", f'"{e["oid"]}"')
            if "lfs" in e:
                self.send_header("X-Linked-Etag", f'"{e["lfs"]["oid"]}"')
                self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("Accept-Ranges", "bytes")
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.send_header("Content-Length", str(len(part)))
            self.end_headers()
            if not body:
                return
            if hub.hold is not None and name.endswith(".safetensors"):
                hub.hold.wait(120)
            if path in hub.drop_once and len(part) > 1:
                hub.drop_once.discard(path)
                self.wfile.write(part[: len(part) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)  # SHUT_RDWR: the client sees the body end early
                return
            self.wfile.write(part)

        def _error(self, status: int, code: str, message: str) -> None:
            raw = json.dumps({"error": message}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

    return Handler
