"""The textual-inversion target (train_textual_inversion.py, sdxl_train_textual_inversion.py): new tokens
`--token_string`, `<token_string>1`, ... (`--num_vectors_per_token` of them) are added to every tokenizer and their
rows to every text encoder's token-embedding table; only the embedding tables are trained, and after each
optimizer step every row below the new ones is put back, as upstream does. Saved in upstream's files: one tensor
per text encoder, `emb_params` (SD1.x/2.x) or `clip_l` + `clip_g` (SDXL), safetensors or torch (`.pt`/`.ckpt`).

Captions: `--use_object_template` / `--use_style_template` replace every caption by one of upstream's templates
around the tokens; otherwise the token string in a caption (and in the sample prompts) becomes all the tokens."""
from __future__ import annotations

import argparse
import copy
import logging
import os
from typing import Any

import torch

from library import config_util, files, saving, train_util
from library.errors import ConfigError
from library.network_trainer import Trainable

logger = logging.getLogger(__name__)

FILE_KEYS_SD = ("emb_params",)
FILE_KEYS_SDXL = ("clip_l", "clip_g")
ADAPTER = "textual-inversion"  # modelspec architecture suffix

# upstream's templates (the textual-inversion paper's "imagenet" templates)
OBJECT_TEMPLATES = (
    "a photo of a {}", "a rendering of a {}", "a cropped photo of the {}", "the photo of a {}",
    "a photo of a clean {}", "a photo of a dirty {}", "a dark photo of the {}", "a photo of my {}",
    "a photo of the cool {}", "a close-up photo of a {}", "a bright photo of the {}", "a cropped photo of a {}",
    "a photo of the {}", "a good photo of the {}", "a photo of one {}", "a close-up photo of the {}",
    "a rendition of the {}", "a photo of the clean {}", "a rendition of a {}", "a photo of a nice {}",
    "a good photo of a {}", "a photo of the nice {}", "a photo of the small {}", "a photo of the weird {}",
    "a photo of the large {}", "a photo of a cool {}", "a photo of a small {}",
)
STYLE_TEMPLATES = (
    "a painting in the style of {}", "a rendering in the style of {}", "a cropped painting in the style of {}",
    "the painting in the style of {}", "a clean painting in the style of {}", "a dirty painting in the style of {}",
    "a dark painting in the style of {}", "a picture in the style of {}", "a cool painting in the style of {}",
    "a close-up painting in the style of {}", "a bright painting in the style of {}",
    "a cropped painting in the style of {}", "a good painting in the style of {}",
    "a close-up painting in the style of {}", "a rendition in the style of {}", "a nice painting in the style of {}",
    "a small painting in the style of {}", "a weird painting in the style of {}",
    "a large painting in the style of {}",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Upstream's textual-inversion options (train_textual_inversion.py's own)."""
    saving.add_embedding_save_model_as_argument(parser)
    parser.add_argument("--weights", type=str, default=None,
                        help="an embedding file to start from (.safetensors or .pt; its vector count must equal "
                             "--num_vectors_per_token)")
    parser.add_argument("--num_vectors_per_token", type=int, default=1,
                        help="vectors (tokens) of the embedding: <token_string>, <token_string>1, ...")
    parser.add_argument("--token_string", type=str, default=None,
                        help="the new token the embedding is trained as; must not be a word of the tokenizer")
    parser.add_argument("--init_word", type=str, default=None,
                        help="the embedding starts as this word's (words') token embeddings, repeated or cut to "
                             "the vector count")
    parser.add_argument("--use_object_template", action="store_true",
                        help="ignore the captions: train on upstream's object templates ('a photo of a <token>')")
    parser.add_argument("--use_style_template", action="store_true",
                        help="ignore the captions: train on upstream's style templates ('a painting in the style "
                             "of <token>')")
    train_util.add_normaliser(parser, normalise_args)


def normalise_args(args) -> None:
    """Upstream: the output name defaults to the token string."""
    if getattr(args, "output_name", None) is None and getattr(args, "token_string", None):
        args.output_name = args.token_string


def token_strings(args) -> list[str]:
    """`hoge`, `hoge1`, `hoge2`, ...: the tokens added for --token_string hoge."""
    return [args.token_string] + [f"{args.token_string}{i + 1}" for i in range(args.num_vectors_per_token - 1)]


def load_embedding_file(path: str, keys: tuple[str, ...]) -> list[torch.Tensor | None]:
    """The vectors of an embedding file, one tensor [n, dim] (or None) per text encoder. SD (one key): upstream's
    `emb_params`, any single tensor, or the A1111 web UI's `string_to_param`; SDXL: `clip_l` / `clip_g`."""
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            data = load_file(path)
        else:
            data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is one line
        raise ConfigError(f"--weights {path}: cannot read the embedding file ({e})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"--weights {path}: not an embedding file (no tensors by name)")
    if len(keys) == 1:
        data = data.get("string_to_param", data)  # the web UI's layout
        tensors = [v for v in data.values() if isinstance(v, torch.Tensor)]
        if not tensors:
            raise ConfigError(f"--weights {path}: the file holds no tensor")
        found = [data["emb_params"] if isinstance(data.get("emb_params"), torch.Tensor) else tensors[0]]
    else:
        found = [data.get(k) for k in keys]
        if all(t is None for t in found):
            raise ConfigError(f"--weights {path}: the file has neither {' nor '.join(keys)} (an SDXL embedding has "
                              "both)")
    return [None if t is None else (t.unsqueeze(0) if t.dim() == 1 else t) for t in found]


class Embedding:
    """`keys`: the file's tensor names, one per text encoder (FILE_KEYS_SD, the default, or FILE_KEYS_SDXL)."""

    default_output_name = "last"  # (normalise_args makes it the token string, as upstream)
    tracker_name = "textual_inversion"
    dataset_kinds = (config_util.DREAMBOOTH, config_util.FINETUNING)
    lora = False

    def __init__(self, keys: tuple[str, ...] = FILE_KEYS_SD):
        self.keys = keys
        self.token_ids: list[list[int]] = []  # per text encoder, the new rows
        self.originals: list[torch.Tensor] = []  # per text encoder, the table as loaded (rows put back)
        self.tables: list[torch.nn.Parameter] = []

    # -- checks ------------------------------------------------------------------------------------------------
    def check_args(self, args, family_name: str) -> None:
        if not args.pretrained_model_name_or_path:
            raise ConfigError("--pretrained_model_name_or_path is required")
        if not args.token_string:
            raise ConfigError("--token_string is required: the new token the embedding is trained as (a word the "
                              "tokenizer does not have, e.g. --token_string mychar)")
        if any(c.isspace() for c in args.token_string):
            raise ConfigError(f"--token_string {args.token_string!r}: one word without spaces")
        if args.num_vectors_per_token < 1:
            raise ConfigError(f"--num_vectors_per_token must be 1 or more, got {args.num_vectors_per_token}")
        if args.weights:
            self._check_weights_file(args)
        if args.cache_text_encoder_outputs or getattr(args, "cache_text_encoder_outputs_to_disk", False):
            raise ConfigError("--cache_text_encoder_outputs cannot be used for textual inversion (the text "
                              "encoders' embeddings are what is trained)")
        if args.use_object_template and args.use_style_template:
            logger.warning("--use_object_template and --use_style_template: the object templates are used "
                           "(as upstream)")
        if getattr(args, "fp8_base", False):
            logger.warning("--fp8_base is not used by textual inversion (as upstream); ignored")
        if args.fused_backward_pass:
            logger.warning("--fused_backward_pass is not used by textual inversion (as upstream); ignored")

    def _check_weights_file(self, args) -> None:
        """--weights: readable, with this script's keys and --num_vectors_per_token vectors (the vector size is
        checked once the model is loaded)."""
        if not os.path.isfile(args.weights):
            raise ConfigError(f"--weights: file not found: {args.weights}")
        for key, vectors in zip(self.keys, load_embedding_file(args.weights, self.keys)):
            if vectors is not None and vectors.shape[0] != args.num_vectors_per_token:
                raise ConfigError(f"--weights {args.weights}: {key} has {vectors.shape[0]} vectors; "
                                  f"--num_vectors_per_token is {args.num_vectors_per_token}")

    def fp8_targets(self, args) -> tuple[bool, bool]:
        return False, False

    def output_ext(self, args, family) -> str:
        return "." + (args.save_model_as or "pt")

    def steps_in_backward(self, args) -> bool:
        return False

    def merge_base_weights(self, args, family, components) -> None:
        pass

    # -- captions and prompts ---------------------------------------------------------------------------------
    def prepare_dataset(self, args, groups: list) -> None:
        """Upstream's caption rewrite: a template around the tokens for every caption, or the token string
        expanded to all the tokens (several vectors)."""
        tokens = " ".join(token_strings(args))
        if args.use_object_template or args.use_style_template:
            templates = OBJECT_TEMPLATES if args.use_object_template else STYLE_TEMPLATES
            logger.info("captions: upstream's %s templates", "object" if args.use_object_template else "style")
            for g in groups:
                g.add_replacement("", [t.format(tokens) for t in templates])
        elif args.num_vectors_per_token > 1:
            for g in groups:
                g.add_replacement(args.token_string, tokens)

    def sample_args(self, args):
        """The sample prompts' token string stands for all the tokens (several vectors), as upstream."""
        if args.num_vectors_per_token <= 1:
            return args
        out = copy.copy(args)
        out.prompt_replacement = (args.token_string, " ".join(token_strings(args)))
        return out

    # -- what is trained ----------------------------------------------------------------------------------------
    def setup_trainable(self, args, accelerator, family, components, weight_dtype, caching_te: bool) -> Trainable:
        device = accelerator.device
        train_dtype = weight_dtype if (args.full_bf16 or args.full_fp16) else torch.float32
        text_encoders, tokenizers = list(components.text_encoders), list(components.tokenizers)
        if len(text_encoders) != len(self.keys):
            raise ConfigError(f"the model has {len(text_encoders)} text encoder(s); this script's embedding has "
                              f"{len(self.keys)} ({', '.join(self.keys)})")
        start = load_embedding_file(args.weights, self.keys) if args.weights else [None] * len(self.keys)
        self.token_ids, self.originals, self.tables = [], [], []
        for i, (tok, te, vectors) in enumerate(zip(tokenizers, text_encoders, start)):
            ids = self._add_tokens(args, i, tok, te)
            table = te.get_input_embeddings().weight
            with torch.no_grad():
                if vectors is not None:
                    if vectors.shape[0] != len(ids) or vectors.shape[1] != table.shape[1]:
                        raise ConfigError(f"--weights {args.weights}: {self.keys[i]} has {vectors.shape[0]} vectors "
                                          f"of size {vectors.shape[1]}; this run needs {len(ids)} "
                                          f"(--num_vectors_per_token) of size {table.shape[1]}")
                    table[ids] = vectors.to(table.dtype)
            te.requires_grad_(False)
            te.to(device, dtype=train_dtype)
            table = te.get_input_embeddings().weight
            table.requires_grad_(True)
            te.train()
            self.token_ids.append(ids)
            self.tables.append(table)
            self.originals.append(table.detach().clone())
        if args.weights:
            logger.info("embedding loaded from %s", args.weights)
        logger.info("training %d vector(s) for %s: token ids %s", args.num_vectors_per_token, args.token_string,
                    "; ".join(str(ids) for ids in self.token_ids))

        denoiser = components.denoiser
        denoiser.requires_grad_(False)
        family.place_denoiser(args, components, device, weight_dtype, False)
        if args.gradient_checkpointing:
            family.enable_gradient_checkpointing(args, components, text_encoders)
        denoiser.train(args.gradient_checkpointing)
        groups = [{"params": list(self.tables), "lr": args.learning_rate}]
        return Trainable(models=text_encoders, param_groups=groups, train_text_encoder=True)

    @staticmethod
    def _add_tokens(args, index: int, tokenizer, text_encoder) -> list[int]:
        """Adds the tokens at the end of the tokenizer and the table; their rows start as --init_word's."""
        strings = token_strings(args)
        init_ids = tokenizer.encode(args.init_word, add_special_tokens=False) if args.init_word else None
        if init_ids is not None and not init_ids:
            raise ConfigError(f"--init_word {args.init_word!r}: no tokens in tokenizer {index + 1}")
        if init_ids and len(init_ids) > 1 and len(init_ids) != len(strings):
            logger.info("--init_word has %d tokens in tokenizer %d, --num_vectors_per_token %d: repeated or cut",
                        len(init_ids), index + 1, len(strings))
        added = tokenizer.add_tokens(strings)
        if added != len(strings):
            raise ConfigError(f"--token_string {args.token_string}: tokenizer {index + 1} already has this word "
                              f"(or {args.token_string}1, ...); choose another token string")
        ids = tokenizer.convert_tokens_to_ids(strings)
        if ids != list(range(len(tokenizer) - len(strings), len(tokenizer))):
            raise ConfigError(f"--token_string {args.token_string}: tokenizer {index + 1} gave ids {ids}, not the "
                              "last ones; choose another token string")
        text_encoder.resize_token_embeddings(len(tokenizer))
        # the pooled output is taken at the first EOS; CLIP configs with the legacy eos id 2 would take it at the
        # highest id, now a new token
        inner = getattr(text_encoder, "text_model", None)
        if inner is not None and hasattr(inner, "eos_token_id"):
            inner.eos_token_id = tokenizer.eos_token_id
        text_encoder.config.eos_token_id = tokenizer.eos_token_id
        if init_ids:
            with torch.no_grad():
                table = text_encoder.get_input_embeddings().weight
                for k, token_id in enumerate(ids):
                    table[token_id] = table[init_ids[k % len(init_ids)]]
        return ids

    def optimizer_param_groups(self, args, family, components, trainable: Trainable) -> list[list[dict]]:
        return [trainable.param_groups]

    def after_prepare(self, args, accelerator, trainable: Trainable, optimizers: list) -> None:
        """After every optimizer step, the rows below the new tokens are put back (weight decay and the optimizer's
        state touch them), as upstream."""
        inner = getattr(optimizers[0], "optimizer", optimizers[0])
        inner.register_step_post_hook(lambda *_: self.restore_fixed_rows())

    def restore_fixed_rows(self) -> None:
        with torch.no_grad():
            for table, original, ids in zip(self.tables, self.originals, self.token_ids):
                table[:ids[0]] = original[:ids[0]].to(table.dtype)

    def on_step_start(self, args) -> None:
        pass

    def on_epoch_start(self, args, family, trainable: Trainable, components) -> None:
        pass

    def keep_training_text_encoder(self, args, global_step: int, components) -> bool:
        return True

    def metadata(self, args, md: dict[str, str]) -> dict[str, str]:
        return md

    def method_metadata(self, args) -> dict[str, Any]:
        return {}

    # -- the file -------------------------------------------------------------------------------------------------
    def vectors(self) -> dict[str, torch.Tensor]:
        """The trained vectors by file key, [n, dim] each."""
        return {key: table[ids].detach().clone() for key, table, ids in zip(self.keys, self.tables, self.token_ids)}

    def save_model(self, args, accelerator, trainable: Trainable, family, components, md, path, epoch, step,
                   modelspec) -> None:
        """Upstream's file: the vectors (at --save_precision) and, in a .safetensors file, the modelspec keys
        (architecture .../textual-inversion) as upstream writes them; a .pt/.ckpt file is a plain dict."""
        tensors = self.vectors()
        dtype = train_util.save_dtype_for(args)
        tensors = {k: v.to("cpu", dtype=dtype or v.dtype) for k, v in tensors.items()}
        if path.endswith(".safetensors"):
            spec = dict(modelspec)
            spec["modelspec.architecture"] = spec["modelspec.architecture"] + "/" + ADAPTER
            files.save_safetensors(tensors, path, spec, overwrite=args.overwrite_output)
        else:
            files.save_torch(tensors, path, overwrite=args.overwrite_output)
        logger.info("saved %s", path)
