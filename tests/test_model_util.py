"""library.model_util and library.tiny_models: single-file (SGM/LDM) and diffusers load/save, round trips,
diffusers' own loaders, --vae override, full-size layout checks on meta tensors, bad inputs."""
import json

import numpy as np
import pytest
import torch

from library import model_util as mu
from library import tiny_models as tm
from library.model_util import ModelLoadError, load_sd_components, save_sd_checkpoint, save_sd_diffusers


def _tok_dir(single_file):
    return single_file.parent / "tokenizers"


def _te_input(comps):
    return torch.tensor([comps.tokenizers[0]("a red circle", padding="max_length", max_length=77).input_ids])


@torch.no_grad()
def _unet_out(unet, family, seed=0):
    """UNet output for fixed random inputs (with SDXL's text_time conditioning)."""
    g = torch.Generator().manual_seed(seed)
    cfg = unet.config
    x = torch.randn(1, cfg.in_channels, 8, 8, generator=g)
    ctx = torch.randn(1, 77, cfg.cross_attention_dim, generator=g)
    kw = {}
    if family == "sdxl":
        pooled = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
        kw["added_cond_kwargs"] = {"text_embeds": torch.randn(1, pooled, generator=g),
                                   "time_ids": torch.tensor([[64.0, 64.0, 0.0, 0.0, 64.0, 64.0]])}
    return unet(x, torch.tensor([500]), encoder_hidden_states=ctx, **kw).sample


def _assert_same_output(a, b):
    # weights are compared bit for bit; outputs may differ in the last bits when tensors sit at differently
    # aligned addresses (the CPU kernels pick other code paths)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    diff = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not diff, diff[:5]


def _assert_same_components(c1, c2):
    _assert_same_weights(c1.unet, c2.unet)
    _assert_same_weights(c1.vae, c2.vae)
    assert len(c1.text_encoders) == len(c2.text_encoders)
    for t1, t2 in zip(c1.text_encoders, c2.text_encoders):
        assert mu.clip_state_dict(t1).keys() == mu.clip_state_dict(t2).keys()
        _assert_same_weights(t1, t2)
        ids = _te_input(c1)
        with torch.no_grad():
            o1, o2 = t1(ids, output_hidden_states=True), t2(ids, output_hidden_states=True)
        _assert_same_output(o1.hidden_states[-2], o2.hidden_states[-2])
    _assert_same_output(_unet_out(c1.unet, c1.family), _unet_out(c2.unet, c2.family))


# ---- shipped configs: exact parameter counts of the real models --------------------------------------------


@pytest.mark.parametrize("family,unet_params,te_params", [
    ("sd1", 859_520_964, [123_060_480]),
    ("sd2", 865_910_724, [340_387_840]),
    ("sdxl", 2_567_463_684, [123_060_480, 694_659_840]),
])
def test_shipped_configs_have_the_real_sizes(family, unet_params, te_params):
    from diffusers import AutoencoderKL, UNet2DConditionModel

    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(mu.load_arch_config(family, "unet"))
        vae = AutoencoderKL.from_config(mu.load_arch_config(family, "vae"))
        tes = [mu._clip_class(mu.load_arch_config(family, c))(mu._clip_config(mu.load_arch_config(family, c)))
               for c in mu._COMPONENTS[family][2:]]
    assert sum(p.numel() for p in unet.parameters()) == unet_params
    assert sum(p.numel() for p in vae.parameters()) == 83_653_863
    assert [sum(p.numel() for p in t.parameters()) for t in tes] == te_params
    sdxl = mu.load_arch_config("sdxl", "unet")
    assert sdxl["transformer_layers_per_block"] == [1, 2, 10] and sdxl["cross_attention_dim"] == 2048
    assert sdxl["projection_class_embeddings_input_dim"] == 2816 and sdxl["addition_embed_type"] == "text_time"


def test_load_arch_config_rejects_unknown_names():
    with pytest.raises(ValueError, match="allowed: sd1, sd2, sdxl"):
        mu.load_arch_config("sd3", "unet")
    with pytest.raises(ValueError, match="text_encoder_2"):
        mu.load_arch_config("sd1", "text_encoder_2")


# ---- full-size single-file layout, on meta tensors (no memory, no download) --------------------------------


def _meta_components(family):
    from diffusers import AutoencoderKL, UNet2DConditionModel

    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(mu.load_arch_config(family, "unet"))
        vae = AutoencoderKL.from_config(mu.load_arch_config(family, "vae"))
        tes = [mu._clip_class(mu.load_arch_config(family, c))(mu._clip_config(mu.load_arch_config(family, c)))
               for c in mu._COMPONENTS[family][2:]]
    return mu.SDComponents(family, unet, vae, tes, [], "epsilon", "")


def test_full_size_sdxl_sgm_layout():
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint, convert_ldm_vae_checkpoint

    comps = _meta_components("sdxl")
    sd = mu.components_to_ldm_state_dict(comps)
    # sd_xl_base_1.0.safetensors has 2515 keys: these 2513 plus te1 position_ids and te2 logit_scale
    assert len(sd) == 2513
    count = lambda p: sum(k.startswith(p) for k in sd)  # noqa: E731
    assert (count("model.diffusion_model."), count("first_stage_model."), count("conditioner.embedders.0."),
            count("conditioner.embedders.1.")) == (1680, 248, 196, 389)
    expected = {
        "model.diffusion_model.input_blocks.4.1.transformer_blocks.0.attn1.to_q.weight": (640, 640),
        "model.diffusion_model.input_blocks.7.1.transformer_blocks.9.attn2.to_k.weight": (1280, 2048),
        "model.diffusion_model.input_blocks.3.0.op.weight": (320, 320, 3, 3),
        "model.diffusion_model.output_blocks.2.2.conv.weight": (1280, 1280, 3, 3),
        "model.diffusion_model.output_blocks.8.0.skip_connection.weight": (320, 640, 1, 1),
        "model.diffusion_model.label_emb.0.0.weight": (1280, 2816),
        "model.diffusion_model.middle_block.1.transformer_blocks.9.ff.net.2.weight": (1280, 5120),
        "first_stage_model.encoder.mid.attn_1.q.weight": (512, 512, 1, 1),
        "first_stage_model.decoder.up.3.upsample.conv.weight": (512, 512, 3, 3),
        "conditioner.embedders.0.transformer.text_model.encoder.layers.11.mlp.fc2.weight": (768, 3072),
        "conditioner.embedders.1.model.transformer.resblocks.31.attn.in_proj_weight": (3840, 1280),
        "conditioner.embedders.1.model.text_projection": (1280, 1280),
        "conditioner.embedders.1.model.positional_embedding": (77, 1280),
    }
    for k, shape in expected.items():
        assert tuple(sd[k].shape) == shape, k
    # our shape inference gives back the shipped config, and diffusers' converter maps every key back
    cfg = mu.infer_unet_config("sdxl", mu._sub(sd, "model.diffusion_model."), pooled_dim=1280)
    assert cfg == mu.load_arch_config("sdxl", "unet")
    back = convert_ldm_unet_checkpoint(sd, cfg)
    usd = comps.unet.state_dict()
    assert set(back) == set(usd) and all(back[k].shape == usd[k].shape for k in usd)
    vae_back = convert_ldm_vae_checkpoint(sd, mu.infer_vae_config("sdxl", mu._sub(sd, "first_stage_model.")))
    assert set(vae_back) == set(comps.vae.state_dict())
    names = mu.unet_sgm_module_names(comps.unet)
    assert names["down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"] == "input_blocks.4.1.transformer_blocks.0.attn1.to_q"
    assert names["mid_block.attentions.0.transformer_blocks.9.ff.net.2"] == "middle_block.1.transformer_blocks.9.ff.net.2"
    assert names["up_blocks.0.attentions.2.proj_out"] == "output_blocks.2.1.proj_out"
    assert names["up_blocks.2.resnets.0.time_emb_proj"] == "output_blocks.6.0.emb_layers.1"


@pytest.mark.parametrize("family,n_keys,n_te", [("sd1", 1130, 196), ("sd2", 1227, 293)])
def test_full_size_sd_ldm_layout(family, n_keys, n_te):
    sd = mu.components_to_ldm_state_dict(_meta_components(family))
    assert len(sd) == n_keys  # the released files add text position_ids (SD1) / logit_scale (SD2)
    assert sum(k.startswith("model.diffusion_model.") for k in sd) == 686
    assert sum(k.startswith("cond_stage_model.") for k in sd) == n_te
    assert "model.diffusion_model.output_blocks.11.1.transformer_blocks.0.attn2.to_k.weight" in sd
    cfg = mu.infer_unet_config(family, mu._sub(sd, "model.diffusion_model."))
    ship = mu.load_arch_config(family, "unet")
    for k in ("block_out_channels", "attention_head_dim", "cross_attention_dim", "use_linear_projection",
              "down_block_types", "up_block_types", "layers_per_block"):
        assert cfg[k] == ship[k], k
    if family == "sd2":  # 24 open_clip layers in the file, the 24th is the one SD2 skips
        assert tuple(sd["cond_stage_model.model.transformer.resblocks.23.attn.in_proj_weight"].shape) == (3072, 1024)


# ---- tiny single files: round trips -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def sdxl_comps(tiny_sdxl_single_file):
    return load_sd_components(tiny_sdxl_single_file, "sdxl", tokenizer_cache_dir=_tok_dir(tiny_sdxl_single_file))


@pytest.fixture(scope="module")
def sd1_comps(tiny_sd1_single_file):
    return load_sd_components(tiny_sd1_single_file, "sd1", tokenizer_cache_dir=_tok_dir(tiny_sd1_single_file))


def test_tiny_sdxl_structure(sdxl_comps):
    c = sdxl_comps
    assert c.family == "sdxl" and c.prediction_type == "epsilon"
    assert [type(t).__name__ for t in c.text_encoders] == ["CLIPTextModel", "CLIPTextModelWithProjection"]
    assert c.unet.config.addition_embed_type == "text_time"
    assert c.unet.config.cross_attention_dim == sum(t.config.hidden_size for t in c.text_encoders)
    blocks = [n for n, m in c.unet.named_modules() if type(m).__name__ == "BasicTransformerBlock"]
    assert any(n.startswith("down_blocks") for n in blocks) and any(n.startswith("up_blocks") for n in blocks)
    assert any(n.startswith("mid_block") for n in blocks)
    assert c.tokenizers[1].pad_token == "!" and c.tokenizers[0].model_max_length == 77
    assert sum(p.numel() for p in c.unet.parameters()) < 5_000_000


@pytest.mark.parametrize("suffix", [".safetensors", ".ckpt"])
def test_sdxl_single_file_round_trip(sdxl_comps, tiny_sdxl_single_file, tmp_path, suffix):
    out = save_sd_checkpoint(tmp_path / f"saved{suffix}", sdxl_comps, metadata={"ss_note": "x"})
    again = load_sd_components(out, "sdxl", tokenizer_cache_dir=_tok_dir(tiny_sdxl_single_file))
    _assert_same_components(sdxl_comps, again)
    if suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(out), framework="pt") as f:
            assert f.metadata()["ss_note"] == "x"
            keys = set(f.keys())
        src = set(mu._read_keys(tiny_sdxl_single_file))
        assert keys == src  # the same SGM key set as the file we loaded
    assert not list(tmp_path.glob(".*tmp*"))


@pytest.mark.parametrize("suffix", [".safetensors", ".ckpt"])
def test_sd1_single_file_round_trip(sd1_comps, tiny_sd1_single_file, tmp_path, suffix):
    out = save_sd_checkpoint(tmp_path / f"saved{suffix}", sd1_comps)
    again = load_sd_components(out, "sd1", tokenizer_cache_dir=_tok_dir(tiny_sd1_single_file))
    _assert_same_components(sd1_comps, again)
    assert all(k.startswith(("model.diffusion_model.", "first_stage_model.", "cond_stage_model.transformer.text_model."))
               for k in mu._read_keys(out))


def test_sd2_v_round_trip_keeps_the_skipped_layer(tmp_path):
    path = tm.make_tiny_sd(tmp_path / "m", "sd2")
    toks = tmp_path / "m" / "tokenizers"
    c = load_sd_components(path, "sd2", tokenizer_cache_dir=toks, v_parameterization=True)
    assert c.prediction_type == "v_prediction"
    n = c.text_encoders[0].config.num_hidden_layers
    last = f"cond_stage_model.model.transformer.resblocks.{n}.attn.in_proj_weight"
    assert last in c.extra_state
    out = save_sd_checkpoint(tmp_path / "saved.safetensors", c, save_dtype=torch.float16)
    from safetensors.torch import load_file

    saved, src = load_file(str(out)), load_file(str(path))
    assert set(saved) == set(src) and all(v.dtype == torch.float16 for v in saved.values())
    assert torch.equal(saved[last], src[last].half())
    again = load_sd_components(out, "sd2", tokenizer_cache_dir=toks, dtype=torch.float16)
    assert again.unet.dtype == torch.float16 and again.text_encoders[0].dtype == torch.float16
    # diffusers' own single-file loader reads the SD2 (open_clip) layout we write
    from diffusers import StableDiffusionPipeline

    folder = tm.make_tiny_sd(tmp_path / "m", "sd2", "diffusers")
    resaved = save_sd_checkpoint(tmp_path / "fp32.safetensors", c)
    pipe = StableDiffusionPipeline.from_single_file(str(resaved), config=str(folder), local_files_only=True)
    _assert_same_weights(pipe.text_encoder, c.text_encoders[0])
    _assert_same_weights(pipe.unet, c.unet)
    assert pipe.scheduler.config.prediction_type == "v_prediction"


def test_save_strips_orig_mod_and_refuses_to_overwrite(sd1_comps, tmp_path, writes_fail_past):
    wrapped = mu.SDComponents(**{**sd1_comps.__dict__, "unet": torch.compile(sd1_comps.unet)})
    names = mu.unet_sgm_module_names(wrapped.unet)
    assert "_orig_mod" not in "".join(names) and names["down_blocks.0.attentions.0.proj_in"] == "input_blocks.1.1.proj_in"
    out = save_sd_checkpoint(tmp_path / "c.safetensors", wrapped)
    assert not [k for k in mu._read_keys(out) if "_orig_mod" in k]
    before = out.read_bytes()
    with pytest.raises(FileExistsError, match="already exists"):
        save_sd_checkpoint(out, sd1_comps)
    assert out.read_bytes() == before
    save_sd_checkpoint(out, sd1_comps, overwrite=True)
    with pytest.raises(ValueError, match=r"allowed: \.safetensors, \.ckpt"):
        save_sd_checkpoint(tmp_path / "c.bin", sd1_comps)
    from library.errors import SaveError

    before = out.read_bytes()
    with writes_fail_past(len(before) // 2), pytest.raises(SaveError, match=r"cannot save .*c\.safetensors: File too "
                                                                     "large; the earlier saves"):
        save_sd_checkpoint(out, sd1_comps, overwrite=True)  # the disk refuses it halfway
    assert out.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors"]
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        save_sd_checkpoint(tmp_path / "d.safetensors", sd1_comps, save_dtype="fp8")
    assert not (tmp_path / "d.safetensors").exists()


def test_loads_files_with_orig_mod_keys(sd1_comps, tiny_sd1_single_file, tmp_path):
    """Files saved from a torch.compile'd model by other tools carry "_orig_mod." in their keys."""
    from safetensors.torch import load_file, save_file

    sd = load_file(str(tiny_sd1_single_file))
    bad = {k.replace("model.diffusion_model.", "model.diffusion_model._orig_mod."): v for k, v in sd.items()}
    save_file(bad, str(tmp_path / "compiled.safetensors"))
    c = load_sd_components(tmp_path / "compiled.safetensors", "sd1", tokenizer_cache_dir=_tok_dir(tiny_sd1_single_file))
    _assert_same_weights(c.unet, sd1_comps.unet)


# ---- diffusers folders ------------------------------------------------------------------------------------


def test_diffusers_folder_loads_like_the_single_file(sdxl_comps, sd1_comps, tiny_sdxl_diffusers, tiny_sd1_diffusers):
    for comps, folder in ((sdxl_comps, tiny_sdxl_diffusers), (sd1_comps, tiny_sd1_diffusers)):
        c = load_sd_components(folder, comps.family)
        assert c.source == str(folder)
        _assert_same_components(comps, c)
        assert c.tokenizers[0].get_vocab() == comps.tokenizers[0].get_vocab()
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(str(tiny_sd1_diffusers), local_files_only=True)
    assert pipe.safety_checker is None
    _assert_same_weights(pipe.unet, sd1_comps.unet)
    _assert_same_weights(pipe.text_encoder, sd1_comps.text_encoders[0])


def test_saved_diffusers_folder_loads_in_diffusers_pipeline(sdxl_comps, tmp_path):
    from diffusers import StableDiffusionXLPipeline

    folder = save_sd_diffusers(tmp_path / "out", sdxl_comps)
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionXLPipeline"
    pipe = StableDiffusionXLPipeline.from_pretrained(str(folder), local_files_only=True)
    _assert_same_output(_unet_out(pipe.unet, "sdxl"), _unet_out(sdxl_comps.unet, "sdxl"))
    _assert_same_weights(pipe.text_encoder_2, sdxl_comps.text_encoders[1])
    image = pipe("a red circle", num_inference_steps=2, height=64, width=64, output_type="np",
                 generator=torch.Generator().manual_seed(0)).images[0]
    assert image.shape == (64, 64, 3) and np.isfinite(image).all()
    with pytest.raises(FileExistsError):
        save_sd_diffusers(folder, sdxl_comps)
    half = save_sd_diffusers(tmp_path / "half", sdxl_comps, save_dtype="fp16")
    c = load_sd_components(half, "sdxl")
    assert c.unet.dtype == torch.float32  # loaded in the requested dtype ...
    from safetensors import safe_open

    with safe_open(str(half / "unet" / "diffusion_pytorch_model.safetensors"), framework="pt") as f:
        assert f.get_tensor("conv_in.weight").dtype == torch.float16  # ... from fp16 files


def test_hub_id_is_downloaded_as_a_diffusers_folder(monkeypatch, sdxl_comps, tiny_sdxl_diffusers):
    """A hub id goes through snapshot_download (replaced here by the local tiny folder: no network in tests)."""
    import huggingface_hub

    calls = []

    def fake_snapshot_download(repo_id, allow_patterns=None, **kw):
        calls.append((repo_id, allow_patterns))
        return str(tiny_sdxl_diffusers)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.setattr(mu, "_offline", lambda: False)
    c = load_sd_components("someone/tiny-sdxl", "sdxl")
    assert calls[0][0] == "someone/tiny-sdxl" and "unet/diffusion_pytorch_model.safetensors" in calls[0][1]
    assert c.source == "someone/tiny-sdxl"
    _assert_same_weights(c.unet, sdxl_comps.unet)


# ---- diffusers' own single-file loader reads what we write ------------------------------------------------


def test_saved_sdxl_file_loads_in_diffusers_single_file_loader(sdxl_comps, tiny_sdxl_diffusers, tmp_path):
    from diffusers import StableDiffusionXLPipeline

    out = save_sd_checkpoint(tmp_path / "for_diffusers.safetensors", sdxl_comps)
    pipe = StableDiffusionXLPipeline.from_single_file(str(out), config=str(tiny_sdxl_diffusers), local_files_only=True)
    _assert_same_output(_unet_out(pipe.unet, "sdxl"), _unet_out(sdxl_comps.unet, "sdxl"))
    _assert_same_weights(pipe.vae, sdxl_comps.vae)
    _assert_same_weights(pipe.text_encoder, sdxl_comps.text_encoders[0])
    _assert_same_weights(pipe.text_encoder_2, sdxl_comps.text_encoders[1])


def test_saved_sd1_ckpt_loads_in_diffusers_unet_loader(sd1_comps, tiny_sd1_diffusers, tmp_path):
    from diffusers import UNet2DConditionModel

    out = save_sd_checkpoint(tmp_path / "for_diffusers.ckpt", sd1_comps)
    unet = UNet2DConditionModel.from_single_file(str(out), config=str(tiny_sd1_diffusers), subfolder="unet",
                                                 local_files_only=True)
    _assert_same_output(_unet_out(unet, "sd1"), _unet_out(sd1_comps.unet, "sd1"))


# ---- --vae override ---------------------------------------------------------------------------------------


def test_vae_override(tiny_sdxl_single_file, sdxl_comps, tmp_path):
    other = tm.build_tiny_components("sdxl", [_tok_dir(tiny_sdxl_single_file) / "tokenizer",
                                              _tok_dir(tiny_sdxl_single_file) / "tokenizer_2"], seed=1)
    from safetensors.torch import save_file

    ldm_file = tmp_path / "vae_ldm.safetensors"
    save_file({k: v.contiguous() for k, v in mu.vae_to_ldm_state_dict(other.vae).items()}, str(ldm_file))
    diffusers_file = tmp_path / "vae_diffusers.safetensors"
    save_file(other.vae.state_dict(), str(diffusers_file))
    folder = tmp_path / "vae_folder"
    other.vae.save_pretrained(str(folder))
    for vae in (ldm_file, diffusers_file, folder):
        c = load_sd_components(tiny_sdxl_single_file, "sdxl", vae=vae, tokenizer_cache_dir=_tok_dir(tiny_sdxl_single_file))
        _assert_same_weights(c.vae, other.vae)
        _assert_same_weights(c.unet, sdxl_comps.unet)
    with pytest.raises(ModelLoadError, match="no such file"):
        load_sd_components(tiny_sdxl_single_file, "sdxl", vae=tmp_path / "nope.safetensors",
                           tokenizer_cache_dir=_tok_dir(tiny_sdxl_single_file))


# ---- bad inputs -------------------------------------------------------------------------------------------


def test_bad_inputs_give_clear_errors(tiny_sdxl_single_file, tiny_sd1_single_file, tiny_sdxl_diffusers, tmp_path):
    toks = _tok_dir(tiny_sdxl_single_file)
    with pytest.raises(ModelLoadError, match="model file not found: .*missing.safetensors"):
        load_sd_components(tmp_path / "missing.safetensors", "sdxl", tokenizer_cache_dir=toks)
    with pytest.raises(ModelLoadError, match=r"SDXL model .*SD2\.x was requested"):
        load_sd_components(tiny_sdxl_single_file, "sd2", tokenizer_cache_dir=toks)
    with pytest.raises(ModelLoadError, match=r"SD1\.x model .*SDXL was requested"):
        load_sd_components(tiny_sd1_single_file, "sdxl", tokenizer_cache_dir=toks)
    with pytest.raises(ModelLoadError, match="SDXL model"):
        load_sd_components(tiny_sdxl_diffusers, "sd1")
    with pytest.raises(ModelLoadError, match="--tokenizer_cache_dir"):
        load_sd_components(tiny_sdxl_single_file, "sdxl", tokenizer_cache_dir=tmp_path / "empty")
    with pytest.raises(ModelLoadError, match="hub is offline"):
        load_sd_components("someone/some-model", "sdxl")
    with pytest.raises(ValueError, match="allowed: sd1, sd2, sdxl"):
        load_sd_components(tiny_sdxl_single_file, "flux")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="junk.safetensors"):
        load_sd_components(junk, "sdxl", tokenizer_cache_dir=toks)
    from safetensors.torch import save_file

    lora_like = tmp_path / "lora.safetensors"
    save_file({"lora_unet_x.lora_down.weight": torch.zeros(2, 2)}, str(lora_like))
    with pytest.raises(ModelLoadError, match="no Stable Diffusion text encoder weights.*LoRA .*--network_weights"):
        load_sd_components(lora_like, "sdxl", tokenizer_cache_dir=toks)
    vae_only = tmp_path / "vae.safetensors"
    save_file({"encoder.conv_in.weight": torch.zeros(2, 3, 3, 3), "decoder.conv_out.weight": torch.zeros(3, 2, 3, 3)}, str(vae_only))
    with pytest.raises(ModelLoadError, match="VAE alone .*--vae"):
        load_sd_components(vae_only, "sd1", tokenizer_cache_dir=toks)
    flux = tmp_path / "flux.safetensors"
    save_file({"double_blocks.0.img_attn.norm.key_norm.scale": torch.ones(4)}, str(flux))
    assert mu.detect_family(flux) == "flux"
    with pytest.raises(ModelLoadError, match=r"FLUX\.1 model .*SDXL was requested; use the FLUX\.1 script"):
        load_sd_components(flux, "sdxl", tokenizer_cache_dir=toks)
    from safetensors.torch import load_file

    broken = tmp_path / "broken.safetensors"  # an SDXL file without its second text encoder's embeddings
    save_file({k: v for k, v in load_file(str(tiny_sdxl_single_file)).items()
               if not k.startswith("conditioner.embedders.1.model.token_embedding")}, str(broken))
    with pytest.raises(ModelLoadError, match="broken.safetensors: incomplete SDXL checkpoint"):
        load_sd_components(broken, "sdxl", tokenizer_cache_dir=toks)
    with pytest.raises(ModelLoadError, match="not a diffusers model"):
        load_sd_components(tmp_path, "sdxl")


def test_detect_family(tiny_sdxl_single_file, tiny_sd1_single_file, tiny_sdxl_diffusers, tiny_sd1_diffusers, tmp_path):
    assert mu.detect_family(tiny_sdxl_single_file) == "sdxl"
    assert mu.detect_family(tiny_sd1_single_file) == "sd1"
    assert mu.detect_family(tiny_sdxl_diffusers) == "sdxl"
    assert mu.detect_family(tiny_sd1_diffusers) == "sd1"
    assert mu.detect_family(tmp_path / "nothing") is None


# ---- tiny tokenizer and images ----------------------------------------------------------------------------


def test_tiny_tokenizer_is_a_real_clip_tokenizer(tmp_path):
    from transformers import CLIPTokenizer

    tok = CLIPTokenizer.from_pretrained(str(tm.make_tiny_tokenizer(tmp_path / "tok")))
    ids = tok("a photo of a red circle", padding="max_length", max_length=tok.model_max_length).input_ids
    assert tok.model_max_length == 77 and len(ids) == 77
    assert ids[0] == tok.bos_token_id and tok.eos_token_id == max(tok.get_vocab().values())
    assert tok.tokenize("a photo of a red circle") == ["a</w>", "photo</w>", "of</w>", "a</w>", "red</w>", "circle</w>"]
    assert tok.decode(ids, skip_special_tokens=True) == "a photo of a red circle"
    classic = tmp_path / "classic"  # the vocab.json + merges.txt pair alone gives the same tokenizer
    classic.mkdir()
    for name in ("vocab.json", "merges.txt"):
        (classic / name).write_bytes((tmp_path / "tok" / name).read_bytes())
    assert CLIPTokenizer.from_pretrained(str(classic))("a sks dog").input_ids == tok("a sks dog").input_ids


def test_make_captioned_images(tmp_path):
    from PIL import Image

    root = tm.make_captioned_images(tmp_path, n=3, size=(48, 32), repeats=5, name="shapes")
    assert root == tmp_path
    sub = tmp_path / "5_shapes"
    pngs = sorted(sub.glob("*.png"))
    assert [p.name for p in pngs] == ["img_0.png", "img_1.png", "img_2.png"]
    for p in pngs:
        arr = np.asarray(Image.open(p))
        assert arr.shape == (32, 48, 3) and arr.std() > 20
        caption = p.with_suffix(".txt").read_text().strip()
        assert caption.startswith("a ") and "gradient" in caption
