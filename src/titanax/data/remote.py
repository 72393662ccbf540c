"""Inputs named by a URL (prepare_data --input s3://... gs://... hf://... https://...), read
through fsspec.

The URL (a file, a folder or a glob) is listed once into files, with their sizes; each file is
then opened as a stream that fetches blocks as the reader asks for them, so no input is
downloaded whole before it is read. A RemoteRoot stands where a local input's folder does, and
`root / rel` is a RemotePath with the few pathlib.Path methods the readers use (open,
read_bytes, stat, name, suffix): every format is read by the same code as a local file, a
record is counted the same way, and a resumed run skips the same records.

The backends are fsspec's: s3fs for s3://, gcsfs for gs://, huggingface_hub for hf://, aiohttp
for https://. Credentials are theirs too (AWS_ACCESS_KEY_ID / AWS_PROFILE / AWS_ENDPOINT_URL,
GOOGLE_APPLICATION_CREDENTIALS, HF_TOKEN); titanax passes none.
"""

from __future__ import annotations

import contextlib
import fnmatch
import re
import types

from titanax.data.errors import DataError

EXTRA = "titanax[remote]"
_MAGIC = re.compile(r"[*?\[]")
CREDENTIALS = {
    "s3": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE (AWS_ENDPOINT_URL for "
          "an S3-compatible service)",
    "gs": "GOOGLE_APPLICATION_CREDENTIALS, or `gcloud auth application-default login`",
    "gcs": "GOOGLE_APPLICATION_CREDENTIALS, or `gcloud auth application-default login`",
    "hf": "HF_TOKEN, or `hf auth login`",
    "https": "the URL (a signed URL may have expired)",
    "http": "the URL (a signed URL may have expired)",
}


def is_url(path) -> bool:
    """Whether --input names a URL (PROTOCOL://...) rather than a local path."""
    return isinstance(path, str) and re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", path) is not None


class RemoteRoot:
    """The folder the listed files are relative to: their common prefix up to a '/'."""

    def __init__(self, fs, path: str, sizes: dict[str, int | None]):
        self.fs, self.path, self.sizes = fs, path, sizes

    def __truediv__(self, rel: str) -> RemotePath:
        return RemotePath(self, rel)

    def __str__(self) -> str:
        return self.fs.unstrip_protocol(self.path)


class RemotePath:
    """One listed file: the subset of pathlib.Path the readers call."""

    def __init__(self, root: RemoteRoot, rel: str):
        self.root, self.rel = root, rel
        self.path = f"{root.path}/{rel}" if root.path else rel
        self.name = rel.rsplit("/", 1)[-1]
        if _is_http(root.fs):  # a pre-signed URL's query is not part of the file's name
            self.name = self.name.split("?", 1)[0]
        self.suffix = "." + self.name.rsplit(".", 1)[-1] if "." in self.name else ""

    def open(self, mode: str = "rb"):
        return self.root.fs.open(self.path, mode)

    def read_bytes(self) -> bytes:
        with self.open("rb") as f:
            return f.read()

    def stat(self):
        # The listing's size (None where the server did not say): no request per file.
        return types.SimpleNamespace(st_size=self.root.sizes.get(self.rel))

    def __str__(self) -> str:
        return self.root.fs.unstrip_protocol(self.path)


def list_remote(url: str, glob: str | None, extensions: tuple[str, ...]
                ) -> tuple[RemoteRoot, list[str]]:
    """(root, relative paths in reading order): one file, every file under a folder (those
    ending in extensions, or matching glob), or the files a glob URL matches (and glob)."""
    fs, path = _filesystem(url)
    # https: '?' starts the query (a pre-signed URL's signature), so only * and [ glob there
    magic = (re.compile(r"^[^?]*?[*\[]") if _is_http(fs) else _MAGIC).search(path)
    with _listing_errors(url):
        if magic:
            root = path[:magic.end() - 1].rpartition("/")[0]
            infos = fs.glob(path, detail=True)
            picked = _files(infos, root, glob, None)
        else:
            # A trailing '/' asks for a folder: an https:// index page is a file to fs.info.
            info = {"type": "directory", "name": path} if url.endswith("/") else fs.info(path)
            if info.get("type") != "directory":
                root, _, name = info["name"].rstrip("/").rpartition("/")
                return RemoteRoot(fs, root, {name: info.get("size")}), [name]
            root = info["name"].rstrip("/")
            picked = _files(fs.find(path, detail=True), root, glob, extensions)
    if not picked:
        what = (f"matching {glob!r}" if glob else
                "matching it" if magic else f"with extensions {list(extensions)}")
        raise DataError(f"--input {url!r}: no files {what}; check the URL (list it with your "
                        "storage's CLI) or choose others with --glob")
    return RemoteRoot(fs, root, picked), sorted(picked)


def _is_http(fs) -> bool:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol
    return "http" in protocols or "https" in protocols


def _files(infos: dict, root: str, glob: str | None, extensions) -> dict[str, int | None]:
    """rel -> size of the listed files that are read (hidden ones left out, as locally)."""
    out = {}
    for name, info in infos.items():
        if info.get("type") == "directory":
            continue
        rel = name[len(root):].lstrip("/") if name.startswith(root) else name
        base = rel.rsplit("/", 1)[-1]
        if glob:
            if not (fnmatch.fnmatch(rel, glob) or fnmatch.fnmatch(base, glob)):
                continue
        elif extensions is not None and (not base.endswith(extensions)
                                         or any(p.startswith(".") for p in rel.split("/"))):
            continue
        out[rel] = info.get("size")
    return out


def _filesystem(url: str):
    """(fsspec filesystem, its path) for url; a missing backend is one line naming the pip
    install."""
    protocol = url.split("://", 1)[0]
    try:
        import fsspec
    except ImportError:
        raise DataError(f"--input {url!r}: URLs are read through fsspec, which is not "
                        f"installed; pip install fsspec (or pip install '{EXTRA}')") from None
    from fsspec.registry import known_implementations  # (fsspec.registry is a mapping)

    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as e:
        spec = known_implementations.get(protocol, {})
        package = spec.get("class", "").split(".")[0]
        need = (f"pip install {package}" if package and package != "fsspec" else
                spec.get("err") or str(e))
        raise DataError(f"--input {url!r}: {protocol}:// needs a backend that is not "
                        f"installed; {need} (or pip install '{EXTRA}')") from None
    except ValueError as e:  # an unknown protocol
        raise DataError(f"--input {url!r}: {e}; use a local path or an s3://, gs://, hf:// "
                        "or https:// URL") from None


@contextlib.contextmanager
def _listing_errors(url: str):
    """Listing failures as one line: missing, refused (credentials), or unreachable."""
    protocol = url.split("://", 1)[0]
    creds = CREDENTIALS.get(protocol, "the storage's credentials")
    try:
        yield
    except FileNotFoundError as e:
        # fsspec's http reports every failure as not found: its cause tells which
        http, status = protocol in ("http", "https"), getattr(e.__cause__, "status", None)
        if http and status in (401, 403):
            raise DataError(f"--input {url!r}: access refused ({_line(e.__cause__)}); check "
                            f"{creds}") from None
        if http and e.__cause__ is not None and status != 404:
            raise DataError(f"--input {url!r}: cannot reach it ({type(e.__cause__).__name__}: "
                            f"{_line(e.__cause__)}); check the URL and the network") from None
        raise DataError(f"--input {url!r}: no such file or folder; check the URL") from None
    except PermissionError as e:
        raise DataError(f"--input {url!r}: access refused ({_line(e)}); check {creds}") from None
    except DataError:
        raise
    except Exception as e:  # the backends' own types (botocore's NoCredentialsError, ...)
        raise DataError(f"--input {url!r}: cannot list it ({type(e).__name__}: {_line(e)}); "
                        f"check the network and {creds}") from None


@contextlib.contextmanager
def read_errors(where: str):
    """A transfer that fails mid-file (the network, expired credentials) as one line: the
    records already in listed shards are kept, so the same command resumes."""
    try:
        yield
    except DataError:
        raise
    except (OSError, EOFError, *_transport_errors()) as e:
        raise DataError(f"{where}: reading failed ({type(e).__name__}: {_line(e)}); check the "
                        "network and credentials, then run the same command again: it resumes "
                        "after the last complete shard") from None


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The backends' transfer exceptions that are not OSError, where they are installed."""
    out = []
    with contextlib.suppress(ImportError):
        import aiohttp

        out.append(aiohttp.ClientError)
    with contextlib.suppress(ImportError):
        import botocore.exceptions

        out.append(botocore.exceptions.BotoCoreError)
    return tuple(out)


def _line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
