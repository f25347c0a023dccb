"""library.losses / library.noise / FLUX weighting against kohya-ss/sd-scripts' formulas (written out here
element by element), on tiny tensors, plus their wiring into the training step's loss (library.run.trainer.Trainer.loss)."""
from __future__ import annotations

import argparse
import math
import random

import pytest
import torch
import train_network

from library import flux_train_utils, losses, noise, train_util
from library.objectives import flow_matching
from library.network_trainer import setup_parser
from library.objectives.ddpm import DDPM
from library.train_util import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")


def ns(**kw):
    """Default args of the LoRA parser, overridden by kw."""
    args = setup_parser().parse_args([])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def ddpm():
    return noise.prepare_noise_scheduler(train_util.noise_scheduler_for("epsilon"))


# ------------------------------------------------------------------------------------------------------------
# loss types and Huber schedules


def test_loss_types_match_formulas():
    torch.manual_seed(0)
    pred, target = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    c = torch.tensor([0.1, 0.5])
    d = pred - target
    assert torch.equal(losses.conditional_loss(pred, target, "l2"), d ** 2)
    assert torch.allclose(losses.conditional_loss(pred, target, "l1"), d.abs())
    for i in range(2):
        ci = c[i].item()
        want_h = torch.tensor([2 * ci * (math.sqrt(x * x + ci * ci) - ci) for x in d[i].flatten().tolist()])
        want_s = torch.tensor([2 * (math.sqrt(x * x + ci * ci) - ci) for x in d[i].flatten().tolist()])
        assert torch.allclose(losses.conditional_loss(pred, target, "huber", c)[i].flatten(), want_h, atol=1e-6)
        assert torch.allclose(losses.conditional_loss(pred, target, "smooth_l1", c)[i].flatten(), want_s, atol=1e-6)
    huber = losses.conditional_loss(pred, target, "huber", c)
    assert not torch.allclose(huber, d ** 2)  # huber is not l2 on the same batch
    assert (huber <= d ** 2 + 1e-6).all()  # and never above it (2c(sqrt(d^2+c^2)-c) <= d^2)


@pytest.mark.parametrize("schedule", losses.HUBER_SCHEDULES)
def test_huber_threshold_schedules(schedule):
    sched = ddpm()
    t = torch.tensor([0, 250, 999])
    args = ns(loss_type="huber", huber_schedule=schedule, huber_c=0.2, huber_scale=1.5)
    got = losses.huber_threshold(args, t, 1000, sched.alphas_cumprod)
    want = []
    for ti in t.tolist():
        if schedule == "constant":
            want.append(0.2 * 1.5)
        elif schedule == "exponential":
            want.append(math.exp(-ti * (-math.log(0.2) / 1000)) * 1.5)
        else:  # snr: no --huber_scale (upstream)
            abar = sched.alphas_cumprod[ti].item()
            sigma = math.sqrt((1 - abar) / abar)
            want.append((1 - 0.2) / (1 + sigma) ** 2 + 0.2)
    assert torch.allclose(got.float(), torch.tensor(want), rtol=1e-5)
    assert losses.huber_threshold(ns(loss_type="l2"), t, 1000, sched.alphas_cumprod) is None


# ------------------------------------------------------------------------------------------------------------
# SNR weights


def test_snr_weights_match_formulas():
    sched = ddpm()
    t = torch.tensor([0, 10, 500, 999])
    abar = train_util.noise_scheduler_for("epsilon").alphas_cumprod[t].double()
    snr = abar / (1 - abar)
    capped = snr.clamp(max=1000)
    loss = torch.tensor([1.0, 2.0, 3.0, 4.0])

    def run(v=False, **kw):
        return losses.apply_snr_weights(loss, ns(**kw), t, sched, v).double()

    assert torch.allclose(run(min_snr_gamma=5.0), loss * snr.clamp(max=5) / snr, rtol=1e-5)
    assert torch.allclose(run(True, min_snr_gamma=5.0), loss * snr.clamp(max=5) / (snr + 1), rtol=1e-5)
    assert torch.allclose(run(scale_v_pred_loss_like_noise_pred=True), loss * capped / (capped + 1), rtol=1e-5)
    assert torch.allclose(run(v_pred_like_loss=0.3), loss + loss / (capped / (capped + 1)) * 0.3, rtol=1e-5)
    assert torch.allclose(run(debiased_estimation_loss=True), loss / capped.sqrt(), rtol=1e-5)
    assert torch.allclose(run(True, debiased_estimation_loss=True), loss / (capped + 1), rtol=1e-5)
    # upstream's order: min-SNR first, debiased last
    both = run(min_snr_gamma=5.0, debiased_estimation_loss=True)
    assert torch.allclose(both, loss * snr.clamp(max=5) / snr / capped.sqrt(), rtol=1e-5)
    assert torch.equal(losses.apply_snr_weights(loss, ns(), t, sched, False), loss)  # nothing on: untouched


def test_zero_terminal_snr_betas():
    plain = train_util.noise_scheduler_for("v_prediction")
    sched = noise.prepare_noise_scheduler(train_util.noise_scheduler_for("v_prediction"), zero_terminal_snr=True)
    root = plain.alphas_cumprod.double().sqrt()
    want = (root - root[-1]) * root[0] / (root[0] - root[-1])  # shifted to 0 at T, first value kept
    assert torch.allclose(sched.alphas_cumprod.double().sqrt(), want, atol=1e-6)
    assert sched.alphas_cumprod[-1].item() == pytest.approx(0.0, abs=1e-12)
    assert torch.allclose(sched.alphas, 1 - sched.betas) and torch.allclose(sched.alphas_cumprod,
                                                                         torch.cumprod(sched.alphas, 0))
    # the loss weights keep the SNR of the original schedule (upstream computes all_snr before the fix)
    assert torch.allclose(sched.all_snr, plain.alphas_cumprod / (1 - plain.alphas_cumprod))
    # add_noise uses the new schedule: the last timestep is pure noise
    x, eps = torch.randn(1, 4, 2, 2), torch.randn(1, 4, 2, 2)
    assert torch.allclose(sched.add_noise(x, eps, torch.tensor([999])), eps, atol=1e-5)


# ------------------------------------------------------------------------------------------------------------
# noise


def test_offset_random_strength_and_adaptive_scale():
    latents = torch.zeros(2, 3, 4, 4)
    latents[:, 1] = 2.0  # channel means: 0, 2, 0
    base = torch.randn(2, 3, 4, 4)
    g = torch.Generator().manual_seed(3)
    g2 = torch.Generator().manual_seed(3)
    got = noise.offset_noise(ns(noise_offset=0.1, adaptive_noise_scale=0.5), latents, base, g)
    offset = 0.1 + 0.5 * latents.mean(dim=(2, 3), keepdim=True).abs()  # [B, C, 1, 1]
    assert torch.allclose(got, base + offset * torch.randn(2, 3, 1, 1, generator=g2))
    # a negative adaptive scale cannot make the offset negative
    clamped = noise.offset_noise(ns(noise_offset=0.1, adaptive_noise_scale=-1.0), latents, base, g)
    assert torch.allclose(clamped[:, 1], base[:, 1])
    # random strength: offset = rand * noise_offset, drawn before the offset noise
    g.manual_seed(5)
    g2.manual_seed(5)
    got = noise.offset_noise(ns(noise_offset=0.1, noise_offset_random_strength=True), latents, base, g)
    strength = torch.rand(1, generator=g2) * 0.1
    assert torch.allclose(got, base + strength * torch.randn(2, 3, 1, 1, generator=g2))
    assert noise.offset_noise(ns(), latents, base, g) is base


def test_multires_noise_changes_statistics():
    random.seed(0)  # the level sizes (r ~ U[2, 4)) come from Python's random, as upstream
    g = torch.Generator().manual_seed(0)
    white = torch.randn(4, 4, 64, 64, generator=g)
    pyr = noise.pyramid_noise(white, iterations=6, discount=0.8, generator=g)
    assert pyr.std().item() == pytest.approx(1.0, abs=1e-5)  # rescaled to unit variance

    def neighbour_corr(x):
        a, b = x[..., :, :-1].flatten(), x[..., :, 1:].flatten()
        return torch.corrcoef(torch.stack([a, b]))[0, 1].item()

    assert abs(neighbour_corr(white)) < 0.05
    assert neighbour_corr(pyr) > 0.15  # low frequencies added: neighbouring pixels correlate
    # one iteration: level 0 is full-size white noise, out = (noise + randn) / std
    g.manual_seed(1)
    g2 = torch.Generator().manual_seed(1)
    one = noise.pyramid_noise(white, iterations=1, discount=0.3, generator=g)
    want = white + torch.randn(white.shape, generator=g2)
    assert torch.allclose(one, want / want.std())
    # make_noise applies it after the offset, and only when asked
    g.manual_seed(2)
    plain = noise.make_noise(ns(), white, g)
    g.manual_seed(2)
    assert torch.equal(noise.make_noise(ns(), white, g), plain)
    g.manual_seed(2)
    multi = noise.make_noise(ns(multires_noise_iterations=4, multires_noise_discount=0.5), white, g)
    assert not torch.allclose(multi, plain) and multi.std().item() == pytest.approx(1.0, abs=1e-5)


def test_sample_timesteps():
    g = torch.Generator().manual_seed(0)
    t = noise.sample_timesteps(ns(min_timestep=100, max_timestep=200), 512, 1000, "cpu", g)
    assert t.min() >= 100 and t.max() < 200
    assert (noise.sample_timesteps(ns(min_timestep=300, max_timestep=300), 3, 1000, "cpu", g) == 300).all()
    assert (noise.sample_timesteps(ns(), 3, 1000, "cpu", g, fixed=400) == 400).all()


def _echo(noisy, timesteps):
    """The model returns its noisy input: what the objective fed the model can be checked."""
    return noisy


@pytest.mark.parametrize("random_strength", [False, True])
def test_ip_noise_gamma_perturbs_the_input_not_the_target(random_strength):
    sched = ddpm()
    latents = torch.randn(2, 4, 4, 4)
    args = ns(ip_noise_gamma=0.3, ip_noise_gamma_random_strength=random_strength)
    pred, target, t, _ = DDPM().noisy_input_pred_target(args, sched, latents, _echo, torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(7)  # the same draws, in upstream's order
    eps = torch.randn(latents.shape, generator=g)
    t_want = torch.randint(0, 1000, (2,), generator=g)
    gamma = torch.rand(1, generator=g) * 0.3 if random_strength else 0.3
    xi = torch.randn(latents.shape, generator=g)
    assert torch.equal(t, t_want) and torch.equal(target, eps)
    assert torch.allclose(pred, sched.add_noise(latents, eps + gamma * xi, t_want))


def test_default_noise_draws_are_unchanged():
    """With the new options off, the draws are randn then randint (what the loop computed before them)."""
    sched = ddpm()
    latents = torch.randn(2, 4, 4, 4)
    pred, target, t, _ = DDPM().noisy_input_pred_target(ns(noise_offset=0.05), sched, latents, _echo,
                                                        torch.Generator().manual_seed(11))
    g = torch.Generator().manual_seed(11)
    eps = torch.randn(latents.shape, generator=g)
    eps = eps + 0.05 * torch.randn((2, 4, 1, 1), generator=g)
    t_want = torch.randint(0, 1000, (2,), generator=g)
    assert torch.equal(target, eps) and torch.equal(t, t_want)
    assert torch.equal(pred, sched.add_noise(latents, eps, t_want))


# ------------------------------------------------------------------------------------------------------------
# the training step's loss uses them


@pytest.mark.parametrize("loss_type", ["l2", "l1", "huber", "smooth_l1"])
def test_training_loss_uses_the_loss_type(loss_type):
    torch.manual_seed(0)
    pred, target, t = torch.randn(2, 4, 4, 4), torch.randn(2, 4, 4, 4), torch.tensor([100, 900])
    sched = ddpm()
    args = ns(loss_type=loss_type, huber_schedule="exponential", min_snr_gamma=5.0)
    batch = {"latents": torch.zeros(2, 4, 4, 4), "te_outputs": {}, "loss_weights": torch.ones(2)}
    loss = train_network.trainer().loss(args, batch, sched, pred, target, t, None)
    c = losses.huber_threshold(args, t, 1000, sched.alphas_cumprod)
    per_sample = losses.conditional_loss(pred, target, loss_type, c).mean(dim=(1, 2, 3))
    snr = sched.all_snr[t]
    want = (per_sample * snr.clamp(max=5) / snr).mean()
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    l2 = ((pred - target) ** 2).mean(dim=(1, 2, 3)) * snr.clamp(max=5) / snr
    assert (loss.item() == pytest.approx(l2.mean().item(), rel=1e-5)) == (loss_type == "l2")


# ------------------------------------------------------------------------------------------------------------
# FLUX weighting schemes


def flux_args(**kw):
    base = dict(timestep_sampling="sigma", sigmoid_scale=1.0, discrete_flow_shift=3.0, weighting_scheme="uniform",
                logit_mean=0.0, logit_std=1.0, mode_scale=1.29, model_prediction_type="sigma_scaled",
                ip_noise_gamma=None, ip_noise_gamma_random_strength=False)
    base.update(kw)
    return argparse.Namespace(**base)


def test_flux_loss_weighting():
    s = torch.tensor([0.1, 0.5, 0.9])
    w = flow_matching.loss_weighting(flux_args(weighting_scheme="sigma_sqrt"), s)
    assert w.shape == (3, 1, 1, 1) and torch.allclose(w.flatten(), 1 / s ** 2)
    w = flow_matching.loss_weighting(flux_args(weighting_scheme="cosmap"), s).flatten()
    assert torch.allclose(w, torch.tensor([2 / (math.pi * (1 - 2 * x + 2 * x * x)) for x in s.tolist()]))
    for scheme in ("none", "uniform", "logit_normal", "mode"):
        assert flow_matching.loss_weighting(flux_args(weighting_scheme=scheme), s) is None
    # upstream weights only the sigma_scaled prediction
    assert flow_matching.loss_weighting(flux_args(weighting_scheme="sigma_sqrt", model_prediction_type="raw"),
                                           s) is None


def test_flux_timestep_density():
    torch.manual_seed(0)
    u = flow_matching.timestep_density(flux_args(weighting_scheme="logit_normal", logit_mean=0.5,
                                                    logit_std=0.7), 20000, "cpu")
    logit = torch.log(u / (1 - u))
    assert logit.mean().item() == pytest.approx(0.5, abs=0.03) and logit.std().item() == pytest.approx(0.7,
                                                                                                       abs=0.03)
    torch.manual_seed(1)
    u = flow_matching.timestep_density(flux_args(weighting_scheme="mode", mode_scale=1.29), 5, "cpu")
    torch.manual_seed(1)
    r = torch.rand(5)
    assert torch.allclose(u, 1 - r - 1.29 * (torch.cos(math.pi * r / 2) ** 2 - 1 + r))
    # sigma sampling with logit_normal: index = u * 1000 into the descending shifted schedule
    args = flux_args(weighting_scheme="logit_normal")
    torch.manual_seed(2)
    s = flow_matching.sample_sigmas(args, 6, 8, 8, "cpu")
    torch.manual_seed(2)
    u = flow_matching.timestep_density(args, 6, "cpu")
    t = (1000 - (u * 1000).long()).float() / 1000
    assert torch.allclose(s, 3 * t / (1 + 2 * t))


def test_flux_ip_noise_and_fixed_timestep():
    from library import flux_tiny

    tr = flux_tiny.tiny_transformer(128, 1, 1, 32, 64, True)
    latents = torch.randn(1, 16, 4, 4)
    te = {"t5_out": torch.randn(1, 8, 32), "pooled": torch.randn(1, 64)}
    import contextlib

    args = flux_args(guidance_scale=3.5, apply_t5_attn_mask=False, model_prediction_type="raw")
    def predict(noisy, sigmas):
        return flux_train_utils.flux_forward(tr, noisy, sigmas, te, 3.5, torch.float32)

    objective = flow_matching.FlowMatching()
    with torch.no_grad():
        pred, target, sigmas, w = objective.noisy_input_pred_target(args, None, latents, predict,
                                                                    torch.Generator().manual_seed(0), 600)
        assert torch.equal(sigmas, torch.tensor([0.6])) and w is None
        args.ip_noise_gamma = 0.5
        pred2, target2, _, _ = objective.noisy_input_pred_target(args, None, latents, predict,
                                                                 torch.Generator().manual_seed(0), 600)
    assert torch.equal(target, target2)  # the target keeps the unperturbed noise
    assert not torch.allclose(pred, pred2)  # the input was perturbed


# ------------------------------------------------------------------------------------------------------------
# option checks and the prediction type


@pytest.mark.parametrize("kw, flow, match", [
    ({"adaptive_noise_scale": 0.1}, False, "needs --noise_offset"),
    ({"scale_v_pred_loss_like_noise_pred": True}, False, "only with --v_parameterization"),
    ({"v_pred_like_loss": 0.1, "v_parameterization": True}, False, "cannot be used with --v_parameterization"),
    ({"loss_type": "huber", "huber_c": 0.0}, False, "--huber_c"),
    ({"loss_type": "huber"}, True, "--huber_schedule constant or exponential"),
    ({"min_timestep": 500, "max_timestep": 400}, False, "--min_timestep"),
])
def test_bad_combinations_named(kw, flow, match):
    with pytest.raises(ConfigError, match=match):
        trainer = train_network.trainer()
        trainer.objective = flow_matching.FlowMatching() if flow else trainer.objective
        trainer.check_objective_args(ns(**kw))


def test_flux_ignores_ddpm_only_options_with_a_warning(caplog):
    trainer = train_network.trainer()
    trainer.objective = flow_matching.FlowMatching()
    trainer.check_objective_args(ns(min_snr_gamma=5.0, noise_offset=0.1, multires_noise_iterations=6))
    assert "--min_snr_gamma" in caplog.text and "--noise_offset" in caplog.text and "no effect on FLUX" in caplog.text


def test_v_prediction_model_trains_and_reports_v():
    """A model whose scheduler config says v_prediction trains v and every metadata reader sees it."""
    import fine_tune

    args = ns(v2=True, resolution="64", output_name="m")
    args.training_comment = None
    comps = type("C", (), {"prediction_type": "v_prediction"})()
    trainer = fine_tune.trainer()  # SD1.x/2.x family, full target
    pt = trainer.family.prediction_type(args, comps)
    trainer.use_prediction_type(args, pt)
    assert trainer.objective.noise_scheduler(args, pt).config.prediction_type == "v_prediction"
    assert trainer.family.base_model_version(args) == "sd_v2_v"
    assert trainer.modelspec(args, pt)["modelspec.prediction_type"] == "v"
    assert trainer.modelspec(args, pt)["modelspec.architecture"] == "stable-diffusion-v2-768-v"


def test_flux_huber_threshold_uses_sigma_times_1000():
    """Upstream's FLUX timesteps are sigma * 1000: the exponential threshold is c^sigma * scale."""
    sigmas = torch.tensor([0.1, 0.5, 1.0])
    args = ns(loss_type="huber", huber_schedule="exponential", huber_c=0.2, huber_scale=2.0)
    got = flow_matching.FlowMatching().huber_threshold(args, sigmas, None)
    assert torch.allclose(got, 0.2 ** sigmas * 2.0, rtol=1e-5)


def test_diffusers_folder_with_v_prediction_scheduler_trains_v_and_parity_says_so(tmp_path, tiny_sd1_diffusers):
    """Issue 24 bug 5: upstream trains such a folder as epsilon unless --v_parameterization; we train it as
    v-prediction (a v-model trained on epsilon targets is wrecked), and docs/PARITY.md says so."""
    import json
    import shutil
    from pathlib import Path

    from library import parity
    from library.model_util import load_sd_components

    folder = tmp_path / "v_model"
    shutil.copytree(tiny_sd1_diffusers, folder)
    config = folder / "scheduler" / "scheduler_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "prediction_type": "v_prediction"}))
    tokenizers = Path(tiny_sd1_diffusers).parent / "tokenizers"
    comps = load_sd_components(str(folder), "sd1", tokenizer_cache_dir=str(tokenizers))
    assert comps.prediction_type == "v_prediction"
    trainer = train_network.trainer()
    args = ns(v_parameterization=False, v_pred_like_loss=None)
    trainer.use_prediction_type(args, trainer.family.prediction_type(args, comps))
    assert args.v_parameterization is True
    reason = parity.DIFFERENT["v_parameterization"].reason
    assert "v_prediction" in reason and "upstream trains it as epsilon" in reason
    docs = (Path(__file__).resolve().parents[1] / "docs" / "PARITY.md").read_text(encoding="utf-8")
    assert f"| `--v_parameterization` | different | {reason} |" in docs
