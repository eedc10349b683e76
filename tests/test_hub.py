"""``hub.hf_token``: the one reader of the Hugging Face token, a leaf module every loader imports."""

from diffusionrl import hub


def test_token_from_the_environment(monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    assert hub.hf_token() is None
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", "old-name")
    assert hub.hf_token() == "old-name"
    monkeypatch.setenv("HF_TOKEN", "tok")
    assert hub.hf_token() == "tok"
    monkeypatch.setenv("HF_TOKEN", "")
    assert hub.hf_token() == "old-name"


def test_one_definition():
    from diffusionrl import models
    from diffusionrl.models import base

    assert models.hf_token is hub.hf_token and base.hf_token is hub.hf_token
