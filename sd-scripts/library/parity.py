"""Where our trainer scripts' options knowingly differ from kohya-ss/sd-scripts (upstream), in one place.

Upstream's option tables (`../shared/parity/upstream-flags/<script>.json`) are the specification: every
upstream option parses here with the same option strings, type, default, choices and nargs, and does what
upstream's does. The exceptions are the tables below; `tests/test_upstream_parity.py` checks the parsers
against upstream with them, and `tools/gen_parity.py` renders them into `docs/PARITY.md`.

- REFUSED: accepted with upstream's type and default (so an upstream config that leaves them at their
  defaults runs), but a non-default value stops the run before anything loads: exit 2 with the reason and
  what to use instead (`refusal_message`, checked by `train_util.parse_args`).
- DIFFERENT: parsed (or behaving) differently on purpose, each with its reason.
- NOT_YET: upstream options not (yet) at parity here. The test fails when one of them has in fact reached
  parity, so the table cannot go stale: remove the name when its option lands.
- KOHYA_SS_GUI_KEYS / CONFIG_VALUE_ALIASES: what `--config_file` (train_util.load_config_file) accepts from
  the kohya_ss GUI's run TOMLs beyond the options themselves.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

# the trainer scripts, as upstream names them
SCRIPTS = ("sdxl_train_network", "train_network", "flux_train_network", "sdxl_train", "train_db", "fine_tune",
           "flux_train", "sd3_train_network", "sd3_train", "train_textual_inversion", "sdxl_train_textual_inversion",
           "lumina_train_network", "lumina_train", "hunyuan_image_train_network")
SCRIPTS += ("anima_train_network", "anima_train")  # Anima (library/families/anima.py; anima_train's table: tools/)

# upstream scripts (their option tables in ../shared/parity/upstream-flags/) that are not here yet, with their status;
# every upstream table is one of SCRIPTS, TOOLS or these (tests/test_upstream_parity.py)
SCRIPTS_NOT_YET: dict[str, str] = {
    "tools__convert_diffusers_to_flux": "not yet: diffusers FLUX.1 folder to a single BFL file; the trainers read "
                                        "diffusers folders directly",
    "tools__resize_images_to_resolution": "not yet: the trainers' buckets resize on the fly, and "
                                          "prepare_buckets_latents.py writes resized latents",
}

# option -> why it is refused and what to use instead
REFUSED: dict[str, str] = {
    "dataset_class": ("custom dataset classes are written against upstream's internal dataset classes, which "
                      "this project does not have; describe the data with --dataset_config (TOML), "
                      "--train_data_dir or --in_json instead"),
}


@dataclass(frozen=True)
class Different:
    """An option that differs from upstream on purpose. `fields` names what the parser declares differently
    ("default", "choices", "type", "nargs", "action", "opts"); empty = parsed as upstream, behaves differently."""

    reason: str
    fields: tuple[str, ...] = ()


_NO_DDP = ("accepted and without effect: the trained modules are not wrapped in DistributedDataParallel (a LoRA "
           "network's forward is never called, so DDP would never synchronise it); library/data_parallel.py "
           "averages the gradients instead")

DIFFERENT: dict[str, Different] = {
    "deepspeed": Different(
        "needs the deepspeed package (install extra 'deepspeed'); without it one line naming the extra, exit 2 "
        "(upstream: an error log, exit 1). Not with --fsdp, the fused backward pass / optimizer groups or "
        "--blocks_to_swap (DeepSpeed steps the optimizer itself). `accelerate launch --use_deepspeed` counts as "
        "--deepspeed with its ZeRO stage and offload devices; on a machine without a GPU the processes join over "
        "gloo (DeepSpeed's CPU accelerator)"),
    "zero_stage": Different(
        "0, 1 and 2 as upstream; 3 is refused for now (the model is saved from the processes' whole weights): "
        "--fsdp full_shard shards the weights too (library/sharding.py)"),
    "zero3_init_flag": Different("accepted; ZeRO stage 3 is refused for now (see --zero_stage)"),
    "zero3_save_16bit_model": Different("accepted; ZeRO stage 3 is refused for now (see --zero_stage)"),
    "network_module": Different(
        "networks.dylora/lora_fa/oft stop on FLUX.1 and networks.oft_flux on SD/SDXL before anything loads "
        "(upstream's find no target layers of the other architecture); networks.dylora names SDXL's encoders "
        "lora_te1_/lora_te2_ (upstream names both lora_te_, so its file keeps only the second), draws the rank "
        "from torch's generator and samples at full rank; networks.oft/oft_flux read enable_all_linear/enable_conv "
        "as true/false (upstream enables on any value) and oft_flux takes the part sizes from the model (upstream "
        "hard-codes FLUX.1's)"),
    "weights": Different("textual inversion: an SDXL file with only clip_l or only clip_g sets that encoder's vectors "
                         "and the other's start from --init_word (upstream stops), and a file whose vector count or "
                         "size does not fit is one line naming both (upstream asserts)"),
    "ddp_gradient_as_bucket_view": Different(_NO_DDP),
    "ddp_static_graph": Different(_NO_DDP),
    "v_parameterization": Different(
        "not needed for a diffusers folder whose scheduler says prediction_type v_prediction: such a model trains "
        "as v-prediction (and its metadata says v) without the flag, with a log line saying so; upstream trains it "
        "as epsilon unless --v_parameterization is given, which wrecks a v-prediction model. Single files and "
        "epsilon folders train as upstream (epsilon unless the flag)"),
    "v_pred_like_loss": Different("train_db.py and fine_tune.py apply it as the other scripts do (upstream parses it "
                                  "there but never applies it)"),
    "huber_schedule": Different("FLUX with --loss_type huber/smooth_l1 and the snr schedule (a DDPM schedule) is "
                                "refused before anything loads; upstream raises at the first step"),
    "validation_split": Different("the training and validation images are disjoint (upstream's rounding can put one "
                                  "image in both); a metadata_file (fine-tune) subset is not split (upstream "
                                  "validates on the whole of it)"),
    "validate_every_n_steps": Different("each logged validation average is that of one pass (upstream's first "
                                        "epoch averages all passes so far); FLUX validates at the fixed timesteps "
                                        "(sigma = t / 1000), which upstream's FLUX path ignores (random sigmas)"),
    "no_token_padding": Different(
        "does what its help says (captions padded only to the longest one in the batch, as diffusers' "
        "DreamBooth); upstream's current train_db.py parses it but no longer applies it"),
    "debug_dataset": Different(
        "logs every batch of the first epoch (captions as served, sizes, crops) and ends without loading a "
        "model; upstream also shows the images in a window on Windows and loops over the epochs until Escape"),
    "weighted_captions": Different(
        "FLUX.1: a warning and captions encoded as written (upstream's flux_train.py ignores it and "
        "flux_train_network.py stops with NotImplementedError unless text-encoder outputs are cached); Lumina 2: "
        "the same warning, captions encoded as written as upstream does; HunyuanImage 2.1 too"),
    # Anima (anima_train_network.py; library/families/anima.py)
    "split_attn": Different("Anima: accepted without effect: the DiT's attention has no padding mask, so one batched "
                            "SDPA call serves (upstream splits the batch to save memory, and needs it for xformers)"),
    "vae_disable_cache": Different("Anima: accepted without effect (upstream's own VAE code's feature cache)"),
    "caption_dropout_rate": Different(
        "with --cache_text_encoder_outputs it stops before anything loads (cached outputs need fixed captions); "
        "upstream's Anima script caches the rate and blanks cached outputs per step instead"),
    "learning_rate": Different("anima_train.py: 0, or every part of the DiT at rate 0 (--self_attn_lr ...), stops "
                               "before anything loads (upstream trains and saves nothing)"),
    "unsloth_offload_checkpointing": Different(
        "Anima: the checkpointed blocks' inputs go to CPU memory through the same offloading checkpoint as "
        "--cpu_offload_checkpointing (upstream: Unsloth's non-blocking copies); the same rules (turns on "
        "--gradient_checkpointing, not with --cpu_offload_checkpointing or --blocks_to_swap)"),
    # Lumina 2 (lumina_train_network.py / lumina_train.py; library/families/lumina.py)
    "use_flash_attn": Different(
        "Lumina 2: without the flash-attn package the run stops with one line naming it (upstream fails when the "
        "first attention runs); with it, attention runs through PyTorch's SDPA, which uses FlashAttention kernels"),
    "use_sage_attn": Different("Lumina 2: accepted, with a warning, and training keeps PyTorch's SDPA (upstream: Sage "
                               "Attention is inference-only and its backward is unsupported)"),
    "sample_batch_size": Different("Lumina 2: accepted; sample prompts are drawn one at a time (upstream batches "
                                   "prompts of the same size, scale and seed)"),
    "blocks_to_swap": Different("lumina_train.py stops on a value above 0 (no block swap in Lumina 2 full "
                                "fine-tunes yet); HunyuanImage 2.1 swaps as many blocks as upstream (n // 2 + "
                                "2 * (n - n // 2)) but the last ones in execution order (upstream: n // 2 double "
                                "and the rest single blocks); the other scripts swap as upstream"),
    "block_lr": Different("a UNet block at rate 0 is frozen (upstream leaves it trainable outside the optimizer: "
                          "its gradients are computed, never applied nor cleared, and count in the clipping norm)"),
    "fused_backward_pass": Different("the full trainers refuse it with --mixed_precision fp16 before anything loads "
                                     "(the loss scaler needs all gradients before a step); train_db.py and "
                                     "fine_tune.py fuse too (upstream checks it there but steps after backward)"),
    "fused_optimizer_groups": Different("refused with --mixed_precision fp16 (upstream's GradScaler would unscale and "
                                        "update once per group); flux_train accepts it without effect, as upstream"),
    "lr_scheduler": Different("reduce_lr_on_plateau and cosine_warmup_with_min_lr, and a warmup with constant, "
                              "adafactor or --lr_scheduler_type, stop before anything loads with the reason "
                              "(upstream fails when it builds the scheduler)"),
    "optimizer_type": Different("schedule-free optimizers hold their evaluation weights for sampling and saving in "
                                "every script (upstream: the LoRA and FLUX scripts), switched only around them "
                                "(upstream switches every step, which changes only rounding); --optimizer_args "
                                "true/false are booleans (upstream needs True/False)"),
    "save_model_as": Different(
        "full trainers, unset: a single-file base model keeps its serialization (.safetensors stays .safetensors; "
        "upstream's code writes .ckpt unless --use_safetensors, against its own help \"same as the original\"); "
        "diffusers and diffusers_safetensors both write safetensors weights (upstream: .bin for diffusers), which "
        "every diffusers/transformers version loads; flux_train.py writes a BFL .safetensors whatever is given, as "
        "upstream, and anima_train.py its `net.` single file (with a warning)"),
    "huggingface_path_in_repo": Different(
        "unset: each saved file or folder goes to the repo under its own name (upstream passes no path: a file "
        "upload fails and a folder's files land at the repo's top level, mixing the states)"),
    "initial_step": Different(
        "the step counter starts at the step (with --skip_until_initial_step) or at the first step of the start "
        "epoch (without it); upstream restarts the counter at 0, or after skipping whole epochs at the remainder "
        "only, so its step numbers and the max_train_steps limit drift"),
    "initial_epoch": Different(
        "epochs count this process's batches (upstream divides the per-process batch count by the number of "
        "processes a second time); the step counter as for --initial_step"),
    "conditioning_data_dir": Different(
        "with --masked_loss the flag gives the --train_data_dir images their masks (upstream reads it only from "
        "[[datasets.subsets]] outside its ControlNet scripts); a mask image goes through its image's own resize "
        "and crop (upstream stretches it to the bucket, off its image when their aspect ratios differ)"),
    "vae_batch_size": Different("batches the latent cache; training without a cache encodes each batch at once "
                                "(upstream encodes it in vae_batch_size chunks: the same latents, slower)"),
    "enable_bucket": Different("without buckets, an image neither of the resolution's size nor cut by "
                               "random_crop / face_crop_aug_range is resized to cover it and centre-cropped, "
                               "conditioned as in a bucket (upstream stops with an assertion)"),
    "bucket_no_upscale": Different("an image smaller than bucket_reso_steps stops with a clear error (upstream "
                                   "gives it a bucket of width or height 0)"),
    "cache_latents_to_disk": Different(
        "upstream's file names and keys; our files also record the encoding model, and are encoded again for "
        "another model, another bucket size or a newer image (upstream's files are reused as upstream reuses them; "
        "--skip_cache_check reuses any existing file)"),
    "cache_text_encoder_outputs_to_disk": Different(
        "upstream's SDXL, FLUX.1, Lumina 2 and HunyuanImage 2.1 file layouts; our files also record the caption and model and are encoded again "
        "when either changes (upstream reuses a file for a changed caption)"),
    "fp8_base": Different(
        "LoRA scripts: only the Linear weights are stored in float8 (convolutions, norms, embeddings and T5's wo "
        "keep the training dtype) and upcast per layer, so it also trains without --mixed_precision (upstream "
        "asserts fp16/bf16); with --fp8_base the text encoders are fp8 on the CPU too. Full fine-tunes ignore it, "
        "as upstream does, with a warning"),
    "fp8_base_unet": Different("as --fp8_base: the UNet/DiT's Linear weights only, upcast per layer"),
    "cpu_offload_checkpointing": Different(
        "works for every model here (SD/SDXL UNets too, where upstream's own UNets fail with it): the inputs of "
        "each checkpointed block are kept in CPU memory; with --compile the compiled blocks run inside the "
        "offloading checkpoint (the CUDA-graph compile modes are refused)"),
    "torch_compile": Different(
        "regional compilation of the repeated transformer blocks (as --compile, logged), not accelerate's "
        "whole-model torch.compile; the SD1.x/SD2.x scripts get it too"),
    "dynamo_backend": Different(
        "'no' is accepted as well (the kohya_ss GUI writes it; upstream's TOML reader lets it through) and means "
        "no compile; inductor, aot_eager, eager and cudagraphs compile, the other upstream choices are refused "
        "with a clear error (not available in current torch)"),
    "console_log_simple": Different(
        "the default log here is plain text on stdout (time, level, logger: message; upstream: rich on stderr); "
        "simple = the message alone, as upstream"),
    "console_log_file": Different("the file gets the default line format (upstream's: the message alone) unless "
                                  "--console_log_simple"),
    "model_type": Different("chroma as upstream's flux_train_network.py (T5-XXL only, --apply_t5_attn_mask "
                            "required, --clip_l ignored, LoRA keys and modelspec as upstream); it also reads "
                            "diffusers ChromaPipeline folders, and flux_train.py fine-tunes Chroma with it (upstream's "
                            "flux_train.py ignores --model_type and loads FLUX.1)"),
    "diffusers_xformers": Different("sdxl_train.py: the UNet too (a diffusers UNet here), not only the VAE"),
    # SD3 / SD3.5 (sd3_train_network.py, sd3_train.py)
    "t5xxl_max_token_length": Different(
        "SD3 scripts: unset = 256, upstream's default (one declaration, library/dit_options.py, serves FLUX.1, whose "
        "unset means 512 for dev / 256 for schnell, and SD3; the GUI shares the field)", ("default",)),
    "use_t5xxl_cache_only": Different(
        "T5-XXL is read only to make the cache entries that are missing (upstream loads it every run), so with the "
        "cache on disk its file may be absent; sample images are drawn without T5-XXL (its part zeros; upstream "
        "encodes the sample prompts with it before freeing it)"),
    "pos_emb_random_crop_rate": Different(
        "SD3: the random crop is drawn in training steps only (upstream also crops at random while sampling and "
        "validating)"),
    "weighting_scheme": Different(
        "SD3: as upstream; timesteps are drawn from the run's generator (saved with --save_state) and --ip_noise_gamma "
        "is ignored as upstream's SD3 script ignores it"),
    "clip_g": Different(
        "SD3: CLIP-L/CLIP-G/T5-XXL also come from a diffusers StableDiffusion3Pipeline folder given as "
        "--pretrained_model_name_or_path (upstream reads SAI single files only); the models are diffusers' "
        "SD3Transformer2DModel and transformers' CLIP/T5 classes, saved in upstream's SAI layout"),
    # HunyuanImage 2.1 (hunyuan_image_train_network.py; library/families/hunyuan_image.py)
    "attn_mode": Different(
        "HunyuanImage 2.1: torch/sdpa as upstream (PyTorch SDPA with the text mask); xformers and flash need their "
        "package (one line naming it otherwise) and then also run through SDPA, which picks its memory-efficient / "
        "flash kernels itself; sageattn stops before anything loads (upstream: inference only). Anima: every mode "
        "runs PyTorch's SDPA, sageattn stops the same way"),
    "fp8_scaled": Different(
        "HunyuanImage 2.1: the double/single blocks' Linear weights stored in float8 and upcast per layer, as "
        "--fp8_base does (upstream quantises with per-block scales and, on supported GPUs, runs scaled fp8 matmuls)"),
    "fp8_vl": Different("HunyuanImage 2.1: Qwen2.5-VL's Linear weights stored in float8 and upcast per layer "
                        "(upstream also keeps its norms and residual sums in float32)"),
    "vae_chunk_size": Different(
        "HunyuanImage 2.1: any value switches diffusers' tiled VAE encode/decode on (upstream chunks each convolution "
        "along the height by that many rows); both save memory, tiles blend at their seams. Anima: accepted "
        "without effect (it tunes upstream's own copy of the Qwen-Image VAE; diffusers' AutoencoderKLQwenImage "
        "encodes each image whole)"),
    "text_encoder": Different(
        "HunyuanImage 2.1: Qwen2.5-VL's language model from upstream's file (its vision tower is not loaded: "
        "prompts are text only); its tokenizer from --tokenizer_cache_dir (a saved tokenizer or the hub cache) as "
        "upstream. byT5's tokenizer is the byte tokenizer without the glyph model's added <color-N>/<font-N> tokens "
        "(no caption uses them; the file's larger embedding table loads as it is). The script also requires "
        "--network_train_unet_only (one line without it, as upstream's guide says: it trains no text-encoder LoRA) "
        "and honours --no_half_vae (a float32 VAE; upstream's keeps float16)"),
    "sample_prompts": Different(
        "SD3 samples come from diffusers' StableDiffusion3Pipeline over the live models: Euler on the discrete flow "
        "with shift 3.0 and CFG, as upstream's SD3 sampler (defaults --s 30, --l 7.5; no --n = an empty negative "
        "prompt). HunyuanImage 2.1 samples as upstream's sampler (Euler on the shifted flow, --fs flow shift 5.0, "
        "CFG then its adaptive projected guidance, defaults --s 20, --l 3.5)"),
}



# upstream options not at parity yet (missing, or parsed differently until their owner lands them);
# one name per line, remove it when the option lands
NOT_YET: frozenset[str] = frozenset({
})


# Keys the kohya_ss GUI writes into its run TOMLs that are no option of upstream's scripts. Upstream's
# --config_file takes any key without a word; ours stops at an unknown key (naming the closest one), except at
# these, which are skipped with a log line. key -> what it is
KOHYA_SS_GUI_KEYS: dict[str, str] = {
    "epoch": "the GUI's epoch count (always written); the trainer reads max_train_epochs / max_train_steps",
    "noise_offset_type": "the GUI's choice between noise_offset and multires_noise_* (always written); the GUI "
                         "writes only the chosen options",
    "additional_parameters": "extra command-line text, which the GUI appends to the command",
    "train_inpainting": "a GUI checkbox that upstream's scripts do not read",
    "show_timesteps": "a GUI option of upstream scripts other than these seven",
    "show_timesteps_resolution": "a GUI option of upstream scripts other than these seven",
}

# Values the kohya_ss GUI writes that upstream reads although its parser refuses them on the command line
# (argparse checks no choices of config-file values): key -> {value as written: value here}
CONFIG_VALUE_ALIASES: dict[str, dict] = {
    "max_token_length": {75: None},  # the default, 75 tokens, written out; upstream reads it as 75 tokens
    "cuda_graph_step": {True: "on", False: "off"},  # a switch before it had auto: files that say true / false
}


def add_refused_arguments(parser: argparse.ArgumentParser) -> None:
    """--dataset_class, with upstream's type and default (refused unless left at it, see REFUSED)."""
    parser.add_argument("--dataset_class", type=str, default=None, help="refused: " + REFUSED["dataset_class"])


def refused_options_set(args: argparse.Namespace) -> list[str]:
    """The refused options given a value other than upstream's default."""
    probe = argparse.ArgumentParser(add_help=False)
    add_refused_arguments(probe)
    defaults = {a.dest: a.default for a in probe._actions}
    return [name for name in REFUSED if getattr(args, name, defaults[name]) != defaults[name]]


def refusal_message(args: argparse.Namespace) -> str | None:
    """One line naming the refused options that were set and what to use instead, or None."""
    names = refused_options_set(args)
    if not names:
        return None
    reasons = dict.fromkeys(REFUSED[n] for n in names)  # ordered, without repeats
    return f"{', '.join('--' + n for n in names)}: {'; '.join(reasons)}"


# -- the LoRA tool scripts (sd-scripts/networks/*.py, issue 27) -----------------------------------------------
# upstream's option table name (../shared/parity/upstream-flags/<name>.json) -> our script (joins TOOLS below)
LORA_TOOLS: dict[str, str] = {
    "networks__resize_lora": "networks/resize_lora.py",
    "networks__merge_lora": "networks/merge_lora.py",
    "networks__sdxl_merge_lora": "networks/sdxl_merge_lora.py",
    "networks__flux_merge_lora": "networks/flux_merge_lora.py",
    "networks__svd_merge_lora": "networks/svd_merge_lora.py",
    "networks__extract_lora_from_models": "networks/extract_lora_from_models.py",
    "networks__flux_extract_lora": "networks/flux_extract_lora.py",
    "networks__extract_lora_from_dylora": "networks/extract_lora_from_dylora.py",
    "networks__check_lora_weights": "networks/check_lora_weights.py",
    "networks__convert_flux_lora": "networks/convert_flux_lora.py",
}


def _upstream_option(flag: str, default: str, type_: str | None = "str") -> dict:
    return {"opts": [flag], "type": type_, "default": default, "choices": None, "nargs": None,
            "action": "_StoreAction"}


# upstream's convert_flux_lora.py builds its parser under `if __name__ == "__main__"`, so the shared tables have
# none: its four options, as upstream 48d368f declares them
UPSTREAM_TABLES_BY_HAND: dict[str, dict[str, dict]] = {
    "networks__convert_flux_lora": {
        "src": _upstream_option("--src", "'ai-toolkit'"), "dst": _upstream_option("--dst", "'sd-scripts'"),
        "src_path": _upstream_option("--src_path", "None"), "dst_path": _upstream_option("--dst_path", "None"),
    },
}

_NO_OVERWRITE = ("an existing output file stops the tool (exit 2) unless --overwrite is given (upstream "
                 "overwrites it)")
_GPU_DEFAULT = "unset = the GPU when there is one (upstream: the CPU); the SVDs run batched in float32 there"

# tool -> option -> Different (the same option name means different things in different tools)
_LORA_TOOL_DIFFERENT: dict[str, dict[str, Different]] = {
    "networks__resize_lora": {"save_to": Different(_NO_OVERWRITE), "device": Different(_GPU_DEFAULT)},
    "networks__merge_lora": {
        "save_to": Different(_NO_OVERWRITE),
        "sd_model": Different("a diffusers folder is read too (the trainers' loader); a LoRA of another family "
                              "stops the tool before the model loads (upstream skips its modules one by one); the "
                              "merge runs on the GPU when there is one (upstream: the CPU)"),
    },
    "networks__sdxl_merge_lora": {
        "save_to": Different(_NO_OVERWRITE),
        "sd_model": Different("a diffusers folder is read too (the trainers' loader); a LoRA of another family "
                              "stops the tool before the model loads; the merge runs on the GPU when there is one "
                              "(upstream: the CPU)"),
        "ratios": Different("OFT files are merged at their ratio (upstream merges OFT at 1 whatever the ratio)"),
    },
    "networks__flux_merge_lora": {
        "save_to": Different(_NO_OVERWRITE),
        "flux_model": Different("a diffusers folder is read too (written as a BFL file); BFL files with the "
                                "model.diffusion_model. prefix keep it and are matched without it"),
        "diffusers": Different("LoRAs in diffusers / ai-toolkit layout are found by their keys and converted to "
                               "kohya's first, with or without the flag, also for --clip_l and LoRA-to-LoRA merges"),
        "mem_eff_load_save": Different("accepted, no effect: the files are memory-mapped and written atomically"),
        "models": Different("LoRA-to-LoRA merges write ss_network_module networks.lora_flux (upstream: "
                            "networks.lora)"),
    },
    "networks__svd_merge_lora": {"save_to": Different(_NO_OVERWRITE), "device": Different(_GPU_DEFAULT)},
    "networks__extract_lora_from_models": {
        "save_to": Different(_NO_OVERWRITE), "device": Different(_GPU_DEFAULT),
        "load_precision": Different("unset = the dtype a single file stores, as upstream; a diffusers folder "
                                    "(which upstream does not read) loads in float32"),
        "v_parameterization": Different("default None = the same as --v2, as upstream's code and help say (the "
                                        "shared table records False)", ("default",)),
        "load_original_model_to": Different("every family (upstream: SDXL only); unset = --device's choice "
                                            "(upstream: the CPU)"),
        "load_tuned_model_to": Different("every family (upstream: SDXL only); unset = --device's choice "
                                         "(upstream: the CPU)"),
    },
    "networks__flux_extract_lora": {
        "save_to": Different(_NO_OVERWRITE), "device": Different(_GPU_DEFAULT),
        "model_org": Different("a diffusers folder is read too; BFL files are read one tensor at a time onto "
                               "--device, with or without the model.diffusion_model. prefix"),
        "mem_eff_safe_open": Different("accepted, no effect: the files are always read one tensor at a time"),
    },
    "networks__extract_lora_from_dylora": {
        "save_to": Different(_NO_OVERWRITE + "; each file's metadata gets its own sshs_* hashes (upstream "
                             "computes them into the input's metadata, so they are never written)"),
    },
    "networks__check_lora_weights": {
        "show_all_keys": Different("the other keys follow the LoRA keys once (upstream lists the LoRA keys twice)"),
    },
    "networks__convert_flux_lora": {
        "dst_path": Different(_NO_OVERWRITE),
        "dst": Different("every FLUX.1 Linear module and CLIP-L's are converted, block counts and widths from "
                         "the file (upstream: the 19 + 38 blocks' modules only, FLUX.1's width 3072 assumed); "
                         "alpha / rank is folded into both matrices as its square root (upstream: into lora_A "
                         "mostly): the same product"),
    },
}


# ----------------------------------------------------------------------------------------------------------
# Tool scripts (captioning, dataset and LoRA tools): upstream's table name -> our script (path under sd-scripts/).
# Their differences are per script (their option names repeat the trainers' with other meanings):
# TOOL_DIFFERENT[table][option]. tools/gen_parity.py renders them under "Tool scripts" in docs/PARITY.md.
TOOLS: dict[str, str] = {
    "finetune__tag_images_by_wd14_tagger": "finetune/tag_images_by_wd14_tagger.py",
    "finetune__make_captions": "finetune/make_captions.py",
    "finetune__make_captions_by_git": "finetune/make_captions_by_git.py",
    "finetune__merge_captions_to_metadata": "finetune/merge_captions_to_metadata.py",
    "finetune__merge_dd_tags_to_metadata": "finetune/merge_dd_tags_to_metadata.py",
    "finetune__clean_captions_and_tags": "finetune/clean_captions_and_tags.py",
    "finetune__prepare_buckets_latents": "finetune/prepare_buckets_latents.py",
    **LORA_TOOLS,
}

_NEW_CAPTIONS = ("an existing caption file stops the run (exit 2, nothing written) unless --overwrite or "
                 "--skip_existing (ours) is given; upstream replaces it without a word")
TOOL_DIFFERENT: dict[str, dict[str, Different]] = {
    "finetune__tag_images_by_wd14_tagger": {
        "repo_id": Different("the same default: upstream's table holds the constant's name "
                             "(DEFAULT_WD14_TAGGER_REPO = SmilingWolf/wd-v1-4-convnext-tagger-v2); a local folder "
                             "with model.onnx and selected_tags.csv is also accepted", ("default",)),
        "onnx": Different("the ONNX model always runs (through onnxruntime): the TensorFlow/Keras models upstream "
                          "runs without --onnx are not supported"),
        "append_tags": Different(_NEW_CAPTIONS + "; --append_tags adds to it as upstream"),
        "tag_replacement": Different("each source tag is replaced (upstream's loop compares against the pair it "
                                     "just split, so its replacement does nothing)"),
    },
    "finetune__make_captions": {
        "caption_weights": Different("a transformers BLIP model (Hub id or folder): upstream's default URL of "
                                     "model_large_caption.pth reads as Salesforce/blip-image-captioning-large (the "
                                     "same weights converted); other original .pth checkpoints stop with the reason"),
        "caption_extension": Different(_NEW_CAPTIONS),
    },
    "finetune__make_captions_by_git": {
        "caption_extension": Different(_NEW_CAPTIONS),
    },
    "finetune__prepare_buckets_latents": {
        "recursive": Different("each image's cache file lies next to it, where the trainers look (upstream writes "
                               "the files of subfolder images into train_data_dir without --full_path)"),
        "skip_existing": Different("the trainers' cache files (`<image>_<W>x<H>_sd.npz` / `_sdxl.npz`, or an "
                                   "existing `<image>.npz`) are written and reused; upstream's current script "
                                   "encodes but writes nothing"),
    },
    **_LORA_TOOL_DIFFERENT,
}
