"""Chroma (--model_type chroma on the FLUX.1 scripts) end to end on a tiny random Chroma built here (the distributed
single-file layout and a diffusers ChromaPipeline folder; CPU, 2 steps):
- LoRA from the single file: upstream's keys (lora_unet_double/single_blocks_*, no CLIP-L, no modulation layers),
  ss_model_type / modelspec architecture as upstream, a sample image;
- LoRA from the diffusers folder continuing that LoRA with --network_weights (+ T5-XXL LoRA: lora_te3_*);
- full fine-tune with flux_train.py: the saved single file reads back and differs from the base;
- the model's semantics: the T5 mask (one padding token seen), the guidance fed to the approximator;
- bad combinations: one line, exit 2.
"""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import flux_train
import flux_train_network
from library import chroma_models
from library.families import chroma

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def chroma_set(tmp_path_factory):
    return chroma_models.make_tiny_chroma(tmp_path_factory.mktemp("chroma_models"), prefix=True,
                                          diffusers_folder=True)


@pytest.fixture(scope="module")
def chroma_data(tmp_path_factory):
    from library.tiny_models import make_captioned_images

    return make_captioned_images(tmp_path_factory.mktemp("chroma_data"), n=2, size=(32, 32), repeats=1, name="demo")


def single_file_argv(paths):
    return ["--pretrained_model_name_or_path", paths["transformer"], "--t5xxl", paths["t5xxl"], "--ae", paths["ae"],
            "--tokenizer_cache_dir", paths["tokenizer_cache_dir"]]


def train_argv(data, out, name, extra=()):
    return ["--model_type", "chroma", "--apply_t5_attn_mask", "--train_data_dir", str(data), "--output_dir",
            str(out), "--output_name", name, "--resolution", "32", "--max_train_steps", "2", "--learning_rate", "1e-3",
            "--t5xxl_max_token_length", "16", "--max_data_loader_n_workers", "0", "--seed", "1",
            "--guidance_scale", "0.0", *extra]


LORA = ["--network_module", "networks.lora_flux", "--network_dim", "4", "--network_alpha", "2"]


def read(path):
    with safe_open(str(path), "pt") as f:
        md = f.metadata() or {}
    return load_file(str(path)), md


def test_layouts_load_the_same_weights(chroma_set):
    single = chroma_models.load_chroma_transformer(chroma_set["transformer"], torch.float32).state_dict()
    folder = chroma_models.load_chroma_transformer(chroma_set["diffusers"], torch.float32).state_dict()
    assert single.keys() == folder.keys()
    assert all(torch.equal(single[k], folder[k]) for k in single)
    written = load_file(chroma_set["transformer"])
    assert "model.diffusion_model.distilled_guidance_layer.norms.0.scale" in written
    assert not any("img_mod" in k or "modulation" in k or "vector_in" in k for k in written)


@pytest.mark.slow
def test_lora_single_file_then_diffusers_folder_with_network_weights(chroma_set, chroma_data, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle --w 64 --h 64 --s 2 --g 0 --l 4 --n blurry --d 7\n")
    path = flux_train_network.main([*single_file_argv(chroma_set), *LORA, *train_argv(
        chroma_data, tmp_path / "out", "lora", ["--sample_prompts", str(prompts), "--sample_every_n_steps", "2"])])
    sd, md = read(path)
    names = {k.split(".")[0] for k in sd}
    assert {"lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_double_blocks_0_txt_mlp_2",
            "lora_unet_single_blocks_0_linear1", "lora_unet_single_blocks_0_linear2"} <= names
    assert len(names) == 10  # 8 double-block + 2 single-block layers: no modulation, no text encoder
    assert any(v.abs().sum() > 0 for k, v in sd.items() if k.endswith("lora_up.weight"))
    assert md["ss_model_type"] == "chroma" and md["ss_base_model_version"] == "chroma"
    assert md["modelspec.architecture"] == "chroma/lora"
    assert md["modelspec.implementation"] == "https://huggingface.co/lodestones/Chroma"
    assert md["ss_apply_t5_attn_mask"] == "True" and md["ss_guidance_scale"] == "0.0"
    assert len(list((tmp_path / "out" / "sample").glob("lora_000002_00_*_7.png"))) == 1

    path2 = flux_train_network.main([
        "--pretrained_model_name_or_path", chroma_set["diffusers"], *LORA, "--network_weights", str(path),
        "--network_args", "train_t5xxl=True", *train_argv(chroma_data, tmp_path / "out2", "lora2"),
        "--unet_lr", "0", "--text_encoder_lr", "1e-3"])
    sd2, _ = read(path2)
    for k, v in sd.items():  # --unet_lr 0: the loaded transformer LoRA comes back unchanged
        assert torch.equal(sd2[k], v), k
    assert any(v.abs().sum() > 0 for k, v in sd2.items() if k.startswith("lora_te3_") and "lora_up" in k)


@pytest.mark.slow
def test_full_fine_tune_saves_a_single_file_that_reads_back(chroma_set, chroma_data, tmp_path):
    path = flux_train.main([*single_file_argv(chroma_set), "--optimizer_type", "AdamW",
                            *train_argv(chroma_data, tmp_path / "out", "full")])
    base = chroma_models.load_chroma_transformer(chroma_set["transformer"], torch.float32).state_dict()
    tuned = chroma_models.load_chroma_transformer(path, torch.float32).state_dict()
    assert base.keys() == tuned.keys()
    assert not torch.equal(base["transformer_blocks.0.attn.to_q.weight"], tuned["transformer_blocks.0.attn.to_q.weight"])
    _, md = read(path)
    assert md["modelspec.architecture"] == "chroma" and md["ss_model_type"] == "chroma"


def test_mask_sees_one_padding_token_and_guidance_reaches_the_approximator(chroma_set):
    model = chroma_models.load_chroma_transformer(chroma_set["transformer"], torch.float32)
    g = torch.Generator().manual_seed(0)
    noisy = torch.randn(1, 16, 8, 8, generator=g)
    sigma = torch.tensor([0.5])
    mask = torch.tensor([[1, 1, 1, 0, 0, 0]])
    t5 = torch.randn(1, 6, 32, generator=g)
    base = chroma.chroma_forward(model, noisy, sigma, {"t5_out": t5, "t5_attn_mask": mask}, 0.0, torch.float32)
    beyond = t5.clone()
    beyond[:, 4:] = 9.0  # past the caption and its one padding token: not seen
    same = chroma.chroma_forward(model, noisy, sigma, {"t5_out": beyond, "t5_attn_mask": mask}, 0.0, torch.float32)
    assert torch.allclose(base, same, atol=1e-6)
    first_pad = t5.clone()
    first_pad[:, 3] = 9.0  # the one padding token upstream's Chroma attends to
    seen = chroma.chroma_forward(model, noisy, sigma, {"t5_out": first_pad, "t5_attn_mask": mask}, 0.0,
                                 torch.float32)
    assert not torch.allclose(base, seen, atol=1e-4)
    guided = chroma.chroma_forward(model, noisy, sigma, {"t5_out": t5, "t5_attn_mask": mask}, 3.5, torch.float32)
    assert not torch.allclose(base, guided, atol=1e-4)
    again = chroma.chroma_forward(model, noisy, sigma, {"t5_out": t5, "t5_attn_mask": mask}, 0.0, torch.float32)
    assert torch.equal(base, again)  # the guidance hook is gone after the call


def full_length_forward(model, noisy, sigma, t5, t5_mask):
    """The transformer over all padded text tokens with the mask (the tokens past each caption and its one padding
    token masked as keys; masked queries see nothing): what chroma_forward computed before it cut the text."""
    from library import flux_train_utils

    b, _, h, w = noisy.shape
    seen = torch.clamp(t5_mask.sum(dim=1, keepdim=True) + 1, max=t5_mask.shape[1])
    txt = torch.arange(t5_mask.shape[1])[None, :] < seen
    mask = torch.cat([txt, torch.ones(b, (h // 2) * (w // 2), dtype=torch.bool)], dim=1)
    out = model(hidden_states=flux_train_utils.pack_latents(noisy), encoder_hidden_states=t5, timestep=sigma,
                img_ids=flux_train_utils.image_ids(h, w, noisy.device, noisy.dtype),
                txt_ids=torch.zeros(t5.shape[1], 3), attention_mask=mask, return_dict=False)[0]
    return flux_train_utils.unpack_latents(out, h, w)


@pytest.mark.parametrize("lengths, checkpointing", [((3,), None), ((5, 2), None), ((4, 4), None), ((12, 1), None),
                                                     ((5, 2), "diffusers"), ((12, 1), "offload"), ((3,), "offload")])
def test_cut_text_gives_the_full_length_outputs_and_gradients(chroma_set, lengths, checkpointing):
    """chroma_forward cuts the text after the batch's longest caption (+ its padding token) and drops the mask
    where every sample sees the same length: the same outputs and gradients (model weights and input) as the
    whole padded sequence with the mask. Also with diffusers' gradient checkpointing (plain or CPU-offloading),
    which hands the single blocks no mask of its own (single_blocks_masked)."""
    from library import offload_checkpointing

    model = chroma_models.load_chroma_transformer(chroma_set["transformer"], torch.float32)
    model.requires_grad_(True)
    g = torch.Generator().manual_seed(1)
    b = len(lengths)
    noisy = torch.randn(b, 16, 8, 8, generator=g)
    sigma = torch.rand(b, generator=g)
    t5 = torch.randn(b, 12, 32, generator=g)
    t5_mask = (torch.arange(12)[None, :] < torch.tensor(lengths)[:, None]).long()
    cut, mask = chroma.trim_text(t5, t5_mask, 16)
    longest = min(max(lengths) + 1, 12)
    assert cut.shape[1] == longest
    assert (mask is None) == (len(set(min(n + 1, 12) for n in lengths)) == 1)
    results = []
    for forward in (lambda x: full_length_forward(model, x, sigma, t5, t5_mask),
                    lambda x: chroma.chroma_forward(model, x, sigma, {"t5_out": t5, "t5_attn_mask": t5_mask}, 0.0,
                                                    torch.float32)):
        if results and checkpointing == "diffusers":
            model.enable_gradient_checkpointing()
        elif results and checkpointing == "offload":
            offload_checkpointing.enable(model)
        model.zero_grad()
        x = noisy.clone().requires_grad_(True)
        out = forward(x)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), x.grad, {n: p.grad.clone() for n, p in model.named_parameters()
                                               if p.grad is not None}))
    (ref, ref_dx, ref_grads), (ours, dx, grads) = results
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(dx, ref_dx, atol=2e-5, rtol=1e-4)
    assert ref_grads.keys() == grads.keys() and len(grads) > 20
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=2e-5, rtol=1e-4, msg=name)


def test_compiled_blocks_take_a_new_caption_length_with_one_recompile(chroma_set):
    """The cut text changes the blocks' input shapes with each batch's longest caption, also with one bucket shape:
    Chroma compiles with torch's automatic dynamic there (static graphs first, one recompile with the length
    symbolic at a second length), not static graphs that recompile for every caption length."""
    import argparse
    import types

    from library.compile import options as compile_options
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    args = compile_options.add_compile_arguments(argparse.ArgumentParser()).parse_args(
        ["--compile", "--compile_backend", "eager"])
    args.gradient_checkpointing, args.blocks_to_swap, args._input_shapes = False, 0, 1  # one bucket shape
    model = chroma_models.load_chroma_transformer(chroma_set["transformer"], torch.float32)
    family = chroma.Chroma()
    family.compile(args, types.SimpleNamespace(transformer=model))
    assert family.compiled_blocks == 2 and args._input_shapes == 1  # the caller's settings are left as they were
    g = torch.Generator().manual_seed(2)
    for length in (3, 6, 9, 12, 5):
        t5_mask = (torch.arange(16)[None, :] < length).long()
        with torch.no_grad():
            chroma.chroma_forward(model, torch.randn(1, 16, 8, 8, generator=g), torch.tensor([0.5]),
                                  {"t5_out": torch.randn(1, 16, 32, generator=g), "t5_attn_mask": t5_mask}, 0.0,
                                  torch.float32)
    # two block classes: each compiled for the first length, then once more with the length dynamic
    assert counters["stats"]["unique_graphs"] == 4, dict(counters["stats"])
    torch._dynamo.reset()


@pytest.mark.parametrize("drop, add, needle", [
    ("--apply_t5_attn_mask", [], "--model_type chroma needs --apply_t5_attn_mask"),
    ("--t5xxl", [], "--t5xxl required"),
    (None, ["--model_type", "chromaa"], "invalid choice"),
])
def test_bad_settings_one_line_exit_2(chroma_set, chroma_data, tmp_path, capsys, drop, add, needle):
    argv = [*single_file_argv(chroma_set), *LORA, *train_argv(chroma_data, tmp_path / "out", "bad"), *add]
    if drop:
        i = argv.index(drop)
        del argv[i: i + (1 if drop.startswith("--apply") else 2)]
    with pytest.raises(SystemExit) as e:
        flux_train_network.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not (tmp_path / "out" / "bad.safetensors").exists()


def test_flux_file_is_not_a_chroma_checkpoint(tmp_path, chroma_data, capsys):
    from library import flux_tiny

    paths = flux_tiny.make_tiny_flux(tmp_path / "flux")
    with pytest.raises(SystemExit) as e:
        flux_train_network.main([*single_file_argv(paths), *LORA, *train_argv(chroma_data, tmp_path / "out", "x")])
    assert e.value.code == 2
    assert "is not a Chroma checkpoint" in capsys.readouterr().err


def test_gui_flux_family_runs_chroma_as_a_model_type():
    """The GUI offers Chroma as FLUX.1's model type (choices from the option dump) and runs the FLUX.1 scripts."""
    from kohya_gui import command, params as P

    for tab, script in (("lora", "flux_train_network.py"), ("finetune", "flux_train.py")):
        model_type = next(p for p in P.params_for(tab, "FLUX.1") if p.name == "model_type")
        assert "chroma" in model_type.choices
        values = {**P.defaults(tab), "output_dir": "/tmp/out", "output_name": "c", "model_type": "chroma",
                  "apply_t5_attn_mask": True}
        argv = command.standalone_argv(tab, "FLUX.1", values)
        assert argv[argv.index("--model_type") + 1] == "chroma" and "--apply_t5_attn_mask" in argv
        assert any(a.endswith(script) for a in argv)


@pytest.mark.slow
def test_lora_cached_outputs_block_swap_fp8_and_compile(chroma_set, chroma_data, tmp_path, caplog):
    """What FLUX.1 has carries over: cached latents and T5 outputs on disk (upstream's _flux_te.npz), fp8 base,
    block swap, gradient checkpointing and the regional compile of Chroma's blocks; --clip_l is ignored."""
    import logging
    import shutil

    caplog.set_level(logging.INFO)
    data = tmp_path / "data"
    shutil.copytree(chroma_data, data)
    path = flux_train_network.main([*single_file_argv(chroma_set), *LORA, *train_argv(data, tmp_path / "out", "c", [
        "--clip_l", chroma_set["t5xxl"], "--cache_text_encoder_outputs_to_disk", "--cache_latents_to_disk",
        "--network_train_unet_only", "--blocks_to_swap", "1", "--gradient_checkpointing", "--fp8_base",
        "--compile", "--compile_backend", "aot_eager"])])
    sd, md = read(path)
    assert md["ss_fp8_base"] == "True" and md["ss_blocks_to_swap"] == "1" and md["ss_compile_blocks"] == "2"
    assert any(v.abs().sum() > 0 for k, v in sd.items() if k.endswith("lora_up.weight"))
    assert len(list(data.rglob("*_flux_te.npz"))) == 2 and len(list(data.rglob("*_flux.npz"))) == 2
    assert "--clip_l is ignored: Chroma does not use CLIP-L" in caplog.text
    # Chroma is told from FLUX.1 for the compile's auto choices: it keeps upstream's memory
    assert "--compile_checkpoint_keep auto: inputs (the only choice at upstream's memory or less: Chroma" in caplog.text


@pytest.mark.slow
def test_gui_demo_preset_makes_a_tiny_chroma_and_trains(tmp_path, monkeypatch):
    """The Chroma demo preset: the demo helper makes its tiny Chroma and images in cache/demo/, and the flags the
    GUI builds from the preset train a Chroma LoRA."""
    from kohya_gui import command, config_file, demo, presets

    monkeypatch.chdir(tmp_path)
    cfg = config_file.load(presets.preset_path("lora", "demo-chroma-tiny"))
    assert (cfg.tab, cfg.family, cfg.values["model_type"]) == ("lora", "FLUX.1", "chroma")
    values = {**cfg.values, "max_train_steps": 2, "sample_every_n_steps": 2}
    made = demo.make_assets(cfg.family, values, log=lambda *_: None)
    assert str(tmp_path / "cache/demo/chroma/chroma.safetensors") in {str(tmp_path / p) for p in made}
    assert not demo.missing_demo_paths(cfg.family, values)
    path = flux_train_network.main(command.trainer_args(cfg.tab, cfg.family, values))
    sd, md = read(path)
    assert md["ss_model_type"] == "chroma" and "lora_unet_single_blocks_0_linear1.lora_up.weight" in sd
    assert list((tmp_path / "outputs/demo-chroma-tiny/sample").glob("demo-chroma-lora_000002_00_*.png"))


@pytest.mark.slow
def test_oft_on_chroma_targets_the_blocks_it_has(chroma_set, chroma_data, tmp_path):
    path = flux_train_network.main([*single_file_argv(chroma_set), "--network_module", "networks.oft_flux",
                                    "--network_dim", "4", "--network_args", "enable_all_linear=True",
                                    *train_argv(chroma_data, tmp_path / "out", "oft")])
    names = {k.split(".")[0] for k in read(path)[0]}
    assert "oft_unet_double_blocks_0_img_attn_qkv" in names and "oft_unet_single_blocks_0_linear1" in names
    assert len(names) == 10 and not any("mod" in n for n in names)
