"""launch.generate's sampling filters (titanax/generate.py sampling_logits): temperature, then
top-k, then top-p, with transformers' definitions (TopKLogitsWarper, TopPLogitsWarper: a token
is dropped when the tokens more likely than it already hold top_p of the probability)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers.cli import assert_one_error, cli
from titanax.generate import _sample, sampling_logits

PROBS = np.array([0.05, 0.5, 0.15, 0.3])  # most likely first: 1, 3, 2, 0


def _kept(temperature=1.0, top_k=0, top_p=1.0) -> set[int]:
    logits = jnp.log(jnp.asarray([PROBS, PROBS[::-1]], jnp.float32))
    out = np.asarray(sampling_logits(logits, temperature, top_k, top_p))
    row0, row1 = (set(np.flatnonzero(np.isfinite(r)).tolist()) for r in out)
    assert row1 == {3 - i for i in row0}  # each row filtered on its own
    return row0


@pytest.mark.parametrize("top_k, top_p, kept", [
    (0, 1.0, {0, 1, 2, 3}),
    (1, 1.0, {1}),
    (2, 1.0, {1, 3}),
    (9, 1.0, {0, 1, 2, 3}),      # more than the vocabulary: all
    (0, 0.5, {1}),               # the most likely alone holds 0.5
    (0, 0.51, {1, 3}),
    (0, 0.8, {1, 3}),            # 0.5 + 0.3 reach 0.8
    (0, 0.81, {1, 3, 2}),
    (0, 0.01, {1}),              # the most likely token always stays
    (2, 0.6, {1}),               # top-k first, then top-p over what is left, renormalised:
    (3, 0.9, {1, 3, 2}),         # over 0.95, 0.526 + 0.316 = 0.842 < 0.9
    (3, 0.84, {1, 3}),           # (unrenormalised, 0.8 < 0.84 would keep token 2)
])
def test_top_k_and_top_p_keep_transformers_tokens(top_k, top_p, kept):
    assert _kept(top_k=top_k, top_p=top_p) == kept


def test_temperature_scales_before_the_filters_and_sampling_stays_in_the_kept_set():
    # At temperature 2 the distribution flattens: 0.5 alone no longer holds 0.4
    assert _kept(top_p=0.4) == {1} and _kept(temperature=2.0, top_p=0.4) == {1, 3}
    logits = jnp.log(jnp.asarray([PROBS], jnp.float32))
    draws = [int(_sample(logits, jax.random.key(i), 1.0, 0, 0.8)[0]) for i in range(200)]
    assert set(draws) == {1, 3}
    share = draws.count(1) / len(draws)  # 0.5 / 0.8 = 0.625 after renormalising
    assert 0.5 < share < 0.75
    assert int(_sample(logits, jax.random.key(0), 0.0, 1, 0.1)[0]) == 1  # greedy ignores both


@pytest.mark.parametrize("flag, value", [("--top-p", "0"), ("--top-p", "1.5"), ("--top-k", "-1"),
                                         ("--temperature", "-0.5")])
def test_bad_sampling_flags_are_one_line_before_any_checkpoint_is_read(tmp_path, flag, value):
    r = cli("launch.generate", "--workdir", tmp_path / "missing", "--prompt", "x", flag, value)
    assert_one_error(r, 2, f"error: {flag} must be")
    assert not (tmp_path / "missing").exists()
