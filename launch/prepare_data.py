"""Tokenize text into a token shard folder for `data.source=DIR`.

    python -m launch.prepare_data --tokenizer tok/tokenizer.json --input corpus/ --out shards/
    python -m launch.prepare_data --tokenizer tok/tokenizer.json --input data.jsonl --out shards/
    python -m launch.prepare_data --tokenizer tok/tokenizer.json --input fineweb/ --out web/ --bos
    python -m launch.prepare_data --tokenizer tok/tokenizer.json \
        --input 's3://bucket/web/*.jsonl.zst' --out web/
    python -m launch.prepare_data --tokenizer tok/tokenizer.json \
        --hf-dataset HuggingFaceFW/fineweb-edu --config sample-10BT --out edu/

--input is one file, a folder, or a Hugging Face dataset saved with `save_to_disk` (read
with pyarrow; `datasets` is not needed), or a URL of a file, a folder (ending in /) or a glob
(s3://, gs://, hf://datasets/ORG/NAME/..., https://; streamed through fsspec with the
storage's usual credentials: pip install 'titanax[remote]'; docs/data.md). --hf-dataset NAME
instead streams a dataset by name through `datasets.load_dataset(NAME, --config,
split=--split, streaming=True)`, its rows read as a .jsonl's lines. Files: .jsonl, .jsonl.gz,
.jsonl.zst (one JSON object per line, the text under --text-key), .parquet and .arrow (the
text in column --text-key), anything else one document per file. A folder: every file under it
(recursively, sorted) ending in .txt .md .rst .py .jsonl .jsonl.gz .jsonl.zst .parquet or
.arrow, or those matching --glob (e.g. '*.html'). --bos starts each document with the
tokenizer's BOS token (as in Llama 3 pretraining; train with data.bos=true). Interrupted runs
resume: re-run the same command. The work itself lives in titanax.data.shards.prepare_shards.

Fine-tuning examples (--format chat: a "messages" list; --format prompt_response: "prompt"
and "response" fields) are rendered through the chat template beside --tokenizer
(chat_template.jinja or tokenizer_config.json), and a loss mask is written beside the tokens:
the assistant's replies and their end-of-turn tokens (--train-on all: every token).

    python -m launch.prepare_data --tokenizer RUN/hf_tokenizer/tokenizer.json \
        --input chats.jsonl --out sft/ --format chat
"""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import sys

from titanax.config import ConfigError
from titanax.data.examples import FORMATS, TRAIN_ON
from titanax.data.hf_stream import HFDataset
from titanax.data.shards import prepare_shards


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launch.prepare_data", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, help="tokenizer.json (HF tokenizers)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", help="a file (.jsonl[.gz|.zst], .parquet, .arrow, text), a "
                        "folder of them, a saved Hugging Face dataset folder, or the URL of a "
                        "file, a folder or a glob (s3://, gs://, hf://, https://)")
    source.add_argument("--hf-dataset", metavar="NAME",
                        help="a Hugging Face dataset by name (or a local folder of data "
                        "files), streamed through datasets.load_dataset")
    p.add_argument("--split", default="train", help="--hf-dataset: the split (default train)")
    p.add_argument("--config", default=None, help="--hf-dataset: the configuration (subset)")
    p.add_argument("--out", required=True, help="output shard folder (resumed if it exists)")
    p.add_argument("--shard-tokens", type=int, default=50_000_000,
                   help="about this many tokens per shard (default 50M)")
    p.add_argument("--text-key", default="text",
                   help="JSON field (.jsonl) or column (.parquet, .arrow) holding the text")
    p.add_argument("--bos", action="store_true",
                   help="start each document with the tokenizer's BOS (train with data.bos=true)")
    p.add_argument("--format", default="text", choices=FORMATS,
                   help="text: documents (--text-key); chat: a 'messages' list of {role, "
                   "content}; prompt_response: 'prompt' and 'response' fields. The example "
                   "formats render through the tokenizer folder's chat template and write a "
                   "loss mask beside the tokens")
    p.add_argument("--train-on", default="assistant", choices=TRAIN_ON,
                   help="examples: the loss on the assistant's turns (and their end-of-turn "
                   "token) only, or on all tokens")
    p.add_argument("--glob", default=None,
                   help="only files matching this pattern (name or relative path)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    source = (HFDataset(args.hf_dataset, args.split, args.config) if args.hf_dataset else
              args.input)
    try:
        meta = prepare_shards(args.tokenizer, source, args.out,
                              shard_tokens=args.shard_tokens, text_key=args.text_key,
                              glob=args.glob, progress=not args.no_progress, bos=args.bos,
                              fmt=args.format, train_on=args.train_on)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        free = shutil.disk_usage(args.out).free if os.path.isdir(args.out) else 0
        print(f"error: disk full writing {e.filename or args.out} ({free / 1e6:,.1f} MB free "
              "there); free space and run the same command again: it resumes after the last "
              "complete shard", file=sys.stderr)
        return 1
    n_tokens = sum(s["n_tokens"] for s in meta["shards"])
    n_docs = sum(s["n_docs"] for s in meta["shards"])
    # max_id (in meta.json) lets training check model.vocab_size without reading the tokens
    max_ids = [s["max_id"] for s in meta["shards"] if "max_id" in s]
    bos_note = f", bos {meta['bos_id']} per document" if meta.get("bos") else ""
    if args.format != "text":
        n_loss = sum(s["n_loss_tokens"] for s in meta["shards"])
        bos_note += (f"; {args.format} examples, the loss on {n_loss:,} tokens "
                     f"(--train-on {args.train_on})")
    print(f"{args.out}: {len(meta['shards'])} shards, {n_docs} documents, {n_tokens:,} tokens "
          f"(vocab {meta['vocab_size']}, eos {meta['eos_id']}"
          f"{bos_note}"
          f"{f', largest id {max(max_ids)}' if max_ids else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
