"""Tokenizer files across the HF boundary: an HF folder's tokenizer into a run (import), a
run's tokenizer into an HF folder with a tokenizer_config.json transformers reads (export)."""

from __future__ import annotations

import json
import pathlib
import shutil

# chat_template.jinja: where transformers 5 saves the chat template (4.x kept it in
# tokenizer_config.json); both are kept, byte for byte.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


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


def tokenizer_refusal(hf_dir: pathlib.Path) -> str | None:
    """Why the folder's tokenizer.json is not imported (tokenizer_files gives none), in one
    line naming the fix; None when it is, or when the folder has none (a weights-only folder).

    Such a tokenizer (no end-of-document token the data pipeline separates documents with, or
    not readable) does not stop the import: the weights are what an import converts, as
    TorchTitan's and MaxText's HF checkpoint converters convert weights alone and take the
    tokenizer at training time. A user of either expects the weights in, and to be told at
    once that the tokenizer was left behind, not to find it out at data preparation."""
    from titanax.config import ConfigError
    from titanax.data.tokenizer import Tokenizer

    if not (hf_dir / "tokenizer.json").is_file():
        return None
    try:
        Tokenizer.load(hf_dir / "tokenizer.json")
    except ConfigError as e:
        reason = str(e).removeprefix("data.tokenizer: ")
        return (f"the tokenizer is not imported: {reason}. The weights are: prepare the data "
                "with a tokenizer that has one (python -m launch.prepare_data --tokenizer PATH; "
                "training takes it from the data folder)")
    return None


def write_tokenizer(tok_path: pathlib.Path, out: pathlib.Path, max_len: int):
    """Copies tok_path and the tokenizer files beside it (an imported HF tokenizer's own
    tokenizer_config.json, special tokens and chat template), or writes a tokenizer_config.json,
    into `out`; returns (bos_id, eos_id) for config.json."""
    from titanax.data.tokenizer import Tokenizer

    tok = Tokenizer.load(tok_path)
    shutil.copyfile(tok_path, out / "tokenizer.json")
    for name in TOKENIZER_FILES[1:]:
        if tok_path.with_name(name).is_file():
            shutil.copyfile(tok_path.with_name(name), out / name)
    if not (out / "tokenizer_config.json").is_file():
        from tokenizers import Tokenizer as HFTokenizer

        hf_tok = HFTokenizer.from_file(str(tok_path))
        config = {"tokenizer_class": "PreTrainedTokenizerFast",
                  "bos_token": hf_tok.id_to_token(tok.bos_id) if tok.bos_id is not None else None,
                  "eos_token": hf_tok.id_to_token(tok.eos_id),
                  "model_max_length": max_len, "clean_up_tokenization_spaces": False}
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok.bos_id, tok.eos_id
