"""How adapters build their options: the three knobs as keywords, the rest in ``options=``, the
old spelling (every field as a keyword) still accepted with a DeprecationWarning."""

from __future__ import annotations

import warnings

import pytest

from diffckpt import CheckpointOptions, RetentionPolicy
from diffckpt.options import (
    DEFAULT_FINGERPRINT_EVERY_N_STEPS,
    NOT_GIVEN_BASE_EVERY_N_STEPS,
    NOT_GIVEN_EVERY_N_STEPS,
    NOT_GIVEN_WRITE_BATCH,
    merge_options,
)

DEFAULT_KNOBS = {"every_n_steps": NOT_GIVEN_EVERY_N_STEPS, "write_batch": NOT_GIVEN_WRITE_BATCH,
                 "base_every_n_steps": NOT_GIVEN_BASE_EVERY_N_STEPS}  # what an adapter passes for a keyword left out


def test_knobs_given_as_keywords_win_and_those_left_out_defer_to_options() -> None:
    options = CheckpointOptions(every_n_steps=4, write_batch=2, compact_every_n_steps=100)
    merged = merge_options(options, {}, every_n_steps=NOT_GIVEN_EVERY_N_STEPS, write_batch=16,
                           base_every_n_steps=None)
    assert (merged.every_n_steps, merged.write_batch, merged.base_every_n_steps) == (4, 16, None)
    assert merged.compact_every_n_steps == 100


def test_a_keyword_given_with_the_default_value_still_wins_over_options() -> None:
    options = CheckpointOptions(every_n_steps=5, write_batch=2, base_every_n_steps=100)
    merged = merge_options(options, {}, every_n_steps=1, write_batch=8, base_every_n_steps=500)
    assert (merged.every_n_steps, merged.write_batch, merged.base_every_n_steps) == (1, 8, 500)
    assert merge_options(None, {}, **DEFAULT_KNOBS) == CheckpointOptions()


def test_the_adapters_take_an_explicit_default_over_options(tmp_path) -> None:
    from lightning_ckpt import DiffCheckpoint
    from transformers_ckpt import DiffCheckpointCallback

    five = CheckpointOptions(every_n_steps=5, write_batch=3)
    for adapter in (DiffCheckpoint, DiffCheckpointCallback):
        assert adapter(str(tmp_path), every_n_steps=1, options=five).options.every_n_steps == 1
        left_out = adapter(str(tmp_path), options=five).options
        assert (left_out.every_n_steps, left_out.write_batch) == (5, 3)
        assert repr(NOT_GIVEN_EVERY_N_STEPS) == "1"  # how the signatures show it


def test_the_old_keyword_spelling_warns_and_names_the_new_one() -> None:
    with pytest.warns(DeprecationWarning, match=r"options=diffckpt.CheckpointOptions\(retention=RetentionPolicy"):
        merged = merge_options(None, {"retention": RetentionPolicy(keep_last_bases=2)}, **DEFAULT_KNOBS)
    assert merged.retention == RetentionPolicy(keep_last_bases=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spelling does not warn
        merge_options(CheckpointOptions(retention=RetentionPolicy(keep_last_bases=2)), {}, **DEFAULT_KNOBS)


def test_an_unknown_keyword_is_a_type_error_that_lists_where_options_go() -> None:
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['every_n_step'\].*CheckpointOptions"):
        merge_options(None, {"every_n_step": 3}, **DEFAULT_KNOBS)


def test_codec_checks_follow_fingerprints_or_their_default() -> None:
    assert CheckpointOptions(fingerprint_every_n_steps=7).codec_check_every == 7
    assert CheckpointOptions(fingerprint_every_n_steps=None).codec_check_every == DEFAULT_FINGERPRINT_EVERY_N_STEPS


def test_adapters_accept_options_objects() -> None:
    from lightning_ckpt import DiffCheckpoint

    cb = DiffCheckpoint("memory://adapter-options", write_batch=3,
                        options=CheckpointOptions(fingerprint_every_n_steps=5, flush_timeout_s=1.0))
    assert (cb.options.write_batch, cb.options.fingerprint_every_n_steps, cb.options.flush_timeout_s) == (3, 5, 1.0)
    with pytest.warns(DeprecationWarning):
        DiffCheckpoint("memory://adapter-options", flush_timeout_s=1.0)
