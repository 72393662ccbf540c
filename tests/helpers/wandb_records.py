"""What an offline W&B run wrote: the records of its run-<id>.wandb file, read without a network
or a W&B server (the Python SDK no longer ships a reader; wandb-core writes the file)."""

from __future__ import annotations

import json
import pathlib
import struct

BLOCK = 32768  # the log's block size: a record header never straddles a block's end
HEADER = 7     # ':W&B', a 2-byte magic and a version byte; then each record's header is
               # a CRC-32 (4 bytes), a length (2) and a kind (1: whole, 2-4: first/middle/last)


def records(path: pathlib.Path) -> list:
    """The wandb_internal_pb2.Record protos of one run-<id>.wandb file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = pathlib.Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, chunks, out = HEADER, b"", []
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # the block's zero padding
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        if kind == 0:  # zeroes: the end of what was written
            break
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            out.append(pb.Record.FromString(chunks))
            chunks = b""
    return out


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def offline_run(path: pathlib.Path) -> dict:
    """{'run_id', 'config': {key: value}, 'history': {step: {key: value}}} of one offline run
    (W&B's own keys, _step, _runtime and _timestamp, left out)."""
    run_id, config, history = None, {}, {}
    for r in records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run_id = r.run.run_id
            config.update({_key(u): json.loads(u.value_json) for u in r.run.config.update})
        elif kind == "config":
            config.update({_key(u): json.loads(u.value_json) for u in r.config.update})
        elif kind == "history":
            row = {_key(i): json.loads(i.value_json) for i in r.history.item}
            history.setdefault(r.history.step.num, {}).update(
                {k: v for k, v in row.items() if not k.startswith("_")})
    return {"run_id": run_id, "config": config, "history": history}
