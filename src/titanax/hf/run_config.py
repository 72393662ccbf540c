"""The titanax config an import trains with. config.json says everything about the model, so
without a --config every model.* field comes from it (the architecture's hf.py from_config);
with one, its train/optim/mesh/data sections apply and its model.* is checked against
config.json by the importer. Either way the user's --set wins."""

from __future__ import annotations

import pathlib

from titanax.config import (
    DTYPES,
    SOURCE_UNSET,
    Config,
    ConfigError,
    apply_overrides,
    load_config,
    parse_override,
)
from titanax.hf.folder import HFImportError, hf_arch, read_config


def _derived_model(hf_dir: pathlib.Path) -> dict[str, object]:
    """The model.* fields config.json gives (its model_type's architecture reads them)."""
    from titanax.models.registry import spec_for_hf

    hf_cfg = read_config(hf_dir)
    try:
        spec = spec_for_hf(hf_cfg.get("model_type"))  # (hf_arch has refused an unknown one)
        derived = {"model.arch": spec.arch, **spec.hf.from_config(hf_cfg)}
    except (ValueError, KeyError) as e:
        raise HFImportError(f"{hf_dir / 'config.json'}: "
                            f"{e if isinstance(e, ValueError) else f'no {e}'}") from None
    # The longest sequence the model supports; only a bound on train.seq_len and sampling.
    if isinstance(hf_cfg.get("max_position_embeddings"), int):
        derived["model.max_seq_len"] = hf_cfg["max_position_embeddings"]
    # The dtype the weights were published in is the one they compute in, as transformers
    # loads them: a float32 checkpoint sampled in bfloat16 leaves its greedy text within
    # tokens. (transformers 5 writes 'dtype', 4.x 'torch_dtype'.)
    hf_dtype = hf_cfg.get("dtype") or hf_cfg.get("torch_dtype")
    if hf_dtype in DTYPES:
        derived["execution.dtype"] = hf_dtype
    return derived


def _is_llama3_tokenizer(hf_dir: pathlib.Path) -> bool:
    """A tokenizer.json with Llama 3's <|begin_of_text|>, which Llama 3 starts every document
    with (so data.bos defaults on for it)."""
    from titanax.data.tokenizer import BOS
    from titanax.hf.tokenizer import tokenizer_files

    if not tokenizer_files(hf_dir):
        return False
    from tokenizers import Tokenizer as HFTokenizer

    return HFTokenizer.from_file(str(hf_dir / "tokenizer.json")).token_to_id(BOS) is not None


def _has_chat_template(hf_dir: pathlib.Path) -> bool:
    from titanax.data.chat import ChatTemplate

    return ChatTemplate.from_folder(hf_dir) is not None


# Without --config, an import trains with a fine-tuning recipe (what TRL's SFT, Tunix and
# Megatron-Bridge's gpt_sft start from), not titanax's from-scratch defaults: a small peak
# learning rate with cosine decay to zero after 3% warmup, no weight decay, FSDP over every
# device, full remat, and no data until one is given (launch.train refuses to start: never
# the embedded corpus by default). The compute dtype is the one config.json names.
FINETUNE = {"optim.lr": 2e-5, "optim.schedule": "cosine", "optim.warmup_fraction": 0.03,
            "optim.min_lr_ratio": 0.0, "optim.weight_decay": 0.0, "mesh.data": 1,
            "mesh.fsdp": -1, "execution.remat": "full", "data.source": SOURCE_UNSET}
FINETUNE_SEQ_LEN = 8192


def import_config(hf_dir, config_path=None, overrides=()) -> Config:
    """The run's config: `config_path`, or the fine-tuning recipe (FINETUNE) with every
    model.* field from config.json and train.seq_len min(8192, max_position_embeddings);
    model.arch from config.json's model_type, data.bos on for a Llama 3 tokenizer, then
    `overrides` (--set strings). Raises HFImportError or ConfigError."""
    hf_dir = pathlib.Path(hf_dir)
    user = dict(parse_override(o) for o in overrides)
    arch = hf_arch(hf_dir)  # None without a config.json
    if config_path is None and arch is None:
        raise HFImportError(f"{hf_dir} has no config.json to take the model from; give "
                            "--config FILE with the model's dimensions")
    picked = {"model.arch": arch} if arch else {}
    if config_path is None:
        picked = {**FINETUNE, **_derived_model(hf_dir)}
        # Sequences as long as the model takes, up to 8192 (Llama 3's pretraining length).
        longest = user.get("model.max_seq_len", picked.get("model.max_seq_len", 1 << 30))
        try:
            picked["train.seq_len"] = min(FINETUNE_SEQ_LEN, int(longest))
        except ValueError:
            pass  # a malformed --set model.max_seq_len: apply_overrides names it
    if _is_llama3_tokenizer(hf_dir):
        picked["data.bos"] = True
    if config_path is None and _has_chat_template(hf_dir):
        # An Instruct model is fine-tuned on examples with loss masks; a text folder is
        # refused in one line naming prepare_data --format chat (data.format=auto allows it).
        picked["data.format"] = "examples"
    try:
        if config_path is not None:
            return load_config(config_path, {**picked, **user})
        return apply_overrides(Config(), {**picked, **user})
    except TypeError as e:  # dataclasses.replace with a wrong type slips through as TypeError
        raise ConfigError(str(e)) from None

__all__ = ["ConfigError", "HFImportError", "import_config"]
