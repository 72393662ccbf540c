"""`--hf org/name[@revision]`: a Hugging Face hub id -> a local model folder, or a path -> itself.

The hub id becomes a snapshot folder in huggingface_hub's own cache (HF_HUB_CACHE, else
HF_HOME/hub, else ~/.cache/huggingface/hub), downloaded by `snapshot_download`, so the files are
shared with transformers and every other tool that reads that cache, and HF_HUB_OFFLINE=1 reads
the cache without touching the network. An existing folder always wins over a hub id: every
import of a local folder stays what it was. Only the files an import reads are fetched (a
published repository often carries the same weights twice more: pickled .bin files and an
original/ or consolidated.safetensors checkpoint)."""

from __future__ import annotations

import json
import pathlib
import re

from titanax.hf.source import KEPT_FILES
from titanax.hf.tokenizer import TOKENIZER_FILES

__all__ = ["HubError", "hub_id", "resolve_model_folder"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Everything hf/folder.py, run_config.py, tokenizer.py, source.py and data/chat.py read,
# except the shards, which only the index names (the second download).
SMALL_FILES = (*KEPT_FILES, INDEX, SINGLE, *TOKENIZER_FILES)
# org/name as the hub spells it; the hub itself checks the finer rules (length, '--').
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class HubError(ValueError):
    """A hub id that cannot become a local folder, or an upload that failed (one line)."""


def hub_id(source: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) for 'org/name' or 'org/name@revision'; None for anything
    else (a path: '/x', './x', 'a/b/c', '~/x')."""
    repo, at, revision = str(source).partition("@")
    if not _REPO_ID.fullmatch(repo) or (at and not revision):
        return None
    return repo, revision or None


def import_origin(source, folder: pathlib.Path) -> tuple[str, str | None]:
    """(name, revision) an import records as its base (hf/source.py): a hub id and the commit
    resolve_model_folder took it at, or an existing folder's absolute path and None."""
    if pathlib.Path(source).expanduser().is_dir():
        return str(pathlib.Path(source).expanduser().absolute()), None
    return hub_id(str(source))[0], folder.name


def resolve_model_folder(source, *, log=print) -> pathlib.Path:
    """The local folder `source` names: an existing folder as given, else the hub cache's
    snapshot of `org/name[@revision]` (downloaded when missing and the hub is reachable).
    Raises HubError (one line naming the fix)."""
    path = pathlib.Path(source).expanduser()
    if path.is_dir():
        return path
    parsed = hub_id(str(source))
    if parsed is None or path.exists():
        what = "a file, not a folder" if path.exists() else "no such folder"
        raise HubError(f"--hf {source}: {what}; give a local Hugging Face model folder or a hub "
                       "id org/name[@revision]")
    repo, revision = parsed
    folder = _snapshot(repo, revision, list(SMALL_FILES), source)
    # The shards come from the same commit as the index that names them (folder.name is the
    # commit hash), whatever the branch has moved to since. A snapshot file exists only once
    # its download finished, so shards all there need no second call (which, with the network
    # down, retries for some 20 s before it falls back to the cache).
    shards = _shards(folder)
    if any(not (folder / name).is_file() for name in shards):
        folder = _snapshot(repo, folder.name, shards, source)
    log(f"{repo} at commit {folder.name} (revision {revision or 'main'}): {folder}")
    return folder


def _shards(folder: pathlib.Path) -> list[str]:
    """The shard files the snapshot's index names (none without an index; a malformed index
    is hf/folder.py's to report)."""
    try:
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        return sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def _snapshot(repo: str, revision: str | None, patterns: list[str], source) -> pathlib.Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return pathlib.Path(snapshot_download(repo, revision=revision, allow_patterns=patterns))
    except LocalEntryNotFoundError as e:  # offline or unreachable, and not (all) in the cache
        raise HubError(_not_cached(repo, revision, source, e.__cause__)) from None
    except GatedRepoError:
        raise HubError(f"--hf {source}: {repo} is gated: accept its terms at "
                       f"{_endpoint()}/{repo} and log in (hf auth login, or set HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise HubError(f"--hf {source}: no model repository {repo} on {_endpoint()} (nor a local "
                       "folder of that name): check the spelling; a private repository needs "
                       "hf auth login or HF_TOKEN") from None
    except RevisionNotFoundError:
        raise HubError(f"--hf {source}: {repo} has no revision {revision!r}: give a branch, tag "
                       f"or commit hash of {_endpoint()}/{repo}") from None
    except HFValidationError as e:
        raise HubError(f"--hf {source}: not a valid hub id ({_first_line(e)})") from None
    except HfHubHTTPError as e:
        raise HubError(f"--hf {source}: the hub refused the download ({_first_line(e)}); "
                       "retry, or log in (hf auth login / HF_TOKEN) if it is private") from None
    except OSError as e:  # the cache folder unwritable, the disk full
        from huggingface_hub import constants

        raise HubError(f"--hf {source}: downloading {repo} into the Hugging Face cache "
                       f"{constants.HF_HUB_CACHE} failed ({type(e).__name__}: {_first_line(e)}): "
                       "free space or fix its permissions (or set HF_HOME to another folder) "
                       "and run again; finished files stay cached") from None


def _not_cached(repo: str, revision: str | None, source, cause) -> str:
    """Why the cache could not stand in for the hub, what it holds, and the fix."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    cache = pathlib.Path(constants.HF_HUB_CACHE)
    stored = cache / repo_folder_name(repo_id=repo, repo_type="model")
    refs = sorted(str(p.relative_to(stored / "refs")) for p in (stored / "refs").rglob("*")
                  if p.is_file())  # main, v1.0, pr/1
    wanted = revision or "main"
    if not stored.is_dir():
        held = f"the Hugging Face cache {cache} has no {stored.name}"
    elif wanted in refs or (stored / "snapshots" / wanted).is_dir():
        held = f"its snapshot in the Hugging Face cache {cache} lacks files (an interrupted download)"
    else:
        held = (f"the Hugging Face cache {cache} holds {repo} but not revision {revision!r} "
                f"(cached refs: {', '.join(refs) or 'none'})")
    if constants.HF_HUB_OFFLINE:
        why, fix = "HF_HUB_OFFLINE=1 forbids downloading", "run once with network access and " \
            "HF_HUB_OFFLINE unset to fill the cache"
    else:
        reason = f" ({type(cause).__name__})" if cause is not None else ""
        why, fix = f"{_endpoint()} could not be reached{reason}", "run again with network access"
    return (f"--hf {source}: {held}, and {why}: {fix}, or point HF_HOME (or HF_HUB_CACHE) at a "
            "cache that holds it")


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _first_line(e: Exception) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__
