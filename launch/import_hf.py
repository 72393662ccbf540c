"""python -m launch.import_hf --hf DIR --config FILE [--set section.field=value ...] --workdir DIR
Reads a local Hugging Face folder (safetensors only; the model_type of any registered architecture), checks every
tensor against the config, and writes WORKDIR/checkpoints/0, which `python -m launch.train --config FILE
--workdir DIR` resumes from (fine-tuning from published weights). model.arch comes from
config.json's model_type unless --set model.arch=... says otherwise."""

from __future__ import annotations

import argparse

from launch.common import add_config_flags, add_host_devices_flag, fail, setup_jax


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m launch.import_hf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf", required=True, help="local HF model folder")
    add_config_flags(p, default_config=None)
    add_host_devices_flag(p)
    p.add_argument("--workdir", required=True, help="new run folder for the imported checkpoint")
    args = p.parse_args(argv)
    if args.config is None:
        fail("--config is required: the titanax config (model dimensions, mesh, optimizer) the "
             "imported checkpoint will be trained with, e.g. configs/llama3_8b.py")

    from titanax.config import ConfigError, load_config
    from titanax.hf.folder import HFImportError, hf_arch

    try:
        arch = hf_arch(args.hf)  # the folder's architecture; a later --set still wins
        picked = [f"model.arch={arch}"] if arch else []
        cfg = load_config(args.config, picked + args.overrides)
    except (ConfigError, HFImportError) as e:
        fail(str(e))
    setup_jax(args.host_devices)

    from titanax.hf.importer import import_hf

    try:
        import_hf(args.hf, cfg, args.workdir)
    except (HFImportError, ConfigError) as e:
        fail(str(e))


if __name__ == "__main__":
    main()
