"""Hugging Face folders in and out of titanax: importer.py (HF folder -> a step-0 checkpoint),
exporter.py (checkpoint -> HF folder), folder.py (reading a folder's files and config.json),
tokenizer.py, safetensors_io.py (streaming safetensors).

Architecture-generic: the tensor table and config.json come from the model's spec
(`model_spec(cfg.model).hf`, models/*/hf.py). This package sits above train, checkpoint and
generate (it builds train states and reads checkpoints); none of them imports it."""
