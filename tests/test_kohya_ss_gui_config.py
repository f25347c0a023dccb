"""Acceptance: the run TOML the kohya_ss GUI (bmaltais/kohya_ss 45088f0, kohya_gui/lora_gui.py train_model) writes
for an SDXL LoRA, every key it writes at the GUI's defaults included, trains unedited with sdxl_train_network.py.

The TOML below is what train_model's `config_toml_data` becomes for the LoRA tab with the SDXL checkbox on and
every other control at its default, after the GUI's own filter (values "", False, None and 0 left out, then
max_data_loader_n_workers added). The user typed only what a run needs: model, folders, output name, a 64x64
resolution (the tiny model) and 2 steps. The GUI also writes sample/prompt.txt (empty) and passes its path.
"""
from __future__ import annotations

import logging

import pytest

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]  # tiny SDXL runs, several seconds each


def kohya_ss_sdxl_lora_toml(model, data, out, name) -> str:
    prompt_file = out / "sample" / "prompt.txt"
    prompt_file.parent.mkdir(parents=True)
    prompt_file.write_text("")  # create_prompt_file writes the (empty) prompt box
    # sorted by key, as the GUI writes it (toml.dump of a sorted dict)
    return f"""bucket_no_upscale = true
bucket_reso_steps = 64
cache_latents = true
caption_extension = ".txt"
clip_skip = 1
dynamo_backend = "no"
enable_bucket = true
epoch = 1
gradient_accumulation_steps = 1
huber_c = 0.1
huber_scale = 1.0
huber_schedule = "snr"
learning_rate = 0.0001
loss_type = "l2"
lr_scheduler = "cosine"
lr_scheduler_args = []
lr_scheduler_num_cycles = 1
lr_scheduler_power = 1.0
max_bucket_reso = 2048
max_data_loader_n_workers = 0
max_grad_norm = 1.0
max_timestep = 1000
max_token_length = 75
max_train_steps = 2
min_bucket_reso = 256
mixed_precision = "fp16"
network_alpha = 1
network_args = []
network_dim = 8
network_module = "networks.lora"
noise_offset_type = "Original"
optimizer_args = []
optimizer_type = "AdamW8bit"
output_dir = "{out}"
output_name = "{name}"
pretrained_model_name_or_path = "{model}"
prior_loss_weight = 1.0
resolution = "64,64"
sample_prompts = "{prompt_file}"
sample_sampler = "euler_a"
save_every_n_epochs = 1
save_model_as = "safetensors"
save_precision = "fp16"
text_encoder_lr = [ 0.0001, 0.0001,]
train_batch_size = 1
train_data_dir = "{data}"
unet_lr = 0.0001
wandb_run_name = "{name}"
xformers = true
"""


def skip_if_not_yet(text: str) -> None:
    """Skips while a key of the file is an upstream option the parser lacks and parity.NOT_YET lists (that table
    fails its own test once the option lands, so this skip ends by itself)."""
    import tomllib

    import sdxl_train_network
    from library import parity

    accepted = {a.dest for a in sdxl_train_network.setup_parser()._actions}
    waiting = sorted(k for k in tomllib.loads(text) if k in parity.NOT_YET and k not in accepted)
    if waiting:
        pytest.skip(f"options the kohya_ss GUI writes that are not accepted yet: {', '.join(waiting)}")


@pytest.fixture
def fresh_accelerate_state():
    """The file trains in fp16 (the GUI's default mixed precision); accelerate keeps one mixed-precision setting
    per process, so the test starts and leaves the process without one."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_kohya_ss_gui_sdxl_lora_toml_trains_two_steps(tmp_path, tiny_sdxl_single_file, tiny_dataset_dir, caplog):
    import sdxl_train_network
    from library import network_trainer, train_util
    from lora_checks import read_lora

    out = tmp_path / "out"
    cfg = tmp_path / "config_lora-20260101-120000.toml"
    text = kohya_ss_sdxl_lora_toml(tiny_sdxl_single_file, tiny_dataset_dir, out, "gui_lora")
    skip_if_not_yet(text)
    cfg.write_text(text)
    # the file as written; on the command line only what this CPU-only test machine needs: the tokenizers
    # offline, and AdamW instead of the GUI's default AdamW8bit (bitsandbytes, see the next test)
    argv = ["--config_file", str(cfg), "--tokenizer_cache_dir", str(tiny_sdxl_single_file.parent / "tokenizers")]
    args = train_util.parse_args(sdxl_train_network.setup_parser(), argv)
    assert args.text_encoder_lr == [1e-4, 1e-4] and args.max_token_length is None and args.optimizer_type == "AdamW8bit"
    trainer = sdxl_train_network.trainer()
    with caplog.at_level(logging.INFO):
        path = network_trainer.run(trainer, sdxl_train_network.setup_parser(),
                                   argv + ["--optimizer_type", "AdamW"])
    assert path == str(out / "gui_lora.safetensors")
    sd, md = read_lora(path)
    assert md["ss_steps"] == "2" and md["ss_network_dim"] == "8" and md["ss_lr_scheduler"] == "cosine"
    assert md["ss_mixed_precision"] == "fp16" and md["ss_text_encoder_lr"] == "0.0001"
    assert any(k.startswith("lora_te1_") for k in sd) and any(k.startswith("lora_te2_") for k in sd)
    assert len(trainer.losses) == 2
    assert "skipped keys of the kohya_ss GUI that are no trainer options" in caplog.text
    assert "epoch, noise_offset_type" in caplog.text


def test_kohya_ss_gui_default_optimizer_needs_its_package(tmp_path, tiny_sdxl_single_file, tiny_dataset_dir,
                                                           capsys):
    """The GUI's default optimizer (AdamW8bit) is accepted; without bitsandbytes the run stops with exit 2 and one
    line naming the package, before any model loads."""
    import importlib.util

    import sdxl_train_network

    if importlib.util.find_spec("bitsandbytes") is not None:
        pytest.skip("bitsandbytes is installed")
    out = tmp_path / "out"
    cfg = tmp_path / "config_lora.toml"
    text = kohya_ss_sdxl_lora_toml(tiny_sdxl_single_file, tiny_dataset_dir, out, "gui_lora")
    skip_if_not_yet(text)
    cfg.write_text(text)
    with pytest.raises(SystemExit) as e:
        sdxl_train_network.main(["--config_file", str(cfg)])
    assert e.value.code == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert "AdamW8bit" in line and "bitsandbytes" in line
