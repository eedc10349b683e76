"""The SGLang rollout engine against a real SGLang diffusion server (CPU, fp32, tiny SD3 and tiny FLUX).

The server runs from the repo's ``.venv-sglang`` (``make sglang-env``, which ``make test`` runs
first); these tests skip only when that environment is absent. The module starts one server per
family it serves (``SERVERS``, side by side) and shares them; the training run launches its own (the
engine owns its server).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from diffusionrl.config import ConfigError, load_config
from diffusionrl.rollout.base import SamplingSpec
from diffusionrl.rollout.sglang import (
    SGLangRolloutEngine,
    lora_layers,
    merge_lora,
    resolve_sglang_python,
    sglang_available,
)
from diffusionrl.run import Callback
from diffusionrl.training.flow_grpo import FlowGRPOObjective

from .conftest import tiny_config

requires_sglang = pytest.mark.skipif(
    not sglang_available(), reason="no SGLang environment (.venv-sglang): run `make sglang-env` (make test does)"
)

PROMPTS = ["a red cat on the beach", "a blue car in the city"]
# Tests never fail on timing: the server runs at the lowest CPU priority without a GPU, and on a
# machine loaded by other work its start was measured past the default 300 s.
SLOW_START = "sampling.sglang_start_timeout_s=1800"


def spec(**kw) -> SamplingSpec:
    base = {"resolution": 32, "num_steps": 4, "guidance_scale": 4.5, "sde_type": "sde", "noise_level": 0.7,
            "max_sequence_length": 32}
    base.update(kw)
    return SamplingSpec(**base)


def batch(k: int = 2, seed0: int = 100):
    prompts = [p for p in PROMPTS for _ in range(k)]
    groups = [g for g in range(len(PROMPTS)) for _ in range(k)]
    seeds = list(range(seed0, seed0 + len(prompts)))
    return prompts, groups, seeds


# The servers this module starts, side by side (a start is mostly its two interpreters' imports, one core each):
# name -> (preset, overrides). FLUX.2 [klein] is served at SGLang's fixed text length.
SERVERS = {"sd3": ("tiny-cpu-sglang", SLOW_START), "flux": ("tiny-cpu-flux", SLOW_START),
           "flux2": ("tiny-cpu-flux2", SLOW_START),
           "flux2-klein": ("tiny-cpu-flux2-klein", SLOW_START, "model.max_sequence_length=512")}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """name -> (cfg, adapter, policy, engine) for each of ``SERVERS``, served by SGLang's native pipeline of its
    family, weights verified on every push, the LoRA's initial state pushed. Policies and base-model folders are
    built here one at a time (seeded builds), then the servers start side by side; the engines close after."""
    if not sglang_available():
        pytest.skip("no SGLang environment (.venv-sglang): run `make sglang-env` (make test does)")
    from concurrent.futures import ThreadPoolExecutor

    from diffusionrl.models import load_adapter
    from diffusionrl.models.families import save_builtin
    from diffusionrl.training.policy import LoraPolicy

    built = {}
    for name, (preset, *overrides) in SERVERS.items():
        cfg = tiny_config("sampling.engine=sglang", "sampling.sglang_verify_weights=true", *overrides, preset=preset)
        adapter = load_adapter(cfg.model)
        policy = LoraPolicy(adapter, cfg.model, seed=0)
        folder = save_builtin(cfg.model.name, tmp_path_factory.mktemp(f"served-{name}") / "model")
        built[name] = (cfg, adapter, policy, str(folder))

    def start(name: str) -> SGLangRolloutEngine:
        cfg, adapter, policy, folder = built[name]
        engine = SGLangRolloutEngine.from_config(cfg, adapter, policy, model_path=folder)
        try:
            engine.update_weights(policy.lora_state(), 0)
        except BaseException:
            engine.close()
            raise
        return engine

    engines, failed = {}, None
    with ThreadPoolExecutor(len(built)) as pool:
        for name, future in [(name, pool.submit(start, name)) for name in built]:
            try:
                engines[name] = future.result()
            except Exception as exc:  # the others still start, and are closed below
                failed = failed or exc
    try:
        if failed is not None:
            raise failed
        yield {name: (*built[name][:3], engine) for name, engine in engines.items()}
    finally:
        for engine in engines.values():
            engine.close()


@pytest.fixture(scope="module")
def stack(servers):
    """(cfg, adapter, policy, engine): a tiny SD3 LoRA policy and an SGLang engine serving it."""
    return servers["sd3"]


def perturbed(state: dict[str, torch.Tensor], scale: float = 0.05, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in state.items()}


# -- no server needed --------------------------------------------------------------------------------


def test_preset_and_validation():
    cfg = load_config("tiny-cpu-sglang")
    assert cfg.sampling.engine == "sglang" and cfg.sampling.sglang_verify_weights
    with pytest.raises(ConfigError, match="sglang_port"):
        load_config("tiny-cpu-sglang", overrides=["sampling.sglang_port=70000"])
    with pytest.raises(ConfigError, match="sglang_ipc_bucket_mb"):
        load_config("tiny-cpu-sglang", overrides=["sampling.sglang_ipc_bucket_mb=0"])


def test_every_family_is_served_or_refused_naming_why():
    """Each model family is either served (``SERVED_FAMILIES``, with its text-encoder lengths) or refused at once
    with the reason found when it was tried (``UNSERVED_FAMILIES``), never both, never neither."""
    from diffusionrl.models import ADAPTERS
    from diffusionrl.rollout.sglang.server import (
        SERVED_FAMILIES,
        UNSERVED_FAMILIES,
        SGLangServer,
        SGLangServerError,
        text_encoder_args,
    )

    families = {a.family for a in ADAPTERS}
    assert set(SERVED_FAMILIES) | set(UNSERVED_FAMILIES) == families
    assert not set(SERVED_FAMILIES) & set(UNSERVED_FAMILIES)
    for family, (_, encoders) in SERVED_FAMILIES.items():
        assert len(text_encoder_args(family, 64)) == encoders
    for family, why in UNSERVED_FAMILIES.items():
        with pytest.raises(SGLangServerError, match=f"not '{family}'"):
            SGLangServer("python", "/nonexistent", "fp32", family=family)
        assert len(why) > 40, family


def test_interpreter_resolution(tmp_path, monkeypatch):
    from diffusionrl.rollout.sglang import SGLangServerError

    fake = tmp_path / "python"
    fake.write_text("")
    assert resolve_sglang_python(str(fake)) == str(fake)
    monkeypatch.setenv("DIFFUSIONRL_SGLANG_PYTHON", str(fake))
    assert resolve_sglang_python("") == str(fake)
    with pytest.raises(SGLangServerError, match="not a file"):
        resolve_sglang_python(str(tmp_path / "missing"))


def test_free_port_pair():
    import socket

    from diffusionrl.rollout.sglang import free_port

    port = free_port()
    assert 20000 <= port < 32000  # below the ephemeral range that outgoing connections draw from
    for p in (port, port + 1):
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_merged_weights_equal_peft_merge(tiny_adapter):
    """W0 + scale * B @ A is what peft itself merges into the layer."""
    import copy

    from diffusionrl.models import SD3Adapter
    from diffusionrl.training.policy import LoraPolicy

    cfg = tiny_config()
    adapter = SD3Adapter(copy.deepcopy(tiny_adapter.pipe))
    policy = LoraPolicy(adapter, cfg.model, seed=0)
    policy.load_lora_state(perturbed(policy.lora_state()))
    merged = dict(merge_lora(lora_layers(policy.model), policy.lora_state(), torch.float32))
    policy.model.merge_adapter()
    base = policy.model.get_base_model()
    for name, value in merged.items():
        module = base.get_submodule(name.removesuffix(".weight"))
        torch.testing.assert_close(value, module.base_layer.weight, rtol=0, atol=1e-6)


# -- against the server --------------------------------------------------------------------------------


@requires_sglang
def test_the_server_listens_on_loopback_only(stack):
    """HTTP, the scheduler, gloo and torch.distributed's store of the server and its ranks: nothing
    on another interface (tests/test_local_servers.py checks the store's launcher without SGLang)."""
    import psutil

    engine = stack[3]
    root = psutil.Process(engine.server.pid)
    listening = [(p.pid, p.name(), c.laddr.ip, c.laddr.port) for p in [root, *root.children(recursive=True)]
                 for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN]
    assert ("127.0.0.1", engine.server.port) in {(ip, port) for _, _, ip, port in listening}
    assert ("127.0.0.1", engine.server.master_port) in {(ip, port) for _, _, ip, port in listening}
    exposed = [row for row in listening if row[2] not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]
    assert not exposed, f"listening beyond loopback (pid, process, address, port): {exposed}"
    assert f"torch.distributed store on 127.0.0.1:{engine.server.master_port}" in engine.server.log_path.read_text()


def test_trajectory_shapes(stack):
    _, adapter, _, engine = stack
    prompts, groups, seeds = batch()
    mask = np.zeros((4, 4), dtype=bool)
    mask[0, [0, 1]] = mask[1, [1, 2]] = mask[2, [0, 2]] = mask[3, 0] = True  # per-sample step sets
    traj = engine.generate(prompts, groups, seeds, spec(), mask, metadata=[{"i": i} for i in range(4)])
    b, t = 4, 4
    assert traj.latents.shape == (b, t + 1, 16, 4, 4) and traj.latents.dtype == torch.float32
    assert traj.log_probs.shape == (b, t) and traj.sde_mask.shape == (b, t)
    assert torch.equal(traj.sde_mask, torch.as_tensor(mask))
    assert bool((traj.log_probs[~traj.sde_mask] == 0).all()) and bool((traj.log_probs[traj.sde_mask] != 0).all())
    assert bool(torch.isfinite(traj.log_probs).all())
    sigmas, timesteps = adapter.schedule(t)  # the server's schedule is the scheduler's own
    torch.testing.assert_close(traj.sigmas, sigmas, rtol=0, atol=1e-7)
    torch.testing.assert_close(traj.timesteps, timesteps, rtol=0, atol=1e-4)
    c = traj.conditioning
    assert c.prompt_embeds.shape[0] == b and c.prompt_embeds.shape[2] == 64 and c.pooled_embeds.shape == (b, 64)
    assert c.negative_prompt_embeds.shape == c.prompt_embeds.shape
    assert (torch.equal(c.prompt_embeds[0], c.prompt_embeds[1])
            and not torch.equal(c.prompt_embeds[0], c.prompt_embeds[2]))
    # the server encodes as the local engine does: CLIP 77 + T5 max_sequence_length tokens, same values
    ours = adapter.encode_prompts(prompts, "", 32)
    assert c.prompt_embeds.shape[1] == 77 + 32
    for name in ("prompt_embeds", "pooled_embeds", "negative_prompt_embeds", "negative_pooled_embeds"):
        torch.testing.assert_close(getattr(c, name), getattr(ours, name), rtol=1e-5, atol=1e-5, msg=name)
    assert traj.images.shape == (b, 32, 32, 3) and traj.images.dtype == np.uint8
    assert traj.policy_version == engine.version and traj.metadata[3] == {"i": 3}
    assert traj.latents[:, 0].std() > 0.5  # x_0 is noise


@requires_sglang
def test_seeds_reproduce_and_differ(stack):
    _, _, _, engine = stack
    prompts, groups, seeds = batch()
    a = engine.generate(prompts, groups, seeds, spec())
    b = engine.generate(prompts, groups, seeds, spec())
    c = engine.generate(prompts, groups, [s + 1000 for s in seeds], spec())
    assert torch.equal(a.latents, b.latents) and torch.equal(a.log_probs, b.log_probs)
    assert np.array_equal(a.images, b.images)
    for i in range(4):
        assert not torch.equal(a.latents[i], c.latents[i])
    # one prompt, different seeds: every sample of a group is its own trajectory
    assert not torch.equal(a.latents[0], a.latents[1])


@requires_sglang
def test_outputs_of_one_request_are_their_own_samples(stack):
    """The engine sends a group's samples as one request with one seed per output. Upstream
    report: several outputs of one request may collapse to output 0's trajectory; here each output
    is its own trajectory. An output depends on its seed and its request's output count only (not
    on the other seeds): sglang 0.5.23 draws each output's SDE noise as a whole-batch block from the
    output's generator, so the trajectories of one seed alone and in a request of 3 share the
    initial noise and the first SDE step only. (Batched forwards may differ by fp32 rounding.)"""
    _, _, _, engine = stack
    seeds = [7, 8, 9]
    body = engine._request("a red cat", seeds, [0, 1], spec())
    assert body["num_outputs_per_prompt"] == 3 and body["extra_sampling_params"] == {"seed": seeds}
    items = engine._generate_one(body)
    latents = [it["dit_trajectory"]["latents"] for it in items]
    assert len(latents) == 3
    for i in range(3):
        for j in range(i + 1, 3):
            assert not torch.equal(latents[i][1:], latents[j][1:]), f"outputs {i} and {j} collapsed"
    shuffled = engine._generate_one(engine._request("a red cat", [9, 7, 30], [0, 1], spec()))
    for k, m in ((2, 0), (0, 1)):  # seed 9, seed 7 among other seeds
        torch.testing.assert_close(latents[k], shuffled[m]["dit_trajectory"]["latents"], rtol=0, atol=1e-5)
        torch.testing.assert_close(items[k]["rollout_log_probs"], shuffled[m]["rollout_log_probs"], rtol=0, atol=1e-5)
    (alone,) = engine._generate_one(engine._request("a red cat", [7], [0, 1], spec()))
    torch.testing.assert_close(latents[0][:2], alone["dit_trajectory"]["latents"][:2], rtol=0, atol=1e-5)


@requires_sglang
def test_a_batch_goes_as_one_request_per_group(stack):
    """Samples sharing a prompt and an SDE step set go together (at most outputs_per_request to a
    request), and the answers come back in sample order."""
    from diffusionrl.rollout.sglang.protocol import plan_requests

    _, _, _, engine = stack
    prompts, groups, seeds = batch(k=3)
    mask = np.zeros((6, 4), dtype=bool)
    mask[:3, [0, 1]] = True
    mask[3:5, [1, 2]] = True
    mask[5, 0] = True  # one sample of group 1 with its own step set
    sent = engine.requests_sent
    traj = engine.generate(prompts, groups, seeds, spec(), mask)
    assert engine.requests_sent - sent == 3
    plan = plan_requests(prompts, torch.tensor(seeds), torch.as_tensor(mask), spec(), 2)
    assert [idx for idx, _ in plan] == [[0, 1], [2], [3, 4], [5]]
    plan = plan_requests(prompts, torch.tensor(seeds), torch.as_tensor(mask), spec(), 16)
    assert [idx for idx, _ in plan] == [[0, 1, 2], [3, 4], [5]]
    for idx, body in plan:
        assert body["rollout_sde_step_indices"] == [j for j in range(4) if mask[idx[0], j]]
        for i, item in zip(idx, engine._generate_one(body)):
            torch.testing.assert_close(traj.latents[i], item["dit_trajectory"]["latents"], rtol=0, atol=1e-5)
            torch.testing.assert_close(traj.log_probs[i], item["rollout_log_probs"].reshape(4), rtol=0, atol=1e-5)


@requires_sglang
def test_cross_engine_log_prob_exactness(stack):
    """Our trainer's recompute of the server's log-probs on its own trajectories (fp32), with a
    non-zero LoRA pushed as merged weights."""
    cfg, _, policy, engine = stack
    original = policy.lora_state()
    policy.load_lora_state(perturbed(original))
    try:
        engine.update_weights(policy.lora_state(), 1)
        prompts, groups, seeds = batch()
        mask = np.zeros((4, 4), dtype=bool)
        mask[:, :3] = True
        traj = engine.generate(prompts, groups, seeds, spec(), mask)
        diff, pairs = FlowGRPOObjective(cfg, policy).recompute_log_prob_diff(traj)
        assert pairs == 12
        assert diff <= 1e-5, f"log_prob_mean_abs_diff {diff:.3e}"
        print(f"cross-engine log_prob_mean_abs_diff={diff:.3e} over {pairs} pairs")
    finally:
        policy.load_lora_state(original)
        engine.update_weights(original, 0)


@requires_sglang
def test_weight_push_changes_outputs_and_restores(stack):
    _, _, policy, engine = stack
    original = policy.lora_state()
    prompts, groups, seeds = batch()
    before = engine.generate(prompts, groups, seeds, spec())
    c0 = engine.server_checksum()
    assert c0 == engine.expected_checksum()
    engine.update_weights(perturbed(original, scale=0.2), 5)
    assert engine.version == 5
    c1 = engine.server_checksum()
    assert c1 != c0 and c1 == engine.expected_checksum()
    after = engine.generate(prompts, groups, seeds, spec())
    assert after.policy_version == 5
    assert not torch.equal(before.latents[:, 1:], after.latents[:, 1:])
    assert not np.array_equal(before.images, after.images)
    engine.update_weights(original, 6)
    assert engine.server_checksum() == c0
    again = engine.generate(prompts, groups, seeds, spec())
    assert torch.equal(before.latents, again.latents) and torch.equal(before.log_probs, again.log_probs)


@requires_sglang
def test_a_full_fine_tune_is_pushed_whole_verified_and_recomputed_exactly(stack):
    """``model.finetune=full`` through the module's server: the engine checks the served base weights, pushes
    every transformer parameter (by value on CPU, each tensor's SHA-256 and the module checksum verified), the
    server samples with them and our trainer recomputes its log-probs; a state missing a parameter is refused
    before anything is sent. The LoRA engine's weights are pushed back after."""
    from diffusionrl.models import load_adapter
    from diffusionrl.training.full import build_policy

    _, _, lora_policy, lora_engine = stack
    cfg = tiny_config(SLOW_START, "model.finetune=full", "sampling.sglang_verify_weights=true",
                      preset="tiny-cpu-sglang")
    adapter = load_adapter(cfg.model)
    policy = build_policy(adapter, cfg)  # a FullPolicy, with the KL term's frozen reference
    engine = SGLangRolloutEngine.from_config(cfg, adapter, policy, server=lora_engine.server)  # verifies the base
    base = policy.lora_state()
    try:
        assert engine.module_check and set(engine.param_names) == set(base)
        policy.load_lora_state(perturbed(base, scale=0.02))
        engine.update_weights(policy.lora_state(), 1)  # verify_weights: every tensor and the module checksum
        assert engine.server_checksum() == engine.expected_checksum() != lora_engine.expected_checksum()
        prompts, groups, seeds = batch()
        mask = np.zeros((4, 4), dtype=bool)
        mask[:, :3] = True
        traj = engine.generate(prompts, groups, seeds, spec(), mask)
        diff, pairs = FlowGRPOObjective(cfg, policy).recompute_log_prob_diff(traj)
        assert pairs == 12 and diff <= 1e-5, f"log_prob_mean_abs_diff {diff:.3e}"
        print(f"full fine-tune through SGLang: log_prob_mean_abs_diff={diff:.3e} over {pairs} pairs")
        partial = dict(list(policy.lora_state().items())[1:])
        with pytest.raises(KeyError, match="1 missing"):
            engine.update_weights(partial, 2)
        assert engine.version == 1
    finally:
        engine.update_weights(base, 0)
        engine.close()
        lora_engine.update_weights(lora_policy.lora_state(), 0)
    assert lora_engine.server.healthy() and lora_engine.server_checksum() == lora_engine.expected_checksum()


# -- training with the SGLang engine ---------------------------------------------------------------


# TINY_OVERRIDES (2 steps, 32 px, 4 denoising steps) with one group of 4 and one SDE step, no KL
# term (a third fewer forwards): the engine is under test here, not the objective.
SGLANG_TRAIN = ["train.prompts_per_step=1", "sampling.num_sde_steps=1", "algorithm.kl_beta=0"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from diffusionrl.train import train

    if not sglang_available():
        pytest.skip("no SGLang environment (.venv-sglang): run `make sglang-env` (make test does)")
    cfg = tiny_config(*SGLANG_TRAIN, SLOW_START, preset="tiny-cpu-sglang")
    out = tmp_path_factory.mktemp("sglang-train")
    return cfg, train(cfg, out, resume=None, progress=False)


@requires_sglang
def test_training_run_with_sglang_engine(trained):
    _, result = trained
    assert result.steps_done == 2 and len(result.metrics) == 2
    for m in result.metrics:
        assert math.isfinite(m["train/loss"])
        assert m["train/log_prob_mean_abs_diff"] <= 1e-5
        assert m["perf/update_weights_time"] > 0
    assert [m["policy_version"] for m in result.metrics] == [1.0, 2.0]
    assert (result.model_dir / "adapter_model.safetensors").is_file()


class KillServerMidRollout(Callback):
    """After step 1, kill the server (SIGKILL, no cleanup) once step 2's rollout has started."""

    def __init__(self):
        self.killed_pid = None
        self.engine = None

    def on_step(self, loop, step, traj, metrics):
        if step != 1:
            return
        engine = self.engine = loop.backend.worker.engine
        start = engine.requests_started
        pid = engine.server.pid

        def kill():
            deadline = time.monotonic() + 60
            while engine.requests_started == start and time.monotonic() < deadline:
                time.sleep(0.005)
            os.kill(pid, signal.SIGKILL)
            self.killed_pid = pid

        threading.Thread(target=kill, daemon=True).start()


@requires_sglang
def test_server_killed_mid_run_is_survived(stack, trained, tmp_path):
    """Restart + retry: no step is lost and the run equals the uninterrupted one. (This run's
    engine attaches to the module's server, which saves a server start.)"""
    from diffusionrl.train import train

    _, _, _, shared = stack
    cfg, full = trained

    def make_engine(cfg, adapter, policy):
        return SGLangRolloutEngine(adapter, policy.model, micro_batch_size=cfg.train.micro_batch_size,
                                   verify_weights=True, server=shared.server)

    killer = KillServerMidRollout()
    result = train(cfg, tmp_path / "killed", resume=None, progress=False, callbacks=[killer],
                   engine_factory=make_engine)
    assert killer.killed_pid is not None and killer.engine.restarts == 1
    assert result.steps_done == 2 and [m["step"] for m in result.metrics] == [1.0, 2.0]
    for a, b in zip(full.metrics, result.metrics):
        assert a["rollout/reward/raw_mean"] == b["rollout/reward/raw_mean"]
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-6, abs=1e-9)


# -- FLUX.1 (builtin:tiny-flux) through the same engine ------------------------------------------------


@contextlib.contextmanager
def pushed_perturbation(policy, engine):
    """The policy's LoRA perturbed and pushed to the server (weights verified), restored and pushed back after;
    yields a batch (prompts, groups, seeds) and an SDE mask on the first 3 of 4 steps."""
    original = policy.lora_state()
    policy.load_lora_state(perturbed(original))
    try:
        engine.update_weights(policy.lora_state(), 1)  # verify_weights: per-tensor and module checksums
        mask = np.zeros((4, 4), dtype=bool)
        mask[:, :3] = True
        yield (*batch(), mask)
    finally:
        policy.load_lora_state(original)
        engine.update_weights(original, 0)


@pytest.fixture(scope="module")
def flux_stack(servers):
    """tiny-cpu-flux served by SGLang's native FLUX.1 pipeline."""
    return servers["flux"]


@requires_sglang
def test_flux_is_served_with_a_pushed_lora_and_recomputed_exactly(flux_stack):
    """Packed latent tokens come back as spatial latents, the server's embedded guidance is the
    spec's, pushed weights verify (names match SGLang's FLUX module), and our trainer recomputes
    the server's log-probs (measured: 6e-8)."""
    cfg, adapter, policy, engine = flux_stack
    with pushed_perturbation(policy, engine) as (prompts, groups, seeds, mask):
        flux_spec = spec(guidance_scale=3.5)
        traj = engine.generate(prompts, groups, seeds, flux_spec, mask)
        assert traj.latents.shape == (4, 5, 16, 4, 4) and traj.conditioning.negative_prompt_embeds is None
        ours = adapter.encode_prompts(prompts, None, cfg.model.max_sequence_length)  # T5 at the local length
        torch.testing.assert_close(traj.conditioning.prompt_embeds, ours.prompt_embeds, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(traj.conditioning.pooled_embeds, ours.pooled_embeds, rtol=1e-5, atol=1e-5)
        sigmas, _ = adapter.schedule(4, 32)  # the resolution-dependent shift, as the server computes it
        torch.testing.assert_close(traj.sigmas, sigmas, rtol=0, atol=1e-6)
        diff, pairs = FlowGRPOObjective(cfg, policy).recompute_log_prob_diff(traj)
        assert pairs == 12 and diff <= 1e-5, f"log_prob_mean_abs_diff {diff:.3e}"
        with pytest.raises(Exception, match="embedded guidance 3.5"):
            engine.generate(prompts, groups, seeds, spec(guidance_scale=2.0), mask)


# FLUX.2 presets served: [dev] at its preset's text length, [klein] base at the 512 tokens SGLang fixes
@pytest.fixture(scope="module", params=["flux2", "flux2-klein"])
def flux2_stack(request, servers):
    """A FLUX.2 preset served by SGLang's native FLUX.2 pipeline ([dev], and [klein] at SGLang's fixed text length)."""
    return servers[request.param]


@requires_sglang
def test_flux2_is_served_with_a_pushed_lora_and_recomputed_exactly(flux2_stack):
    """FLUX.2 through SGLang's native pipelines: the 128-channel latent tokens come back as our spatial latents,
    the text at the local length ([dev]: ours, not SGLang's 512; [klein]: SGLang's 512, which the preset is set
    to) equals the local encoding, no pooled embedding; [dev]'s embedded guidance (which SGLang's FLUX.2 pipeline
    reports as the scale itself) is the spec's, [klein] base samples with a CFG pass against ""; pushed weights
    verify by name against SGLang's FLUX.2 module, and our trainer recomputes the server's log-probs."""
    cfg, adapter, policy, engine = flux2_stack
    cfg_pass = adapter.needs_negative(cfg.sampling.guidance_scale)
    assert cfg_pass == (adapter.family == "flux2-klein")
    with pushed_perturbation(policy, engine) as (prompts, groups, seeds, mask):
        served_spec = spec(guidance_scale=cfg.sampling.guidance_scale, negative_prompt=cfg.sampling.negative_prompt,
                           max_sequence_length=cfg.model.max_sequence_length)
        traj = engine.generate(prompts, groups, seeds, served_spec, mask)
        assert traj.latents.shape == (4, 5, *adapter.latent_shape(32))
        assert traj.conditioning.pooled_embeds.shape == (4, 0)
        negative = served_spec.negative_prompt if cfg_pass else None
        ours = adapter.encode_prompts(prompts, negative, cfg.model.max_sequence_length)
        assert traj.conditioning.prompt_embeds.shape == ours.prompt_embeds.shape
        torch.testing.assert_close(traj.conditioning.prompt_embeds, ours.prompt_embeds, rtol=1e-5, atol=1e-5)
        if cfg_pass:
            torch.testing.assert_close(traj.conditioning.negative_prompt_embeds, ours.negative_prompt_embeds,
                                       rtol=1e-5, atol=1e-5)
        else:
            assert traj.conditioning.negative_prompt_embeds is None
        sigmas, _ = adapter.schedule(4, 32)  # its empirical mu of the token count and steps, as the server's
        torch.testing.assert_close(traj.sigmas, sigmas, rtol=0, atol=1e-6)
        diff, pairs = FlowGRPOObjective(cfg, policy).recompute_log_prob_diff(traj)
        print(f"{adapter.family} served: recompute log_prob_mean_abs_diff {diff:.3g} over {pairs} pairs")
        assert pairs == 12 and diff <= 1e-5, f"log_prob_mean_abs_diff {diff:.3e}"
        if not cfg_pass:
            with pytest.raises(Exception, match=f"embedded guidance {cfg.sampling.guidance_scale:g}"):
                engine.generate(prompts, groups, seeds, spec(guidance_scale=2.0), mask)
