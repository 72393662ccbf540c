"""train.compilation_cache: XLA's persistent cache of compiled programs, for one run."""

from __future__ import annotations

import contextlib
import os
import pathlib

import jax


@contextlib.contextmanager
def compilation_cache(setting: str, workdir: pathlib.Path):
    """train.compilation_cache for the length of the run: XLA's compiled programs are written
    there and found again by a resumed run. Small compiles too (jax caches only those over 1 s
    by default; on a CPU even the train step may compile faster). The process's own settings
    come back afterwards: a library call leaves no cache switched on."""
    if not setting:
        yield None
        return
    # reset_cache: jax opens its cache once per process; moving it has no public API.
    from jax._src import compilation_cache as jax_cache

    path = os.path.abspath(os.path.expanduser(setting.replace("{workdir}", str(workdir))))
    names = {"jax_compilation_cache_dir": path,
             "jax_persistent_cache_min_compile_time_secs": 0.0,
             "jax_persistent_cache_min_entry_size_bytes": -1}
    before = {name: getattr(jax.config, name) for name in names}
    for name, value in names.items():
        jax.config.update(name, value)
    jax_cache.reset_cache()
    try:
        yield path
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        jax_cache.reset_cache()
