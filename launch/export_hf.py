"""python -m launch.export_hf --workdir DIR --out DIR [--step N] [--dtype bfloat16|float32]
                              [--max-shard-size 5GB] [--drop-router-bias]
                              [--adapter [--base-model-id ORG/NAME[@REV]] | --base]
                              [--no-verify]
                              [--push-to-hub ORG/NAME [--private]
                              [--revision BRANCH] [--commit-message TEXT]]
Writes a run's checkpoint as a Hugging Face folder of its model.arch (e.g. LlamaForCausalLM:
config.json, generation_config.json, safetensors shards + index, tokenizer files), streaming:
host memory stays near one shard, not the model. A LoRA run (lora.rank > 0) exports with its
adapters merged into the weights (a plain model), or with --adapter as a PEFT adapter folder
(adapter_config.json + adapter_model.safetensors, float32 unless --dtype says otherwise) for
its base, or with --base as the frozen base alone (docs/lora.md). --push-to-hub then uploads that folder as one
commit to the hub repository (created when missing), with the token of HF_TOKEN or
hf auth login, checked before the export starts (docs/hub.md). The step is first checked
against its manifest (a damaged one: one line, exit 1; --no-verify skips it); an --out inside
a run folder is written holding that run's lock (exit 75 beside a live run); a full disk is
one line, exit 1."""

from __future__ import annotations

import argparse
import signal

from launch.common import fail, stop

EXIT_LOCKED = 75  # as launch.train: another live command holds the run folder --out is in


class _Stopped(BaseException):
    """A stop signal during the export (BaseException: no handler of the library takes it)."""


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m launch.export_hf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True, help="run folder holding checkpoints/")
    p.add_argument("--out", required=True, help="new (or empty) folder for the HF model")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32", "float16"],
                   help="tensor dtype written (default bfloat16; float32 for --adapter)")
    p.add_argument("--max-shard-size", default="5GB",
                   help="largest safetensors shard, e.g. 5GB, 500MB, 2GiB (default 5GB)")
    lora = p.add_argument_group("a LoRA run (default: adapters merged into the weights)")
    which = lora.add_mutually_exclusive_group()
    which.add_argument("--adapter", action="store_true",
                       help="write a PEFT adapter folder (peft.PeftModel.from_pretrained(base, OUT))")
    which.add_argument("--base", action="store_true", help="write the frozen base weights alone")
    lora.add_argument("--base-model-id", metavar="ORG/NAME[@REV]", help="with --adapter: the hub "
                      "id it names as its base (default: the import's hub id, else its folder)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip checking the step's files against its manifest (CRC-32 of every "
                        "byte of the step, read once) before exporting it")
    p.add_argument("--drop-router-bias", action="store_true",
                   help="an MoE trained with model.router_bias_update_rate > 0: export without "
                        "its routing bias, which the HF format has no tensor for (the HF model "
                        "then chooses experts by the router alone)")
    hub = p.add_argument_group("upload (after the export)")
    hub.add_argument("--push-to-hub", metavar="ORG/NAME", default=None,
                     help="upload the exported folder to this hub model repository")
    hub.add_argument("--private", action="store_true",
                     help="create the repository private (an existing one keeps its visibility)")
    hub.add_argument("--revision", default=None, metavar="BRANCH",
                     help="branch to commit to, created from main when missing (default main)")
    hub.add_argument("--commit-message", default=None, metavar="TEXT")
    args = p.parse_args(argv)
    lora_export = "adapter" if args.adapter else "base" if args.base else "merged"
    args.dtype = args.dtype or ("float32" if args.adapter else "bfloat16")
    if not args.push_to_hub and (args.private or args.revision or args.commit_message):
        p.error("--private, --revision and --commit-message go with --push-to-hub ORG/NAME")
    token = _hub_token(args.push_to_hub) if args.push_to_hub else None
    _check_adapter_base(p, args)

    from titanax.checkpoint.disk_full import is_disk_full
    from titanax.checkpoint.params_only import UnreadableCheckpoint
    from titanax.hf.exporter import export_hf, parse_size
    from titanax.train.workdir_lock import WorkdirLocked

    def stopped(signum, _frame):  # unwinds through export_hf, which removes its partial folder
        raise _Stopped(signum)

    previous = {sig: signal.signal(sig, stopped)
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    try:
        max_bytes = parse_size(args.max_shard_size)
        r = export_hf(args.workdir, args.out, step=args.step, dtype=args.dtype,
                      max_shard_bytes=max_bytes, lora=lora_export,
                      drop_unmapped=args.drop_router_bias, verify=not args.no_verify,
                      base_model_id=args.base_model_id)
    except WorkdirLocked as e:  # --out inside a run a live command holds: nothing written
        fail(str(e), EXIT_LOCKED)
    except (FileNotFoundError, FileExistsError, ValueError) as e:  # ConfigError is a ValueError
        fail(str(e))
    except UnreadableCheckpoint as e:  # a damaged run (DamagedCheckpoint too), not a bad flag
        stop(str(e))
    except OSError as e:  # the partial export is removed by export_hf
        if not is_disk_full(e):
            raise
        stop(f"disk full writing {e.filename or args.out} ({e.strerror}); nothing was written "
             f"to {args.out} (the partial export is removed): free space and run the same "
             "command again")
    except _Stopped as e:
        fail(f"stopped by {signal.Signals(e.args[0]).name}: nothing was written to {args.out} "
             "(the partial export is removed); run the same command again", 128 + e.args[0])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    tok = (f", tokenizer from {r.tokenizer}" if r.tokenizer else "" if args.adapter
           else ", no tokenizer found for the run")
    print(f"exported step {r.step}: {r.tensors} tensors, {r.bytes / 1e9:.3f} GB {args.dtype} in "
          f"{r.shards} shard(s) to {r.out}{tok}")
    if args.push_to_hub:
        _push(args, r.out, token)


def _hub_token(repo_id: str) -> str:
    from titanax.hf.push import HubError, check_push

    try:
        return check_push(repo_id)
    except HubError as e:
        fail(str(e))


def _check_adapter_base(p, args) -> None:
    """Before the export: --base-model-id goes with --adapter, and an adapter pushed to the
    hub must name a base on the hub, not a folder of this machine."""
    if args.base_model_id and not args.adapter:
        p.error("--base-model-id names the base of an --adapter export; add --adapter")
    if not args.adapter:
        return
    from titanax.hf.lora_export import adapter_base
    from titanax.hf.push import check_adapter_base

    try:
        base = adapter_base(args.workdir, args.base_model_id)
        if args.push_to_hub:
            check_adapter_base(args.push_to_hub, base)
    except ValueError as e:  # HubError is a ValueError
        fail(str(e))


def _push(args, out, token: str) -> None:
    from titanax.hf.push import HubError, push_folder

    try:
        url = push_folder(out, args.push_to_hub, token=token, private=args.private,
                          revision=args.revision, commit_message=args.commit_message)
    except HubError as e:
        fail(str(e))
    print(f"pushed {out} to {args.push_to_hub}: {url}")


if __name__ == "__main__":
    main()
