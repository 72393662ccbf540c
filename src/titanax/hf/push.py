"""An exported folder -> a Hugging Face hub model repository (launch.export_hf --push-to-hub).

The token is huggingface_hub's usual one (HF_TOKEN, else the file `hf auth login` wrote), and
it and the repo id are checked before the export starts, so a missing token costs no export.
The repository is created when missing (private only then: the hub keeps an existing
repository's visibility) and the folder goes up as one commit."""

from __future__ import annotations

import pathlib

from titanax.hf.hub import HubError

__all__ = ["HubError", "check_adapter_base", "check_push", "push_folder"]


def check_push(repo_id: str) -> str:
    """The token to push with; raises HubError for a malformed repo id or no token."""
    from huggingface_hub import get_token
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if "/" not in repo_id:
        raise HubError(f"--push-to-hub {repo_id}: give the repository as org/name (your user "
                       "name or an organization, then the model's name)")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise HubError(f"--push-to-hub {repo_id}: not a valid repo id: {e}") from None
    token = get_token()
    if not token:
        raise HubError(f"--push-to-hub {repo_id}: no Hugging Face token: set HF_TOKEN to a token "
                       "with write access (https://huggingface.co/settings/tokens) or run "
                       "hf auth login")
    return token


def check_adapter_base(repo_id: str, base: tuple[str | None, str | None]) -> None:
    """Raises HubError when an adapter going to `repo_id` would name as its base (PEFT's
    base_model_name_or_path; lora_export.py adapter_base) a folder of this machine, or none:
    nobody who pulls it from the hub could load its base."""
    from titanax.hf.lora_export import is_hub_base

    if is_hub_base(base):
        return
    what = (f"the local folder {base[0]}" if base[0] is not None
            else "no base (the run was not imported)")
    raise HubError(f"--push-to-hub {repo_id}: the adapter's base_model_name_or_path would be "
                   f"{what}, which no one loading it from the hub has; name the base's hub id "
                   "with --base-model-id ORG/NAME")


def push_folder(folder, repo_id: str, *, token: str, private: bool = False,
                revision: str | None = None, commit_message: str | None = None) -> str:
    """Uploads every file of `folder` to `repo_id` (on branch `revision`, created from main when
    missing; default main) in one commit; returns the commit's URL. Raises HubError."""
    from huggingface_hub import HfApi

    folder = pathlib.Path(folder)
    api = HfApi(token=token)
    message = commit_message or f"Upload {folder.name} (titanax launch.export_hf)"
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        info = api.upload_folder(repo_id=repo_id, folder_path=folder, repo_type="model",
                                 revision=revision, commit_message=message)
    # Past the export whatever fails (HTTP status, the network, the token's rights) leaves a
    # complete folder: each gets the same fix, pushing that folder again.
    except Exception as e:
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        again = f"hf upload {repo_id} {folder} ." + (f" --revision {revision}" if revision else "")
        raise HubError(f"--push-to-hub {repo_id}: upload failed ({type(e).__name__}: {first}); "
                       f"the export is complete in {folder}: push it with {again} (with a "
                       f"token that may write to {repo_id.split('/')[0]})") from None
    return str(getattr(info, "commit_url", "") or f"{api.endpoint}/{repo_id}")
