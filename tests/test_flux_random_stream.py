"""FLUX.1 noise and timesteps come from the run's generator (saved with --save_state), as the SD trainers' do
(issue 24, bug 2): the draws follow that generator, and a resumed run continues the same random stream."""
from __future__ import annotations

import types

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.usefixtures("one_thread")


def flow_args(**kw):
    base = dict(timestep_sampling="sigmoid", sigmoid_scale=1.0, discrete_flow_shift=3.0, weighting_scheme="uniform",
                logit_mean=0.0, logit_std=1.0, mode_scale=1.29, model_prediction_type="raw", ip_noise_gamma=0.1,
                ip_noise_gamma_random_strength=False)
    return types.SimpleNamespace(**{**base, **kw})


def test_flow_matching_draws_from_the_run_generator_only():
    from library.objectives.flow_matching import FlowMatching

    latents = torch.randn(2, 4, 8, 8)
    seen = []

    def predict(noisy, sigmas):
        seen.append((noisy, sigmas))
        return noisy

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    pred, target, sigmas, _ = FlowMatching().noisy_input_pred_target(flow_args(), None, latents, predict, g)
    global_after = torch.rand(1)
    torch.manual_seed(0)
    assert torch.equal(global_after, torch.rand(1))  # the global generator was not drawn from
    want = torch.Generator().manual_seed(5)  # the same draws, in order: noise, sigmas, input perturbation
    eps = torch.randn(latents.shape, generator=want)
    s = torch.sigmoid(torch.randn(2, generator=want))
    xi = torch.randn(latents.shape, generator=want)
    assert torch.equal(target, eps - latents) and torch.equal(sigmas, s.clamp(1e-5, 1.0))
    sv = sigmas.view(-1, 1, 1, 1)
    assert torch.allclose(seen[0][0], (1 - sv) * latents + sv * (eps + 0.1 * xi))


@pytest.mark.slow
def test_flux_lora_resume_continues_the_random_stream(tmp_path):
    """4 steps in one go == 2 steps, --save_state, then --resume for steps 3-4. The save is in the middle of the
    epoch: the resumed run's dataloader skips the trained batches and draws from the global generator on the way
    (as torch's DataLoader does for each iterator), which must not change the noise and timesteps."""
    import flux_train_network
    from library import flux_tiny
    from library.tiny_models import make_captioned_images

    p = flux_tiny.make_tiny_flux(tmp_path / "models")
    data = make_captioned_images(tmp_path / "data", n=4, size=(32, 32), repeats=1, name="demo")

    def argv(name, extra):
        return [str(a) for a in [
            "--pretrained_model_name_or_path", p["transformer"], "--clip_l", p["clip_l"], "--t5xxl", p["t5xxl"],
            "--ae", p["ae"], "--tokenizer_cache_dir", p["tokenizer_cache_dir"], "--train_data_dir", data,
            "--output_dir", tmp_path / "out", "--output_name", name, "--network_module", "networks.lora_flux",
            "--network_dim", 4, "--network_alpha", 2, "--resolution", 32, "--max_train_steps", 4,
            "--learning_rate", 1e-2, "--t5xxl_max_token_length", 16, "--max_data_loader_n_workers", 0, "--seed", 3,
            "--network_train_unet_only", "--timestep_sampling", "sigmoid", *extra]]

    whole = flux_train_network.main(argv("whole", ["--save_every_n_steps", 2, "--save_state"]))
    state = tmp_path / "out" / "whole-step00000002-state"
    resumed = flux_train_network.main(argv("resumed", ["--resume", state]))
    a, b = load_file(whole), load_file(resumed)
    step2 = load_file(str(tmp_path / "out" / "whole-step00000002.safetensors"))
    assert any(not torch.equal(step2[k], a[k]) for k in a)  # steps 3-4 trained
    for k in a:
        assert torch.equal(a[k], b[k]), k
