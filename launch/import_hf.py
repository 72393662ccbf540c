"""python -m launch.import_hf --hf DIR|ORG/NAME[@REVISION] [--config FILE]
                              [--set section.field=value ...] --workdir DIR
Reads a Hugging Face folder (safetensors only; the model_type of any registered architecture):
a local folder, or a hub id downloaded into the hub cache (HF_HOME / HF_HUB_CACHE; only the
files an import reads; HF_HUB_OFFLINE=1 reads the cache alone: docs/hub.md). Checks every
tensor, and writes WORKDIR/checkpoints/0 and WORKDIR/config.json, which
`python -m launch.train --workdir DIR` fine-tunes (published weights).

Without --config every model.* field comes from the folder's config.json (the compute dtype
too) and the rest is a fine-tuning recipe (titanax/hf/run_config.py FINETUNE: lr 2e-5, cosine
after 3% warmup, FSDP over all devices, full remat, train.seq_len min(8192, the model's
context), and no data.source: launch.train asks for one); with --config, that file's
train/optim/mesh/data sections apply and its model.* must agree with config.json. The folder's tokenizer becomes the run's (data.tokenizer),
a Llama 3 tokenizer turns data.bos on, and the folder's generation_config.json, chat template
and config.json keys titanax does not use are kept for launch.export_hf. --set wins over all.

It holds the workdir's lock (one command per workdir, as launch.train): exit 75 with one line
naming the holder when a live run has it, 2 for a bad folder or config (a tensor holding NaN
or inf is one, named), 1 when the disk fills up (one line)."""

from __future__ import annotations

import argparse

from launch.common import add_config_flags, add_host_devices_flag, fail, setup_jax, stop

EXIT_LOCKED = 75  # as launch.train: another live command holds the workdir; rerun after it


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m launch.import_hf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf", required=True, metavar="DIR|ORG/NAME[@REVISION]",
                   help="local HF model folder (wins when it exists), or a hub model id")
    add_config_flags(p, default_config=None)
    add_host_devices_flag(p)
    p.add_argument("--workdir", required=True, help="new run folder for the imported checkpoint")
    args = p.parse_args(argv)

    from titanax.config import ConfigError
    from titanax.hf.hub import HubError, import_origin, resolve_model_folder
    from titanax.hf.run_config import HFImportError, import_config

    try:
        hf_dir = resolve_model_folder(args.hf)
        cfg = import_config(hf_dir, args.config, args.overrides)
    except (ConfigError, HFImportError, HubError) as e:
        fail(str(e))
    setup_jax(args.host_devices)

    from titanax.checkpoint.disk_full import DiskFull, is_disk_full
    from titanax.hf.importer import import_hf
    from titanax.train.workdir_lock import WorkdirLocked

    try:
        import_hf(hf_dir, cfg, args.workdir, origin=import_origin(args.hf, hf_dir))
    except (HFImportError, ConfigError) as e:
        fail(str(e))
    except WorkdirLocked as e:  # a live run holds the folder: nothing was written
        fail(str(e), EXIT_LOCKED)
    except DiskFull as e:  # the checkpoint's one line (its partial step removed)
        stop(str(e))
    except OSError as e:  # the tokenizer, config.json: whatever else the import writes
        if not is_disk_full(e):
            raise
        stop(f"disk full writing {e.filename or args.workdir} ({e.strerror}); free space, "
             f"remove {args.workdir} and run the same command again")


if __name__ == "__main__":
    main()
