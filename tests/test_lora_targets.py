"""Each family's default LoRA targets sit on its adapter (``default_lora_targets``); an empty
``model.lora_targets`` (the schema's default) means them, resolved where the LoRA is built."""

from __future__ import annotations

import pytest

from diffusionrl.config import ConfigError, get_preset, load_config
from diffusionrl.config.presets import PRESETS
from diffusionrl.models import ADAPTERS, load_adapter
from diffusionrl.models.families import adapter_class, lora_suffixes


def test_every_family_has_its_own_default():
    for cls in ADAPTERS:
        assert cls.default_lora_targets, cls.family
    # FLUX.2 [klein] shares FLUX.2's, FLUX.1 Kontext FLUX.1's, both Qwen-Image-Edit pipelines Qwen-Image's (the
    # same transformer classes)
    assert len({cls.default_lora_targets for cls in ADAPTERS}) == len(ADAPTERS) - 4


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_lists_start_with_their_familys_default(name):
    """A preset that adapts more than its family's default spells the default as a literal (the config
    package sits below diffusionrl.models): it must be the adapter's list, in order."""
    m = get_preset(name).model
    if not m.lora_targets or not m.name.startswith("builtin:"):
        return
    default = list(adapter_class(m.name).default_lora_targets)
    assert list(m.lora_targets)[:len(default)] == default


def test_empty_targets_mean_the_familys_own():
    cfg = load_config("tiny-cpu-flux", overrides=["model.lora_targets=[]"])
    assert cfg.model.lora_targets == []
    adapter = load_adapter(cfg.model)
    default = list(type(adapter).default_lora_targets)
    assert lora_suffixes(cfg.model) == default
    names = adapter.lora_targets(list(cfg.model.lora_targets))
    assert names == adapter.lora_targets(default)
    assert any(n.endswith("ff_context.net.2") for n in names)  # FLUX's, not SD3's list
    assert not any(n.endswith("proj_mlp") for n in names)  # the preset's addition is gone


def test_targets_matching_no_layer_are_a_config_error():
    cfg = load_config("tiny-cpu-wan", overrides=["model.lora_targets=[attn.add_q_proj]"])
    adapter = load_adapter(cfg.model)
    with pytest.raises(ConfigError, match="no linear layer of the wan transformer.*'to_q'"):
        adapter.lora_targets(list(cfg.model.lora_targets))
