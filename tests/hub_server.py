"""A local stand-in for the Hugging Face Hub: the few HTTP routes huggingface_hub's downloads use.

Point a process at it with HF_ENDPOINT=server.endpoint (huggingface_hub reads it at import, so
the code under test runs in a fresh interpreter). It serves repositories made of real files,
answers unknown repositories and revisions the way the Hub does (404 with X-Error-Code, which
huggingface_hub turns into RepositoryNotFoundError / RevisionNotFoundError), keeps private
repositories behind a bearer token, and records every request so a test can tell which files
were fetched and which token was sent.

    GET       /api/models/{repo}/revision/{rev}           repo info: sha, siblings
    GET       /api/models/{repo}/tree/{rev}?recursive=..  the file listing
    HEAD/GET  /{repo}/resolve/{rev}/{path}                a file, with X-Repo-Commit and ETag
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest


@dataclass
class HubRepo:
    files: dict[str, bytes]
    revisions: dict[str, str]  # branch or tag -> commit (40 hex digits); "main" at least
    token: str | None = None  # private: only this bearer token may read it

    def commit(self, revision: str) -> str | None:
        if revision in self.revisions.values():
            return revision
        return self.revisions.get(revision)


@dataclass
class Request:
    method: str
    path: str
    authorization: str | None


@dataclass
class HubServer:
    repos: dict[str, HubRepo] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    endpoint: str = ""

    def add_folder(self, repo_id: str, folder: Path, *, token: str | None = None, **revisions):
        """Serve every file under `folder` as `repo_id`; `revisions`: extra tag -> commit."""
        files = {
            str(p.relative_to(folder)): p.read_bytes()
            for p in sorted(folder.rglob("*"))
            if p.is_file()
        }
        main = hashlib.sha1(repo_id.encode()).hexdigest()
        self.repos[repo_id] = HubRepo(files, {"main": main, **revisions}, token)

    def fetched(self, repo_id: str) -> set[str]:
        """The files of `repo_id` whose contents were downloaded (GET on /resolve/)."""
        prefix = f"/{repo_id}/resolve/"
        return {
            r.path[len(prefix) :].split("/", 1)[1]
            for r in self.requests
            if r.method == "GET" and r.path.startswith(prefix)
        }


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _handler(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # keep test output quiet
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _serve(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append(Request(self.command, path, self.headers.get("Authorization")))
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 6:
                repo_id, kind, revision = "/".join(parts[2:4]), parts[4], parts[5]
                repo, commit = self._find(repo_id, revision)
                if repo is None:
                    return
                if kind == "revision":
                    return self._json({"id": repo_id, "sha": commit, "private": bool(repo.token),
                                       "siblings": [{"rfilename": f} for f in repo.files]})  # fmt: skip
                if kind == "tree":
                    return self._json(
                        [
                            {"type": "file", "oid": _blob_id(d), "size": len(d), "path": f}
                            for f, d in repo.files.items()
                        ]
                    )
            if len(parts) >= 5 and parts[2] == "resolve":
                repo_id, revision, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
                repo, commit = self._find(repo_id, revision)
                if repo is None:
                    return
                if name not in repo.files:
                    return self._error(404, "EntryNotFound", f"{name} not in {repo_id}")
                data = repo.files[name]
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("ETag", f'"{_blob_id(data)}"')
                self.send_header("X-Repo-Commit", commit)
                self.end_headers()
                if body:
                    self.wfile.write(data)
                return
            self._error(404, "RepoNotFound", f"no route {path}")

        def _find(self, repo_id: str, revision: str) -> tuple[HubRepo | None, str]:
            repo = hub.repos.get(repo_id)
            if repo is None or (
                repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}"
            ):
                self._error(401 if repo else 404, "RepoNotFound", f"Repository {repo_id} not found")
                return None, ""
            commit = repo.commit(revision)
            if commit is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                return None, ""
            return repo, commit

        def _json(self, value) -> None:
            data = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(data)

        def _error(self, status: int, code: str, message: str) -> None:
            data = json.dumps({"error": message}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(data)

    return Handler


@pytest.fixture
def hub_server() -> Iterator[HubServer]:
    """An empty stand-in Hub on a free local port; add repositories with add_folder."""
    hub = HubServer()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    hub.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
