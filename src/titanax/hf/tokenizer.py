"""Tokenizer files across the HF boundary: an HF folder's tokenizer into a run (import), a
run's tokenizer into an HF folder with a tokenizer_config.json transformers reads (export)."""

from __future__ import annotations

import json
import pathlib
import shutil

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def tokenizer_files(hf_dir: pathlib.Path) -> list[pathlib.Path]:
    """The folder's tokenizer files, if titanax's Tokenizer can use them (else none)."""
    from titanax.config import ConfigError
    from titanax.data.tokenizer import Tokenizer

    if not (hf_dir / "tokenizer.json").is_file():
        return []
    try:
        Tokenizer.load(hf_dir / "tokenizer.json")
    except ConfigError:
        return []
    return [hf_dir / n for n in TOKENIZER_FILES if (hf_dir / n).is_file()]


def write_tokenizer(tok_path: pathlib.Path, out: pathlib.Path, max_len: int):
    """Copies tok_path (and a shipped tokenizer_config.json, or writes one) into `out`;
    returns (bos_id, eos_id) for config.json."""
    from titanax.data.tokenizer import Tokenizer

    tok = Tokenizer.load(tok_path)
    shutil.copyfile(tok_path, out / "tokenizer.json")
    shipped = tok_path.with_name("tokenizer_config.json")
    if shipped.is_file():  # an imported HF tokenizer keeps its own (chat template, ...)
        shutil.copyfile(shipped, out / "tokenizer_config.json")
    else:
        from tokenizers import Tokenizer as HFTokenizer

        hf_tok = HFTokenizer.from_file(str(tok_path))
        config = {"tokenizer_class": "PreTrainedTokenizerFast",
                  "bos_token": hf_tok.id_to_token(tok.bos_id) if tok.bos_id is not None else None,
                  "eos_token": hf_tok.id_to_token(tok.eos_id),
                  "model_max_length": max_len, "clean_up_tokenization_spaces": False}
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok.bos_id, tok.eos_id
