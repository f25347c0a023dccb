"""Precision, memory and compile-switch options of the seven scripts, against upstream's rules:

--fp8_base / --fp8_base_unet (library.precision), --fp16_master_weights_and_gradients, --cpu_offload_checkpointing
(library.offload_checkpointing), --disable_mmap_load_safetensors (library.safetensors_io), --torch_compile /
--dynamo_backend (library.compile.options.apply_torch_compile_alias), --diffusers_xformers, and the FLUX options --model_type,
--split_mode, --double_blocks_to_swap / --single_blocks_to_swap, --controlnet_model_name_or_path.
One tiny end-to-end SDXL LoRA run combines them (slow)."""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest
import torch

import fine_tune
import flux_train
import flux_train_network
import sdxl_train
import sdxl_train_network
import train_network
from library import flux_train_utils, offload_checkpointing, precision, safetensors_io, train_util
from library.compile import options as compile_options, regional
from library.compile.options import CompileConfigError
from library.train_util import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def parse(script, argv):
    return train_util.parse_args(script.setup_parser(), argv)


# ---------------------------------------------------------------------------------------------- fp8 base


def _linears(module):
    return [m for m in module.modules() if isinstance(m, torch.nn.Linear)]


def test_fp8_base_stores_sdxl_linear_weights_in_float8(tiny_sdxl_single_file):
    from library.model_util import load_sd_components

    tok = str(tiny_sdxl_single_file.parent / "tokenizers")
    comps = load_sd_components(str(tiny_sdxl_single_file), "sdxl", tokenizer_cache_dir=tok)
    args = parse(sdxl_train_network, ["--fp8_base"])
    t = sdxl_train_network.trainer()
    t.family.apply_fp8(args, comps, t.target.fp8_targets(args))
    for model in (comps.unet, *comps.text_encoders):
        assert _linears(model) and all(m.weight.dtype == torch.float8_e4m3fn for m in _linears(model))
    # convolutions, norms and embeddings keep the training dtype
    assert all(m.weight.dtype == torch.float32 for m in comps.unet.modules() if isinstance(m, torch.nn.Conv2d))
    embeddings = [m for m in comps.text_encoders[0].modules() if isinstance(m, torch.nn.Embedding)]
    assert embeddings and all(m.weight.dtype == torch.float32 for m in embeddings)
    # moving to the training dtype keeps them fp8 (Module.to would upcast them)
    precision.to_device_dtype(comps.unet, "cpu", torch.bfloat16)
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in _linears(comps.unet))
    assert comps.unet.conv_in.weight.dtype == torch.bfloat16


def test_fp8_base_unet_leaves_the_text_encoders(tiny_sd1_single_file):
    from library.model_util import load_sd_components

    comps = load_sd_components(str(tiny_sd1_single_file), "sd1",
                               tokenizer_cache_dir=str(tiny_sd1_single_file.parent / "tokenizers"))
    args = parse(train_network, ["--fp8_base_unet"])
    t = train_network.trainer()
    t.family.apply_fp8(args, comps, t.target.fp8_targets(args))
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in _linears(comps.unet))
    assert all(m.weight.dtype == torch.float32 for m in _linears(comps.text_encoders[0]))
    assert precision.fp8_targets(args) == (True, False)
    assert precision.fp8_targets(parse(train_network, ["--fp8_base"])) == (True, True)
    assert precision.fp8_targets(parse(train_network, [])) == (False, False)


def test_fp8_t5_keeps_wo_and_stays_accurate():
    """T5's feed-forward casts its input to wo's dtype: an fp8 wo would round the hidden states to fp8."""
    from library.flux_tiny import tiny_t5

    t5 = tiny_t5(64)
    ids = torch.randint(0, 64, (2, 7))
    ref = t5(ids).last_hidden_state
    n = precision.apply_fp8_base(t5)
    assert n > 0
    assert all(b.layer[1].DenseReluDense.wo.weight.dtype == torch.float32 for b in t5.encoder.block)
    assert t5.encoder.block[0].layer[1].DenseReluDense.wi_0.weight.dtype == torch.float8_e4m3fn
    out = t5(ids).last_hidden_state
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=0.15, rtol=0.1)  # fp8 rounding of the other weights only


def test_full_trainers_ignore_fp8_base_with_a_warning(caplog, tmp_path):
    args = parse(fine_tune, ["--fp8_base", "--pretrained_model_name_or_path", "x.safetensors", "--output_dir",
                             str(tmp_path)])
    trainer = fine_tune.trainer()
    assert trainer.target.fp8_targets(args) == (False, False)
    with caplog.at_level(logging.WARNING):
        trainer.check_args(args)
    assert "--fp8_base is for LoRA training" in caplog.text


def test_fp16_master_weights_is_accepted_and_ignored(caplog):
    args = parse(sdxl_train, ["--fp16_master_weights_and_gradients"])
    with caplog.at_level(logging.WARNING):
        precision.check_precision_args(args)
    assert "--fp16_master_weights_and_gradients applies only to DeepSpeed" in caplog.text


# ---------------------------------------------------------------------------------------------- mmap


def test_disable_mmap_reads_the_whole_file(tmp_path, monkeypatch):
    import safetensors.torch

    path = tmp_path / "w.safetensors"
    tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    safetensors.torch.save_file(tensors, str(path))
    mapped = []
    real = safetensors.torch.load_file
    monkeypatch.setattr(safetensors.torch, "load_file", lambda *a, **k: mapped.append(a) or real(*a, **k))
    args = parse(sdxl_train_network, ["--disable_mmap_load_safetensors"])
    with safetensors_io.mmap_setting(args):
        from library.model_util import load_state_dict_file

        sd = load_state_dict_file(path)
    assert mapped == []  # read at once, not memory-mapped
    assert sd.keys() == tensors.keys() and all(torch.equal(sd[k], tensors[k]) for k in tensors)
    with safetensors_io.mmap_setting(parse(sdxl_train_network, [])):
        safetensors_io.load_file(path)
    assert len(mapped) == 1  # the default memory-maps
    safetensors_io.load_file(path)
    assert len(mapped) == 2  # the setting ends with the block


# ---------------------------------------------------------------------------------------------- --torch_compile


def test_torch_compile_maps_to_regional_compile(caplog):
    args = parse(sdxl_train_network, ["--torch_compile", "--dynamo_backend", "aot_eager"])  # normalised
    assert args.compile and args.compile_backend == "aot_eager"
    with caplog.at_level(logging.INFO):  # the check (after the console log is set up) says so
        compile_options.check_torch_compile_alias(args)
    assert ("--torch_compile/--dynamo_backend aot_eager: using regional compilation "
            "(--compile --compile_backend aot_eager)") in caplog.messages
    args = parse(flux_train, ["--torch_compile"])  # upstream's default backend
    assert args.compile and args.compile_backend == "inductor"


def test_dynamo_backend_no_from_the_kohya_gui_is_a_quiet_no_op(tmp_path, caplog):
    cfg = tmp_path / "run.toml"
    cfg.write_text('dynamo_backend = "no"\ntorch_compile = true\n')  # what the kohya_ss GUI can write
    for script in (sdxl_train_network, train_network, flux_train):
        with caplog.at_level(logging.INFO):
            args = parse(script, ["--config_file", str(cfg)])
        assert compile_options.compile_args(args) is None or not args.compile
    assert "regional" not in caplog.text
    args = parse(sdxl_train_network, ["--dynamo_backend", "NO"])
    assert args.dynamo_backend == "NO"
    # upstream's choices are the listed ones; an unknown one is refused by argparse
    action = next(a for a in sdxl_train_network.setup_parser()._actions if a.dest == "dynamo_backend")
    assert list(action.choices) == list(compile_options.DYNAMO_BACKENDS) and action.default == "inductor"
    with pytest.raises(SystemExit):
        parse(sdxl_train_network, ["--dynamo_backend", "bogus"])


def test_dynamo_backend_without_torch_compile_changes_nothing():
    args = parse(sdxl_train_network, ["--dynamo_backend", "aot_eager"])
    assert not args.compile and args.compile_backend == "inductor"


def test_unavailable_dynamo_backend_is_a_clear_error():
    args = parse(sdxl_train_network, ["--torch_compile", "--dynamo_backend", "tvm"])
    assert not args.compile  # parsing maps only a backend torch has here; the check refuses the rest
    with pytest.raises(CompileConfigError, match="--dynamo_backend tvm: not available .* use one of inductor"):
        compile_options.check_torch_compile_alias(args)


def test_torch_compile_gives_sd1_scripts_regional_compile(tiny_sd1_single_file, caplog):
    from library.model_util import load_sd_components

    args = parse(train_network, ["--torch_compile", "--dynamo_backend", "eager"])
    assert not hasattr(args, "compile")  # the SD1.x scripts have no --compile flags ...
    keys = {line.split("=")[0].strip() for line in train_util.dumps_config(args).splitlines() if "=" in line}
    assert "torch_compile" in keys and not keys & {"compile", "compile_backend"}  # ... nor does their run TOML
    cargs = compile_options.compile_args(args)
    assert cargs.compile and cargs.compile_backend == "eager" and cargs.compile_mode == "default"
    comps = load_sd_components(str(tiny_sd1_single_file), "sd1",
                               tokenizer_cache_dir=str(tiny_sd1_single_file.parent / "tokenizers"))
    trainer = train_network.trainer()
    with caplog.at_level(logging.INFO):
        trainer.family.compile(args, comps)
    n = sum(1 for m in comps.unet.modules() if type(m).__name__ == "BasicTransformerBlock")
    assert trainer.family.compiled_blocks == n > 0
    assert f"Compiled {n} blocks of UNet (BasicTransformerBlock)" in caplog.text
    plain = parse(train_network, [])
    assert compile_options.compile_args(plain) is None


# ---------------------------------------------------------------------------------------------- cpu offload


def test_cpu_offload_checkpointing_keeps_block_inputs_offloaded(monkeypatch):
    from test_compile_utils import _assert_same, _tiny_unet, _unet_step, _with_lora

    plain, offl = _tiny_unet(), _tiny_unet()
    net_plain, net_offl = _with_lora(plain), _with_lora(offl)
    net_offl.load_state_dict(net_plain.state_dict())
    ref = _unet_step(plain, network=net_plain)

    offloaded, held = set(), []
    real_move, real_ckpt = offload_checkpointing._move, offload_checkpointing.checkpoint

    def move(x, device):
        out = real_move(x, device)
        if device == offload_checkpointing.OFFLOAD_DEVICE:
            offloaded.update(id(t) for t in (out if isinstance(out, tuple) else (out,)) if torch.is_tensor(t))
        return out

    def ckpt(fn, *args, **kwargs):
        held.extend(id(a) for a in args if torch.is_tensor(a))
        return real_ckpt(fn, *args, **kwargs)

    monkeypatch.setattr(offload_checkpointing, "_move", move)
    monkeypatch.setattr(offload_checkpointing, "checkpoint", ckpt)
    offload_checkpointing.enable(offl)
    got = _unet_step(offl, network=net_offl)
    _assert_same(ref, got)
    # every tensor a checkpoint keeps for its recompute is a copy made for the offload device
    assert held and set(held) <= offloaded


@pytest.mark.slow
def test_cpu_offload_checkpointing_around_compiled_blocks():
    from test_compile_utils import _assert_same, _tiny_unet, _unet_step, _with_lora

    if torch.cuda.is_available():
        torch.cuda.init()  # on a GPU machine, dynamo would initialise CUDA inside the first checkpointed forward
    plain, comp = _tiny_unet(), _tiny_unet()
    net_plain, net_comp = _with_lora(plain), _with_lora(comp)
    net_comp.load_state_dict(net_plain.state_dict())
    ref = _unet_step(plain, network=net_plain)
    offload_checkpointing.enable(comp)
    args = argparse.Namespace(compile=True, compile_backend="aot_eager", compile_mode="default",
                              compile_dynamic="auto", compile_fullgraph=False)
    n = regional.compile_model_blocks(comp, args, model_name="SDXL UNet", gradient_checkpointing=True,
                                           offload_checkpointing=True)
    assert n == 7
    # the offloading checkpoint stays around the blocks; nothing is checkpointed inside the compiled region
    t2d = [m for m in comp.modules() if type(m).__name__ == "Transformer2DModel"]
    assert all(m.gradient_checkpointing for m in t2d)
    assert not any(hasattr(b, "_forward_inside_checkpoint") for b in regional.find_repeated_blocks(comp))
    _assert_same(ref, _unet_step(comp, network=net_comp))


def test_cpu_offload_checkpointing_refusals():
    args = parse(sdxl_train_network, ["--cpu_offload_checkpointing", "--gradient_checkpointing", "--compile",
                                      "--compile_mode", "reduce-overhead"])
    with pytest.raises(CompileConfigError, match="--cpu_offload_checkpointing .*--compile_mode reduce-overhead"):
        compile_options.validate_compile_args(args)
    args.compile_mode = "max-autotune-no-cudagraphs"
    compile_options.validate_compile_args(args)  # fine without CUDA graphs
    args = parse(flux_train_network, ["--cpu_offload_checkpointing", "--blocks_to_swap", "2"])
    with pytest.raises(ConfigError, match="--cpu_offload_checkpointing cannot be used with --blocks_to_swap 2"):
        flux_train_network.trainer().family.check_args(args)
    # only with --gradient_checkpointing, as upstream's train_network
    assert not offload_checkpointing.enabled(parse(train_network, ["--cpu_offload_checkpointing"]))
    # the scripts that have it upstream
    for script, has in ((train_network, True), (flux_train, True), (sdxl_train, False), (fine_tune, False)):
        assert hasattr(parse(script, []), "cpu_offload_checkpointing") == has


def test_flux_train_turns_on_gradient_checkpointing_for_cpu_offload(caplog):
    with caplog.at_level(logging.WARNING):  # parsing normalises (flux_train_utils.normalise_full_args)
        args = parse(flux_train, ["--cpu_offload_checkpointing", "--optimizer_type", "Adafactor"])
    assert args.gradient_checkpointing
    assert "cpu_offload_checkpointing is enabled, so gradient_checkpointing is also enabled" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cpu_offload_checkpointing_frees_gpu_activations():
    """Between forward and backward the GPU holds no inputs of the checkpointed blocks."""
    from diffusers import UNet2DConditionModel

    def unet():
        torch.manual_seed(0)
        return UNet2DConditionModel(
            sample_size=64, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(64, 128),
            down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=64,
            attention_head_dim=8, norm_num_groups=32).cuda().requires_grad_(False)

    def held_after_forward(model):
        x = torch.randn(8, 4, 64, 64, device="cuda", requires_grad=True)
        ctx = torch.randn(8, 16, 64, device="cuda")
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = model(x, torch.tensor([10] * 8, device="cuda"), ctx).sample
        held = torch.cuda.memory_allocated() - before
        out.float().square().mean().backward()
        return held, x.grad.clone()

    plain = unet()
    plain.enable_gradient_checkpointing()
    plain.train()
    held_plain, grad_plain = held_after_forward(plain)
    offl = unet()
    offload_checkpointing.enable(offl)
    offl.train()
    held_offl, grad_offl = held_after_forward(offl)
    torch.testing.assert_close(grad_offl, grad_plain, atol=1e-4, rtol=1e-3)
    # an H100 run of this model: 465 MiB held with checkpointing, 264 MiB with the offload (the rest are the
    # UNet's skip connections and the layers outside the checkpointed blocks)
    assert held_offl < 0.7 * held_plain, (held_offl, held_plain)
    # the same around inductor-compiled blocks
    comp = unet()
    offload_checkpointing.enable(comp)
    comp.train()
    cargs = argparse.Namespace(compile=True, compile_backend="inductor", compile_mode="default",
                               compile_dynamic="false", compile_fullgraph=False)
    regional.compile_model_blocks(comp, cargs, model_name="UNet", gradient_checkpointing=True,
                                       offload_checkpointing=True)
    held_comp, grad_comp = held_after_forward(comp)
    torch.testing.assert_close(grad_comp, grad_plain, atol=1e-3, rtol=1e-2)
    assert held_comp < 0.7 * held_plain, (held_comp, held_plain)


# ---------------------------------------------------------------------------------------------- xformers


def test_diffusers_xformers_asks_diffusers_for_the_unet_and_the_vae(caplog):
    calls = []

    class Model(torch.nn.Module):
        def enable_xformers_memory_efficient_attention(self):
            calls.append(type(self).__name__)

    class UNet(Model):
        pass

    class VAE(Model):
        pass

    unet, vae = UNet(), VAE()
    comps = argparse.Namespace(unet=unet, vae=vae, denoiser=unet, autoencoder=vae)
    for script in (fine_tune, sdxl_train):
        calls.clear()
        args = parse(script, ["--diffusers_xformers"])
        sdxl_train.trainer().family.set_attention_backend(args, comps)
        assert calls == ["UNet", "VAE"]
    calls.clear()
    sdxl_train.trainer().family.set_attention_backend(parse(sdxl_train, []), comps)
    assert calls == []
    assert not hasattr(parse(sdxl_train_network, []), "diffusers_xformers")


# ---------------------------------------------------------------------------------------------- FLUX options


def test_flux_model_type_picks_the_family():
    """--model_type chroma trains Chroma (library.families.chroma; its own checks: tests/test_chroma.py)."""
    args = parse(flux_train_network, ["--model_type", "chroma", "--apply_t5_attn_mask"])
    family = flux_train_network.trainer(args).family
    assert family.label == "Chroma"
    family.check_args(args)
    assert flux_train_network.trainer(parse(flux_train_network, ["--model_type", "flux"])).family.label == "FLUX"


def test_flux_split_mode_maps_to_blocks_to_swap_18(caplog):
    with caplog.at_level(logging.WARNING):  # parsing normalises (flux_train_utils.map_split_mode)
        args = parse(flux_train_network, ["--split_mode"])
    assert args.blocks_to_swap == 18 and "`--blocks_to_swap 18` is automatically set" in caplog.text
    with caplog.at_level(logging.WARNING):
        args = parse(flux_train_network, ["--split_mode", "--blocks_to_swap", "3"])
    assert args.blocks_to_swap == 3 and "`--split_mode` is ignored" in caplog.text


@pytest.mark.parametrize("argv, expected", [
    (["--double_blocks_to_swap", "2", "--single_blocks_to_swap", "7"], 2 + 7 // 2),
    (["--single_blocks_to_swap", "4"], 2),
    (["--double_blocks_to_swap", "2", "--blocks_to_swap", "5"], 5),  # --blocks_to_swap wins
    ([], None),
])
def test_flux_train_deprecated_block_swap_counts(argv, expected, caplog):
    with caplog.at_level(logging.WARNING):  # parsing normalises (flux_train_utils.normalise_full_args)
        args = parse(flux_train, argv)
    assert args.blocks_to_swap == expected
    assert ("double_blocks_to_swap and single_blocks_to_swap are deprecated" in caplog.text) == (
        "--blocks_to_swap" not in argv and expected is not None)


def test_flux_controlnet_path_is_ignored_with_a_warning(caplog):
    args = parse(flux_train_network, ["--controlnet_model_name_or_path", "cn.safetensors"])
    with caplog.at_level(logging.WARNING):
        flux_train_network.trainer().family.check_args(args)
    assert "--controlnet_model_name_or_path is ignored" in caplog.text


# ---------------------------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_sdxl_lora_with_fp8_offload_torch_compile_and_logging(tmp_path, tiny_sdxl_single_file, tiny_dataset_dir):
    """One run with the options on: fp8 UNet/TE weights stay fp8 through training, the LoRA trains, the upstream
    compile switch compiles the blocks, the log goes to the file, the trackers get the sanitized config."""
    from test_sdxl_lora_training import base_argv

    seen = {}

    trainer = sdxl_train_network.trainer()
    setup_trainable = trainer.target.setup_trainable

    def recording_setup_trainable(args, accelerator, family, components, *rest):
        seen["components"] = components
        return setup_trainable(args, accelerator, family, components, *rest)

    trainer.target.setup_trainable = recording_setup_trainable

    log = tmp_path / "console.log"
    tracker_toml = tmp_path / "trackers.toml"
    tracker_toml.write_text("[tensorboard]\nflush_secs = 1\n")
    argv = base_argv(tiny_sdxl_single_file, tmp_path / "out", tiny_dataset_dir, "fp8", extra=[
        "--fp8_base", "--gradient_checkpointing", "--cpu_offload_checkpointing", "--torch_compile",
        "--dynamo_backend", "aot_eager", "--disable_mmap_load_safetensors", "--console_log_file", str(log),
        "--console_log_level", "DEBUG", "--logging_dir", str(tmp_path / "logs"), "--log_config",
        "--log_tracker_config", str(tracker_toml), "--wandb_api_key", "SECRET"])
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        path = trainer.train(train_util.parse_args(sdxl_train_network.setup_parser(), argv))
    finally:
        for h in list(root.handlers):
            if h not in handlers:
                root.removeHandler(h)
                h.close()
        root.setLevel(level)
    from lora_checks import read_lora

    sd, md = read_lora(path)
    assert any(v.abs().sum() > 0 for k, v in sd.items() if k.endswith("lora_up.weight"))
    assert all(torch.isfinite(torch.tensor(trainer.losses)))
    assert md["ss_fp8_base"] == "True" and md["ss_fp8_base_unet"] == "False"
    comps = seen["components"]
    for model in (comps.unet, *comps.text_encoders):
        assert all(m.weight.dtype == torch.float8_e4m3fn for m in _linears(model))
    assert trainer.family.compiled_blocks > 0
    text = log.read_text()
    assert "using regional compilation (--compile --compile_backend aot_eager)" in text
    assert "activations kept in CPU memory" in text and "read into memory without mmap" in text
    events = list(Path(tmp_path / "logs").rglob("events.out.tfevents.*"))
    assert events  # TensorBoard got the run (with --log_config its hparams)
    blob = b"".join(p.read_bytes() for p in events)
    assert b"learning_rate" in blob and b"SECRET" not in blob
