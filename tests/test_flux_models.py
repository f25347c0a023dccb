"""FLUX.1 model files, LoRA format and block swap, on tiny models built here (CPU, offline).

- BFL single files (bf16, fp8-e4m3, dev and schnell; CLIP-L with and without `text_model.`) load into the same
  weights as the diffusers folder; our diffusers -> BFL mapping round-trips and diffusers' from_single_file reads it.
- The kohya FLUX LoRA (width 3072, as diffusers' converter assumes) loads in FluxPipeline.load_lora_weights with
  no key left over, computes what our network computes, and changes the image.
- Block swap keeps at most n - k blocks resident, every block is on the device when it runs forward or backward,
  and loss and LoRA gradients equal the run without swapping (eager and compiled with aot_eager).
"""
from __future__ import annotations

import argparse
import logging

import pytest
import torch

from library import block_swap, flux_models, flux_tiny, flux_train_utils
from library.compile import options as compile_options, regional
from library.objectives import flow_matching
from networks import lora_flux


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="session")
def tiny_flux(tmp_path_factory):
    """Tiny FLUX.1-dev set: BFL single files + tokenizers + the same weights as a diffusers folder."""
    return flux_tiny.make_tiny_flux(tmp_path_factory.mktemp("tiny_flux"), diffusers_folder=True)


def _state(m):
    return {k: v.float() for k, v in m.state_dict().items()}


def _same(a, b):
    sa, sb = _state(a), _state(b)
    assert set(sa) == set(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_single_files_and_diffusers_folder_load_the_same_weights(tiny_flux):
    single = flux_models.load_flux_components(tiny_flux["transformer"], tiny_flux["clip_l"], tiny_flux["t5xxl"],
                                              tiny_flux["ae"], dtype=torch.float32,
                                              tokenizer_cache_dir=tiny_flux["tokenizer_cache_dir"])
    folder = flux_models.load_flux_components(tiny_flux["diffusers"], dtype=torch.float32)
    for a, b in ((single.transformer, folder.transformer), (single.clip_l, folder.clip_l),
                 (single.t5xxl, folder.t5xxl), (single.ae, folder.ae)):
        _same(a, b)
    assert not single.is_schnell
    assert single.ae.config.latent_channels == 16
    assert single.ae.config.scaling_factor == pytest.approx(0.3611)
    assert single.ae.config.shift_factor == pytest.approx(0.1159)
    assert single.transformer.config.num_attention_heads == 1  # width 128 / 128
    # the pooled CLIP output uses the tokenizer's EOS
    assert single.clip_l.config.eos_token_id == single.clip_tokenizer.eos_token_id


def test_bfl_round_trip(tiny_flux, tmp_path):
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import load_file

    bfl = load_file(tiny_flux["transformer"])
    assert "double_blocks.0.img_attn.qkv.weight" in bfl and "single_blocks.0.linear1.weight" in bfl
    back = flux_models.diffusers_to_bfl(flux_models.bfl_to_diffusers(bfl))
    assert set(back) == set(bfl)
    assert all(torch.equal(back[k], bfl[k]) for k in bfl)

    model = flux_models.load_flux_transformer(tiny_flux["transformer"], dtype=torch.float32)
    # the parts of a fused BFL weight get their own storage (an in-place step of one must not touch the others)
    attn = model.single_transformer_blocks[0].attn
    ptrs = {p.untyped_storage().data_ptr() for p in (attn.to_q.weight, attn.to_k.weight, attn.to_v.weight,
                                                     model.single_transformer_blocks[0].proj_mlp.weight)}
    assert len(ptrs) == 4
    out = tmp_path / "saved.safetensors"
    flux_models.save_flux_transformer_bfl(model, out)
    ref = FluxTransformer2DModel.from_pretrained(tiny_flux["diffusers"], subfolder="transformer")
    _same(flux_models.load_flux_transformer(str(out), dtype=torch.float32), ref)
    # (diffusers' own single-file loader needs FLUX's width 3072: checked in the LoRA test's wide model)


def test_fp8_schnell_and_unprefixed_clip(tmp_path):
    paths = flux_tiny.make_tiny_flux(tmp_path, guidance=False, transformer_dtype=torch.float8_e4m3fn,
                                     clip_prefix=False)
    c = flux_models.load_flux_components(paths["transformer"], paths["clip_l"], paths["t5xxl"], paths["ae"],
                                         dtype=torch.bfloat16, fp8_base=True,
                                         tokenizer_cache_dir=paths["tokenizer_cache_dir"])
    assert c.is_schnell and not c.transformer.config.guidance_embeds
    lin = c.transformer.single_transformer_blocks[0].proj_out
    assert lin.weight.dtype == torch.float8_e4m3fn
    # fp8 base computes what the upcast weights compute
    x = torch.randn(2, lin.in_features, dtype=torch.bfloat16, requires_grad=True)
    ref = torch.nn.functional.linear(x, lin.weight.to(torch.bfloat16), lin.bias.to(torch.bfloat16))
    (ref_grad,) = torch.autograd.grad(ref.float().pow(2).sum(), x)
    y = lin(x)
    assert torch.equal(y, ref)
    (grad,) = torch.autograd.grad(y.float().pow(2).sum(), x)
    assert torch.allclose(grad.float(), ref_grad.float(), rtol=1e-2, atol=1e-2)
    # schnell has no guidance input; the fp8 base runs end to end
    latents, te, sigma = _inputs(c.transformer, torch.bfloat16)
    with torch.no_grad():
        out = flux_train_utils.flux_forward(c.transformer, latents, sigma, te, 3.5, torch.bfloat16)
    assert out.shape == latents.shape and torch.isfinite(out).all()
    # without --fp8_base the fp8 file is upcast
    t = flux_models.load_flux_transformer(paths["transformer"], dtype=torch.bfloat16)
    assert t.single_transformer_blocks[0].proj_out.weight.dtype == torch.bfloat16
    assert torch.equal(t.single_transformer_blocks[0].proj_out.weight, lin.weight.to(torch.bfloat16))


def test_clear_errors(tiny_flux, tmp_path, monkeypatch):
    with pytest.raises(flux_models.FluxModelError, match="--clip_l, --t5xxl, --ae required"):
        flux_models.load_flux_components(tiny_flux["transformer"], tokenizer_cache_dir=tiny_flux["tokenizer_cache_dir"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(flux_models.FluxModelError, match="tokenizer_cache_dir"):
        flux_models.load_tokenizers(None, str(tmp_path))
    with pytest.raises(flux_models.FluxModelError, match="not a FLUX.1 transformer"):
        flux_models.load_flux_transformer(tiny_flux["clip_l"])
    with pytest.raises(flux_models.FluxModelError, match="file not found"):
        flux_models.load_ae(str(tmp_path / "nope.safetensors"))


# ---------------------------------------------------------------------------------------------------------------
# LoRA


def _randomize_lora(network, seed=0, std=0.02):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in network.named_parameters():
            if "lora_up" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def _inputs(transformer, dtype, h=4, w=4, txt=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = transformer.config
    latents = torch.randn(1, 16, h, w, generator=g).to(dtype)
    te = {"t5_out": torch.randn(1, txt, cfg.joint_attention_dim, generator=g).to(dtype),
          "pooled": torch.randn(1, cfg.pooled_projection_dim, generator=g).to(dtype)}
    return latents, te, torch.tensor([0.6])


@pytest.mark.slow
def test_lora_loads_in_diffusers_flux_pipeline(tiny_flux, tmp_path):
    """Width 3072 (diffusers' converter assumes it for single_blocks.linear1), one double + one single block."""
    from diffusers import FluxPipeline
    from peft.tuners.lora import LoraLayer
    from safetensors import safe_open

    dtype = torch.bfloat16
    base = FluxPipeline.from_pretrained(tiny_flux["diffusers"], torch_dtype=dtype)
    wide = flux_tiny.tiny_transformer(3072, 1, 1, base.text_encoder_2.config.d_model,
                                      base.text_encoder.config.hidden_size, True, seed=0, dtype=dtype)
    pipe = FluxPipeline(scheduler=base.scheduler, vae=base.vae, text_encoder=base.text_encoder,
                        tokenizer=base.tokenizer, text_encoder_2=base.text_encoder_2, tokenizer_2=base.tokenizer_2,
                        transformer=wide)

    def image():
        return pipe("a red circle", height=16, width=16, num_inference_steps=1, guidance_scale=3.5,
                    generator=torch.Generator().manual_seed(1), output_type="pt", max_sequence_length=8).images

    # our BFL writer (fp8 to halve the file), read back by diffusers' single-file loader (local config, offline)
    wide_file = tmp_path / "wide_bfl.safetensors"
    flux_models.save_flux_transformer_bfl(wide, wide_file, dtype=torch.float8_e4m3fn)
    config_dir = tmp_path / "wide_config"
    wide.save_config(str(config_dir))
    from diffusers import FluxTransformer2DModel

    theirs = FluxTransformer2DModel.from_single_file(str(wide_file), config=str(config_dir), torch_dtype=dtype)
    got, ours = theirs.state_dict(), wide.state_dict()
    assert set(got) == set(ours) and all(got[k].shape == ours[k].shape for k in got)
    # every kind of mapping (split qkv, split linear1, swapped final modulation, embedders), value by value
    for k in ("transformer_blocks.0.attn.to_k.weight", "transformer_blocks.0.attn.add_v_proj.bias",
              "transformer_blocks.0.attn.norm_added_q.weight", "transformer_blocks.0.ff_context.net.2.weight",
              "single_transformer_blocks.0.attn.to_v.weight", "single_transformer_blocks.0.proj_mlp.bias",
              "single_transformer_blocks.0.proj_out.weight", "norm_out.linear.weight", "norm_out.linear.bias",
              "time_text_embed.guidance_embedder.linear_1.weight", "context_embedder.weight"):
        assert torch.equal(got[k], ours[k].to(torch.float8_e4m3fn).to(dtype)), k
    del theirs, got

    before = image()
    latents, te, sigma = _inputs(wide, dtype)
    with torch.no_grad():
        out_base = flux_train_utils.flux_forward(wide, latents, sigma, te, 3.5, dtype)

    torch.manual_seed(0)
    net = lora_flux.create_network(1.0, 4, 2.0, base.vae, [base.text_encoder, base.text_encoder_2], wide)
    net.apply_to([base.text_encoder], wide, True, True)
    _randomize_lora(net)
    with torch.no_grad():
        out_ours = flux_train_utils.flux_forward(wide, latents, sigma, te, 3.5, dtype)
    path = tmp_path / "wide_lora.safetensors"
    net.save_weights(str(path), torch.float32, {"ss_network_module": "networks.lora_flux"})
    net.remove_from()

    with safe_open(str(path), "pt") as f:
        keys = set(f.keys())
    assert {"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight",
            "lora_unet_double_blocks_0_txt_mlp_2.lora_up.weight",
            "lora_unet_single_blocks_0_linear1.lora_up.weight", "lora_unet_single_blocks_0_linear2.alpha",
            "lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight"} <= keys
    # modulation layers are trained by default, as in sd-scripts
    assert {"lora_unet_double_blocks_0_img_mod_lin.lora_down.weight", "lora_unet_double_blocks_0_txt_mod_lin.alpha",
            "lora_unet_single_blocks_0_modulation_lin.lora_up.weight"} <= keys

    records = []

    class Capture(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Capture(logging.WARNING)
    for name in ("diffusers", "peft"):
        logging.getLogger(name).addHandler(handler)
    try:
        pipe.load_lora_weights(str(path))
    finally:
        for name in ("diffusers", "peft"):
            logging.getLogger(name).removeHandler(handler)
    assert not [r for r in records if "key" in r.lower() or "unsupported" in r.lower()], records
    n_unet = sum(isinstance(m, LoraLayer) for m in pipe.transformer.modules())
    n_te = sum(isinstance(m, LoraLayer) for m in pipe.text_encoder.modules())
    # double block: 3 (qkv) + proj + 2 mlp + mod per stream; single block: 4 (linear1) + linear2 + modulation
    assert n_unet == 14 + 6 and n_te == 12
    with torch.no_grad():
        out_diffusers = flux_train_utils.flux_forward(pipe.transformer, latents, sigma, te, 3.5, dtype)
    assert not torch.allclose(out_ours, out_base, atol=1e-3)
    assert torch.allclose(out_diffusers.float(), out_ours.float(), atol=3e-2, rtol=3e-2)
    assert (image() - before).abs().max() > 0


def test_lora_train_blocks_and_bad_args(tiny_flux):
    t = flux_models.load_flux_transformer(tiny_flux["transformer"], dtype=torch.float32)
    single = lora_flux.create_network(1.0, 4, 1, None, None, t, train_blocks="single")
    assert single.unet_loras and all(m.lora_name.startswith("lora_unet_single_blocks_") for m in single.unet_loras)
    double = lora_flux.create_network(1.0, 4, 1, None, None, t, train_blocks="double")
    assert all(m.lora_name.startswith("lora_unet_double_blocks_") for m in double.unet_loras)
    with pytest.raises(lora_flux.NetworkArgsError, match="allowed: all, single, double"):
        lora_flux.create_network(1.0, 4, 1, None, None, t, train_blocks="middle")
    with pytest.raises(lora_flux.NetworkArgsError, match="allowed: train_blocks"):
        lora_flux.create_network(1.0, 4, 1, None, None, t, conv_dimm="4")


# ---------------------------------------------------------------------------------------------------------------
# block swap


def _swap_run(compiled: bool, swap: int, checkpointing: bool):
    torch.manual_seed(0)
    t = flux_tiny.tiny_transformer(128, 2, 2, 32, 64, True, seed=3)
    t.requires_grad_(False)
    torch.manual_seed(1)
    net = lora_flux.create_network(1.0, 4, 4, None, None, t)
    net.apply_to([], t, False, True)
    _randomize_lora(net, seed=2, std=0.05)
    swapper = None
    if checkpointing:
        t.enable_gradient_checkpointing()
        t.train()
    if swap:
        swapper = block_swap.place_with_block_swap(t, swap, "cpu", "cpu", record_events=True)
        seen = []

        def check(i):
            def hook(module, args):
                assert swapper.location[i] == "device", f"block {i} ran forward while offloaded"
                assert swapper.resident_swap_blocks() <= swapper.n - swapper.k + 1
                seen.append(i)
            return hook

        for i, b in enumerate(block_swap.flux_blocks(t)):
            b.register_forward_pre_hook(check(i))
    if compiled:
        p = argparse.ArgumentParser()
        compile_options.add_compile_arguments(p)
        args = p.parse_args(["--compile", "--compile_backend", "aot_eager"])
        regional.compile_model_blocks(t, args, model_name="FLUX", gradient_checkpointing=checkpointing,
                                           disable_linear=swap > 0)
    losses, grads = [], None
    for step in range(2):  # the second step starts from the placement the first one left
        net.zero_grad(set_to_none=True)
        latents, te, sigma = _inputs(t, torch.float32, seed=step)
        loss = flux_train_utils.flux_forward(t, latents, sigma, te, 3.5, torch.float32).pow(2).mean()
        loss.backward()
        losses.append(loss.detach())
        grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    return losses, grads, swapper


def _check_backward_residency(swapper):
    """Replaying the move log: every block is on the device when its backward starts."""
    loc = {}
    backward_seen = 0
    for what, i in swapper.events:
        if what in ("in", "out"):
            loc[i] = what
        elif what in ("forward", "backward", "recompute"):
            assert loc.get(i) == "in", f"block {i} used ({what}) while offloaded"
            backward_seen += what == "backward"
    return backward_seen


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_block_swap_same_loss_and_grads(compiled):
    ref_losses, ref_grads, _ = _swap_run(compiled=False, swap=0, checkpointing=compiled)
    losses, grads, swapper = _swap_run(compiled=compiled, swap=2, checkpointing=compiled)
    for a, b in zip(ref_losses, losses):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(ref_grads) and grads
    for k in grads:
        assert torch.allclose(grads[k], ref_grads[k], rtol=1e-4, atol=1e-6), k
    assert swapper.max_resident <= swapper.n - swapper.k  # 2 of 4 blocks on the device at most
    assert _check_backward_residency(swapper) == 2 * 4  # every block's backward, both steps
    moves = [e for e in swapper.events if e[0] in ("in", "out")]
    assert ("out", 0) in moves and ("in", 3) in moves  # the rotation really happened
    # after a full step the placement is back to the start: the first n - k blocks resident
    assert swapper.location == ["device", "device", "offload", "offload"]


def test_block_swap_bad_count():
    t = flux_tiny.tiny_transformer(128, 1, 1, 32, 64, True)
    t.requires_grad_(False)
    with pytest.raises(block_swap.BlockSwapError, match="between 1 and 1"):
        block_swap.place_with_block_swap(t, 2, "cpu")


# ---------------------------------------------------------------------------------------------------------------
# flow matching pieces


def test_packing_and_ids_match_diffusers():
    from diffusers import FluxPipeline

    x = torch.randn(2, 16, 6, 8)
    packed = flux_train_utils.pack_latents(x)
    assert torch.equal(packed, FluxPipeline._pack_latents(x, 2, 16, 6, 8))
    assert torch.equal(flux_train_utils.unpack_latents(packed, 6, 8), x)
    ids = flux_train_utils.image_ids(6, 8, "cpu", torch.float32)
    assert torch.equal(ids, FluxPipeline._prepare_latent_image_ids(2, 3, 4, "cpu", torch.float32))


@pytest.mark.parametrize("mode", flow_matching.TIMESTEP_SAMPLING)
def test_sigma_sampling(mode):
    args = argparse.Namespace(timestep_sampling=mode, sigmoid_scale=1.0, discrete_flow_shift=3.0)
    torch.manual_seed(0)
    s = flow_matching.sample_sigmas(args, 4096, 64, 64, "cpu")
    assert s.shape == (4096,) and s.min() > 0 and s.max() <= 1
    mean = {"uniform": 0.5, "sigmoid": 0.5}
    if mode in mean:
        assert abs(s.mean().item() - mean[mode]) < 0.03
    else:  # the shifted schedules push sigmas towards noise
        assert s.mean().item() > 0.6


def test_model_prediction_types():
    pred, noisy, sigmas = torch.randn(2, 16, 4, 4), torch.randn(2, 16, 4, 4), torch.tensor([0.25, 0.75])
    ns = argparse.Namespace
    assert torch.equal(flow_matching.apply_model_prediction_type(ns(model_prediction_type="raw"), pred, noisy,
                                                                    sigmas), pred)
    assert torch.equal(flow_matching.apply_model_prediction_type(ns(model_prediction_type="additive"), pred,
                                                                    noisy, sigmas), pred + noisy)
    out = flow_matching.apply_model_prediction_type(ns(model_prediction_type="sigma_scaled"), pred, noisy, sigmas)
    assert torch.allclose(out[1], noisy[1] - 0.75 * pred[1])


def test_t5_attention_mask_hides_padding():
    t = flux_tiny.tiny_transformer(128, 1, 1, 32, 64, True)
    latents, te, sigma = _inputs(t, torch.float32)
    te["t5_attn_mask"] = torch.tensor([[1, 1, 1, 0, 0, 0, 0, 0]])
    other = dict(te, t5_out=te["t5_out"].clone())
    other["t5_out"][:, 3:] += 10 * torch.randn(1, 5, 32)  # only the padding changes
    with torch.no_grad():
        a = flux_train_utils.flux_forward(t, latents, sigma, te, 3.5, torch.float32, apply_t5_attn_mask=True)
        b = flux_train_utils.flux_forward(t, latents, sigma, other, 3.5, torch.float32, apply_t5_attn_mask=True)
        c = flux_train_utils.flux_forward(t, latents, sigma, other, 3.5, torch.float32, apply_t5_attn_mask=False)
    assert torch.allclose(a, b, atol=1e-6) and not torch.allclose(a, c, atol=1e-4)


@pytest.mark.parametrize("guidance", [True, False], ids=["dev", "schnell"])
def test_real_flux_shapes_on_meta(guidance):
    """FLUX.1's real layout (19 double + 38 single blocks, width 3072) converts both ways and its config is read
    back exactly, without allocating a byte (meta tensors)."""
    from accelerate import init_empty_weights
    from diffusers import FluxTransformer2DModel

    with init_empty_weights():
        real = FluxTransformer2DModel(guidance_embeds=guidance)
    bfl = flux_models.diffusers_to_bfl(real.state_dict())
    assert bfl["single_blocks.37.linear1.weight"].shape == (3 * 3072 + 4 * 3072, 3072)
    assert bfl["double_blocks.18.img_attn.qkv.weight"].shape == (3 * 3072, 3072)
    assert ("guidance_in.in_layer.weight" in bfl) == guidance
    cfg = flux_models.infer_transformer_config(bfl)
    for k, v in cfg.items():
        expected = real.out_channels if k == "out_channels" else real.config[k]  # None there means in_channels
        assert (list(v) if isinstance(v, (list, tuple)) else v) == (list(expected) if isinstance(expected, (list, tuple)) else expected), k
    back = flux_models.bfl_to_diffusers({"model.diffusion_model." + k: v for k, v in bfl.items()})
    ref = real.state_dict()
    assert set(back) == set(ref) and all(back[k].shape == ref[k].shape for k in ref)
    if guidance:  # kohya's module set on the real model: 10 per double block, 3 per single block
        net = lora_flux.create_network(1.0, 2, 1, None, None, real)
        assert len(net.unet_loras) == 19 * 10 + 38 * 3
