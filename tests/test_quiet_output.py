"""No noise on every run: transformers' torchvision fallback notice, diffusers' ``torch_dtype``
FutureWarning from our loads, and the bars of saving and loading a pipeline folder are gone; other
warnings still show."""

from __future__ import annotations

import logging
import warnings

import pytest

import diffusionrl  # noqa: F401  (installs the filter)


def test_the_torchvision_fallback_notice_is_dropped_and_nothing_else(caplog):
    log = logging.getLogger("transformers.utils.import_utils")
    with caplog.at_level(logging.WARNING):
        log.warning("`CLIPImageProcessor` requires torchvision (not installed); falling back to "
                    "`CLIPImageProcessorPil` for backward compatibility.")
        log.warning("some other import problem")
    assert [r.getMessage() for r in caplog.records] == ["some other import problem"]


@pytest.mark.usefixtures("one_torch_thread")
def test_saving_and_loading_a_pipeline_folder_prints_no_bars_and_no_dtype_warning(tmp_path, capfd):
    import diffusers.utils.logging as diffusers_logging

    from diffusionrl.models import load_pipeline, save_builtin

    save_builtin("builtin:tiny-sd3", tmp_path / "tiny")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # diffusers 0.42: `torch_dtype` is deprecated
        pipe = load_pipeline(str(tmp_path / "tiny"))
    err = capfd.readouterr().err
    assert "Writing model shards" not in err and "Loading pipeline components" not in err, err
    assert "Loading weights" not in err and "torchvision" not in err, err
    assert pipe.transformer is not None and diffusers_logging.is_progress_bar_enabled()  # restored
