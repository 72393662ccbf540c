"""A Hugging Face hub cache laid out as huggingface_hub lays it out, from a local folder, and a
local stand-in for the hub's HTTP API: the hub tests run with no network."""

from __future__ import annotations

import hashlib
import http.server
import os
import pathlib
import threading


def fill_hub_cache(cache: pathlib.Path, repo_id: str, folder: pathlib.Path, *,
                   ref: str = "main") -> str:
    """Stores every file of `folder` as the snapshot of `repo_id` at a made-up commit:
    CACHE/models--org--name/{blobs/<sha256>, snapshots/<commit>/<file> (a relative symlink to
    its blob, as the hub's downloads make on Linux), refs/<ref> (the commit, no newline)}.
    Returns the commit hash."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    commit = hashlib.sha1(b"".join(p.read_bytes() for p in files)).hexdigest()
    stored = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = stored / "snapshots" / commit
    for f in files:
        blob = stored / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(f.read_bytes())
        link = snapshot / f.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (stored / "refs").mkdir(parents=True, exist_ok=True)
    (stored / "refs" / ref).write_text(commit)
    return commit


class _Handler(http.server.BaseHTTPRequestHandler):
    """GET /api/models/ORG/NAME/revision/REV: 404 RepoNotFound for every repo but
    `known` (the server's attribute), 404 RevisionNotFound for any revision of it: the answers
    the hub gives for a misspelled id and a missing branch."""

    def do_GET(self):
        parts = self.path.split("?")[0].split("/")
        repo = "/".join(parts[3:5]) if self.path.startswith("/api/models/") else ""
        code = "RevisionNotFound" if repo == self.server.known else "RepoNotFound"
        self.send_response(404)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "not found"}')

    def log_message(self, *_):  # quiet test output
        pass


class FakeHub:
    """A local HTTP server answering as the hub does for a missing repo or revision; use as a
    context manager, point HF_ENDPOINT at .url."""

    def __init__(self, known: str):
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.known = known
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *_):
        self.server.shutdown()
        self.server.server_close()
