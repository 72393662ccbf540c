"""Hugging Face folders in and out of titanax: importer.py (HF folder -> a step-0 checkpoint),
exporter.py (checkpoint -> HF folder), folder.py (reading a folder's files and config.json),
tokenizer.py, safetensors_io.py (streaming safetensors), source.py (what an import keeps of the
source folder and export writes back), run_config.py (the config an import trains with),
hub.py (a hub id org/name[@revision] -> a snapshot folder in the hub cache), push.py (an
exported folder -> a hub repository; docs/hub.md).

Architecture-generic: the tensor table and config.json come from the model's spec (its `hf`,
models/*/hf.py), resolved once per import or export (train/resolved.py). This package sits above train, checkpoint and
generate (it builds train states and reads checkpoints); none of them imports it."""
