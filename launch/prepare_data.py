"""Tokenize text into a token shard folder for `data.source=DIR`.

    python -m launch.prepare_data --tokenizer tok/tokenizer.json --input corpus/ --out shards/
    python -m launch.prepare_data --tokenizer tok/tokenizer.json --input data.jsonl --out shards/

--input is a .jsonl file (one JSON object per line, the text under --text-key) or a folder:
every file under it (recursively, sorted) ending in .txt .md .rst .py or .jsonl, or those
matching --glob (e.g. '*.html'). Interrupted runs resume: re-run the same command.
The work itself lives in titanax.data.shards.prepare_shards.
"""

from __future__ import annotations

import argparse
import sys

from titanax.config import ConfigError
from titanax.data.shards import prepare_shards


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.prepare_data", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, help="tokenizer.json (HF tokenizers)")
    p.add_argument("--input", required=True, help="a folder of text files or a .jsonl file")
    p.add_argument("--out", required=True, help="output shard folder (resumed if it exists)")
    p.add_argument("--shard-tokens", type=int, default=50_000_000,
                   help="about this many tokens per shard (default 50M)")
    p.add_argument("--text-key", default="text", help="JSON field holding the text (.jsonl)")
    p.add_argument("--glob", default=None,
                   help="only files matching this pattern (name or relative path)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    try:
        meta = prepare_shards(args.tokenizer, args.input, args.out,
                              shard_tokens=args.shard_tokens, text_key=args.text_key,
                              glob=args.glob, progress=not args.no_progress)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n_tokens = sum(s["n_tokens"] for s in meta["shards"])
    n_docs = sum(s["n_docs"] for s in meta["shards"])
    # max_id (in meta.json) lets training check model.vocab_size without reading the tokens
    max_ids = [s["max_id"] for s in meta["shards"] if "max_id" in s]
    print(f"{args.out}: {len(meta['shards'])} shards, {n_docs} documents, {n_tokens:,} tokens "
          f"(vocab {meta['vocab_size']}, eos {meta['eos_id']}"
          f"{f', largest id {max(max_ids)}' if max_ids else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
