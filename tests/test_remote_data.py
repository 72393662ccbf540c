"""prepare_data from remote inputs: an S3 bucket (moto's server on 127.0.0.1, reached through
s3fs with the AWS variables a user would set) and a Hugging Face dataset by name (a local
folder of data files, streamed by `datasets`) give the same shards as the same files read
locally, byte for byte, and resume after the same records; a missing backend, an offline Hub
and a bad URL are one error line."""

from __future__ import annotations

import gzip
import importlib
import json
import logging
import os
import pathlib
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from launch.prepare_data import main as prepare_main
from tests.helpers.chat import LLAMA3, special_tokenizer
from tests.helpers.cli import ROOT, assert_one_error
from tests.helpers.interrupt import killed_at_shard
from titanax.data import remote, shards
from titanax.data.tokenizer import Tokenizer

BUCKET = "titanax-data"
WORDS = "reverse 0 1 2 3 4 5 6 7 8 9 user assistant\n"


def _text(i: int) -> str:
    return " ".join(str((i * 7 + j) % 10) for j in range(3 + i % 6)) + f" user {i}"


def _jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _parquet(rows) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows), sink, row_group_size=4)
    return sink.getvalue().to_pybytes()


def _files() -> dict[str, bytes]:
    """Key -> content: a top level of .jsonl (and a .txt the glob leaves out), and a folder of
    every format under mixed/."""
    import zstandard

    rows = [{"text": _text(i), "id": i} for i in range(60)]
    return {"a.jsonl": _jsonl(rows[:20]), "b.jsonl": _jsonl(rows[20:35]),
            "notes.txt": b"not read by *.jsonl",
            "mixed/c.jsonl.gz": gzip.compress(_jsonl(rows[35:45])),
            "mixed/d.jsonl.zst": zstandard.ZstdCompressor().compress(_jsonl(rows[45:52])),
            "mixed/e.parquet": _parquet(rows[52:60]), "mixed/sub/f.txt": _text(99).encode(),
            "mixed/.hidden.jsonl": _jsonl(rows[:3]), "mixed/skip.bin": b"\x00"}


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory) -> pathlib.Path:
    """A byte-level BPE with Llama 3's template beside it (text and example formats)."""
    folder = tmp_path_factory.mktemp("tok")
    special_tokenizer(folder / "tokenizer.json", WORDS)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": LLAMA3}))
    return folder / "tokenizer.json"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A bucket on moto's S3 server holding _files(), and the same files in a local folder.
    The endpoint is given as users of an S3-compatible store give it: AWS_ENDPOINT_URL."""
    for package in ("s3fs", "boto3", "moto.server"):  # the test extra
        pytest.importorskip(package)
    import boto3
    import s3fs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no request lines on stderr
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    local = tmp_path_factory.mktemp("local")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                           "AWS_DEFAULT_REGION": "us-east-1",
                           "AWS_ENDPOINT_URL": f"http://{host}:{port}",
                           "AWS_CONFIG_FILE": str(local / "none"),
                           "AWS_SHARED_CREDENTIALS_FILE": str(local / "none")}.items():
            mp.setenv(key, value)
        client = boto3.client("s3")
        client.create_bucket(Bucket=BUCKET)
        for key, body in _files().items():
            client.put_object(Bucket=BUCKET, Key=key, Body=body)
            (local / key).parent.mkdir(parents=True, exist_ok=True)
            (local / key).write_bytes(body)
        yield local
        s3fs.S3FileSystem.clear_instance_cache()  # its clients point at this server
    server.stop()


def _prepare(tok_path, out, *source, shard_tokens=60, extra=()) -> int:
    return prepare_main(["--tokenizer", str(tok_path), *map(str, source), "--out", str(out),
                         "--no-progress", "--shard-tokens", str(shard_tokens), *extra])


def _assert_same_shards(a: pathlib.Path, b: pathlib.Path, differ=("source",)) -> dict:
    """Equal meta.json apart from the keys naming the input, every listed file byte-equal."""
    meta_a, meta_b = (json.loads((d / "meta.json").read_text()) for d in (a, b))
    assert {k: v for k, v in meta_a.items() if k not in differ} == \
           {k: v for k, v in meta_b.items() if k not in differ}
    files = [e[k] for e in meta_a["shards"] for k in ("file", "mask", "offsets") if k in e]
    assert files
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    return meta_a


def _interrupted_then_resumed(monkeypatch, tok_path, out, *source, extra=()) -> int:
    """Runs prepare_data killed while writing its third shard, then again; returns how many
    documents the second run tokenized."""
    with killed_at_shard(monkeypatch):
        _prepare(tok_path, out, *source, extra=extra)
    assert len(shards.read_meta(out)["shards"]) == 2
    encoded = []
    real_encode = Tokenizer.encode_batch
    monkeypatch.setattr(Tokenizer, "encode_batch",
                        lambda self, texts: encoded.extend(texts) or real_encode(self, texts))
    assert _prepare(tok_path, out, *source, extra=extra) == 0
    return len(encoded)


# --- s3:// -------------------------------------------------------------------------------------

def test_s3_glob_and_folder_equal_local(s3, tok_path, tmp_path, monkeypatch):
    local_plain = tmp_path / "plain"
    local_plain.mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (local_plain / name).write_bytes((s3 / name).read_bytes())
    assert _prepare(tok_path, tmp_path / "local", "--input", local_plain) == 0
    assert _prepare(tok_path, tmp_path / "s3", "--input", f"s3://{BUCKET}/*.jsonl") == 0
    meta = _assert_same_shards(tmp_path / "local", tmp_path / "s3")
    assert meta["done_inputs"] == ["a.jsonl", "b.jsonl"] and len(meta["shards"]) >= 4
    assert shards.read_meta(tmp_path / "s3")["source"] == f"s3://{BUCKET}/*.jsonl"

    # A folder: every default extension, compressed ones included, hidden files left out.
    assert _prepare(tok_path, tmp_path / "local_mixed", "--input", s3 / "mixed") == 0
    assert _prepare(tok_path, tmp_path / "s3_mixed", "--input", f"s3://{BUCKET}/mixed/") == 0
    meta = _assert_same_shards(tmp_path / "local_mixed", tmp_path / "s3_mixed")
    assert meta["done_inputs"] == ["c.jsonl.gz", "d.jsonl.zst", "e.parquet", "sub/f.txt"]

    # Resumed after an interruption: the documents in listed shards are not read again.
    n_docs = [s["n_docs"] for s in meta["shards"]]
    again = _interrupted_then_resumed(monkeypatch, tok_path, tmp_path / "s3_resumed",
                                      "--input", f"s3://{BUCKET}/mixed/")
    assert again == sum(n_docs) - sum(n_docs[:2])
    _assert_same_shards(tmp_path / "local_mixed", tmp_path / "s3_resumed")


class _Dropped:
    """A remote file whose connection drops after its first line."""

    def __init__(self, f):
        self.f, self.lines = f, 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def __iter__(self):
        return self

    def __next__(self) -> bytes:
        self.lines += 1
        if self.lines > 1:
            raise ConnectionResetError(104, "Connection reset by peer")
        return self.f.readline()

    def tell(self) -> int:
        return self.f.tell()


def test_remote_input_errors_are_one_line(s3, tok_path, tmp_path, capsys, monkeypatch):
    def error_of(url: str) -> str:
        assert _prepare(tok_path, tmp_path / "out", "--input", url) == 2
        err = capsys.readouterr().err
        assert err.count("error:") == 1 and "Traceback" not in err, err
        return err

    assert "no files matching it" in error_of(f"s3://{BUCKET}/nothing/*.jsonl")
    assert "no such file or folder" in error_of(f"s3://{BUCKET}/absent.jsonl")
    assert "no such file or folder" in error_of("s3://no-such-bucket-titanax/a.jsonl")
    assert "Protocol not known" in error_of("nosuch://x/y.jsonl")
    assert not (tmp_path / "out").exists()

    # The network failing mid-file: the same command resumes.
    real_open = remote.RemotePath.open
    monkeypatch.setattr(remote.RemotePath, "open", lambda self, mode="rb":
                        _Dropped(real_open(self, mode)))
    err = error_of(f"s3://{BUCKET}/a.jsonl")
    assert "ConnectionResetError" in err and "run the same command again" in err, err
    monkeypatch.setattr(remote.RemotePath, "open", real_open)

    # Without the backend package (fsspec imports it on first use, then keeps the class in
    # its registry): the pip line.
    registry = importlib.import_module("fsspec.registry")  # `fsspec.registry` is a mapping
    for protocol, package in (("s3", "s3fs"), ("gs", "gcsfs")):
        monkeypatch.setitem(sys.modules, package, None)
        monkeypatch.delitem(registry._registry, protocol, raising=False)
        err = error_of(f"{protocol}://bucket/data/*.jsonl")
        assert f"pip install {package}" in err and "titanax[remote]" in err, err


# --- --hf-dataset ------------------------------------------------------------------------------

def _hf_folder(root: pathlib.Path) -> pathlib.Path:
    """A dataset as a folder of data files (what load_dataset(NAME) takes, offline)."""
    folder = root / "ds"
    folder.mkdir()
    rows = [{"text": _text(i), "prompt": f"reverse {_text(i)}", "response": _text(i + 1)}
            for i in range(40)]
    (folder / "train.jsonl").write_bytes(_jsonl(rows))
    (folder / "test.jsonl").write_bytes(_jsonl(rows[:5]))
    return folder


def test_hf_dataset_equals_local_and_resumes(tok_path, tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    ds = _hf_folder(tmp_path)
    differ = ("source", "done_inputs")  # the input: its path, or the dataset and its split
    assert _prepare(tok_path, tmp_path / "local", "--input", ds / "train.jsonl") == 0
    assert _prepare(tok_path, tmp_path / "hf", "--hf-dataset", ds) == 0
    meta = _assert_same_shards(tmp_path / "local", tmp_path / "hf", differ)
    assert shards.read_meta(tmp_path / "hf")["done_inputs"] == ["train"]

    n_docs = [s["n_docs"] for s in meta["shards"]]
    again = _interrupted_then_resumed(monkeypatch, tok_path, tmp_path / "hf_resumed",
                                      "--hf-dataset", ds)
    assert again == sum(n_docs) - sum(n_docs[:2])
    _assert_same_shards(tmp_path / "local", tmp_path / "hf_resumed", differ)

    # --split and the example formats read the same rows as a local file of them.
    example = ("--format", "prompt_response")
    assert _prepare(tok_path, tmp_path / "local_pr", "--input", ds / "test.jsonl",
                    extra=example) == 0
    assert _prepare(tok_path, tmp_path / "hf_pr", "--hf-dataset", ds, "--split", "test",
                    extra=example) == 0
    _assert_same_shards(tmp_path / "local_pr", tmp_path / "hf_pr", differ)


def test_hf_dataset_errors_are_one_line(tok_path, tmp_path, capsys, monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    ds = _hf_folder(tmp_path)

    def error_of(*args) -> str:
        assert _prepare(tok_path, tmp_path / "out", *args) == 2
        err = capsys.readouterr().err
        assert err.count("error:") == 1 and "Traceback" not in err, err
        return err

    assert "Bad split: dev" in error_of("--hf-dataset", ds, "--split", "dev")
    assert "no 'body' field" in error_of("--hf-dataset", ds, "--text-key", "body")
    assert "leave --glob out" in error_of("--hf-dataset", ds, "--glob", "*.jsonl")
    monkeypatch.setitem(sys.modules, "datasets", None)
    assert "pip install datasets" in error_of("--hf-dataset", ds)

    # Offline, nothing cached: one line naming the switches and the cache, as a user sees it.
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf_home")}
    r = subprocess.run([sys.executable, "-m", "launch.prepare_data", "--tokenizer", str(tok_path),
                        "--hf-dataset", "titanax-tests/absent", "--out", str(tmp_path / "o")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert_one_error(r, 2, "HF_DATASETS_OFFLINE", "HF_HOME", "titanax-tests/absent")
    assert not (tmp_path / "o").exists()


def test_tokens_decode_to_the_inputs(s3, tok_path, tmp_path):
    """The shards hold the remote documents themselves (not only what the local run holds)."""
    assert _prepare(tok_path, tmp_path / "o", "--input", f"s3://{BUCKET}/a.jsonl") == 0
    meta, arrays = shards.open_shards(tmp_path / "o")
    stream = np.concatenate(arrays)
    tok = Tokenizer.load(tok_path)
    docs = [tok.decode(d[:-1]) for d in np.split(stream, np.flatnonzero(stream == meta["eos_id"])
                                                 + 1)[:-1]]
    assert docs == [_text(i) for i in range(20)]
