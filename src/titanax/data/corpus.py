"""The embedded default corpus: the Python standard library's own `*.py` sources.

Every Python install carries them, so a fresh checkout can train without downloading anything.
Files are taken in a fixed order (so the corpus, and the held-out split made from its tail, is
the same on every run of the same Python) until `max_bytes` is reached: sorted relative paths,
library code first, then files under test-suite folders (`test`, `tests`, `idle_test`).

What is included: every `*.py` under `sysconfig.get_paths()["stdlib"]`, test suites included:
without them the stdlib holds only ~11 MB, less than the 24 MB default cap, and test code is
still ordinary Python. `site-packages` (third-party code, different per machine) and
`__pycache__` are skipped, as are empty files and files that are not valid UTF-8 (a few test
fixtures on purpose). Python 3.12's stdlib holds ~32 MB of such files.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import sysconfig

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})


def stdlib_root() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def list_files(root: pathlib.Path | None = None) -> list[pathlib.Path]:
    """All candidate files, relative to root, in sorted (deterministic) order."""
    root = stdlib_root() if root is None else root
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        rel_dir = pathlib.Path(dirpath).relative_to(root)
        found.extend(rel_dir / f for f in filenames if f.endswith(".py"))
    # Library code first, test suites after it, each in sorted POSIX-path order: a cap below
    # the full ~32 MB then drops test files rather than whole library packages (plain sorted
    # order would cut everything after test/test_s*: tkinter, unittest, urllib, xml, ...).
    return sorted(found, key=lambda p: (bool(_TEST_DIRS & set(p.parts)), p.as_posix()))


def _selected(max_bytes: int, root: pathlib.Path | None = None):
    """Yields (relative path, text) for the files that fit the byte budget."""
    root = stdlib_root() if root is None else root
    total = 0
    for rel in list_files(root):
        if total >= max_bytes:
            return
        try:
            raw = (root / rel).read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # unreadable or not UTF-8: skipped, and so absent from the fingerprint too
        if not text.strip():
            continue  # empty __init__.py files would only add lone eos tokens
        total += len(raw)
        yield rel, text


def load_documents(max_bytes: int, root: pathlib.Path | None = None) -> list[str]:
    """The corpus as a list of documents (one per source file), at most ~max_bytes in total.

    The file that crosses the budget is kept whole, so the total can exceed max_bytes by one
    file; a document is never cut in the middle.
    """
    return [text for _, text in _selected(max_bytes, root)]


def load_with_fingerprint(max_bytes: int, root: pathlib.Path | None = None) -> tuple[list[str], str]:
    """Documents and a stable hash of them (for cache keys) from a single pass over the files.

    Hashes the contents, not just names and sizes: reading ~24 MB costs well under a second,
    and a patched stdlib file of the same size must not reuse stale tokens.
    """
    h = hashlib.sha256(f"stdlib-corpus-v1:{max_bytes}".encode())
    docs = []
    for rel, text in _selected(max_bytes, root):
        h.update(rel.as_posix().encode())
        h.update(b"\0")
        h.update(hashlib.sha256(text.encode("utf-8")).digest())
        docs.append(text)
    return docs, h.hexdigest()[:16]
