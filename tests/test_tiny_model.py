"""builtin:tiny-sd3: its size, eval mode and 8x VAE, prompt encoding. Reproducible weights and the folder
the stock StableDiffusion3Pipeline loads: ``test_family_builtins.py``."""

import torch

from diffusionrl.models import SD3Adapter, build_tiny_sd3_pipeline


def test_size_eval_mode_and_8x_vae(tiny_adapter):
    pipe = tiny_adapter.pipe
    n = sum(p.numel() for m in (pipe.transformer, pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3)
            for p in m.parameters())
    assert 300_000 < n < 5_000_000
    assert not pipe.transformer.training and not pipe.vae.training
    assert tiny_adapter.latent_shape(64) == (16, 8, 8)
    images = tiny_adapter.decode(torch.zeros(2, 16, 8, 8))
    assert images.shape == (2, 64, 64, 3) and images.dtype.name == "uint8"


def test_prompt_encoding_dedups_but_matches_per_prompt_encoding(tiny_adapter):
    cond = tiny_adapter.encode_prompts(["a cat", "a dog", "a cat"], "", 16)
    single = tiny_adapter.encode_prompts(["a dog"], "", 16)
    assert cond.prompt_embeds.shape[0] == 3 and cond.negative_prompt_embeds.shape == cond.prompt_embeds.shape
    assert torch.equal(cond.prompt_embeds[0], cond.prompt_embeds[2])
    torch.testing.assert_close(cond.prompt_embeds[1], single.prompt_embeds[0], rtol=1e-5, atol=1e-6)


def test_a_too_long_prompt_is_reported_once_not_on_every_encoding(caplog):
    """diffusers warns on every encode_prompt call that truncates (quoting the whole cut-off text);
    the adapter says it once: at load (``warn_truncated``, which ``train.build_loop`` calls) or, on
    paths that skip that, at the first encoding."""
    import logging

    long = "word " * 2000
    libraries = [logging.getLogger(name) for name in ("diffusers", "transformers")]  # they do not propagate
    for at_load in (True, False):
        adapter = SD3Adapter(build_tiny_sd3_pipeline(), device="cpu")
        caplog.clear()
        for logger in libraries:
            logger.addHandler(caplog.handler)
        try:
            with caplog.at_level(logging.INFO):
                if at_load:
                    assert adapter.warn_truncated([long, "a cat", long], 32) == 1
                for _ in range(3):
                    adapter.encode_prompts([long, "a cat"], "", 32)
        finally:
            for logger in libraries:
                logger.removeHandler(caplog.handler)
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert [r.name for r in warnings] == ["diffusionrl.models.sd3"], [r.getMessage()[:80] for r in warnings]
        assert warnings[0].getMessage().startswith("1 of 2 prompts are longer than the text encoders take and are "
                                                   "truncated (CLIP takes 77 tokens; T5 model.max_sequence_length=32)")
        assert len(warnings[0].getMessage()) < 400
