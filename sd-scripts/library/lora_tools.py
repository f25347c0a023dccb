"""What the LoRA tool scripts (networks/resize_lora.py, merge_lora.py, sdxl_merge_lora.py, flux_merge_lora.py,
svd_merge_lora.py, extract_lora_from_models.py, flux_extract_lora.py, extract_lora_from_dylora.py,
check_lora_weights.py, convert_flux_lora.py) share: running a tool (--dump_options, one-line errors, exit 2),
reading and writing LoRA files (hashes, metadata), grouping a LoRA state dict into modules, effective weights,
batched SVD on the GPU, upstream's rank rules and clamping, LoRA families, layer maps of SD/SDXL models, the
layer-block weights (--lbws) and the modelspec metadata of merged files.

Upstream's semantics are the specification (kohya-ss/sd-scripts networks/*.py); the code is our own.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from library.errors import UserError

logger = logging.getLogger(__name__)

PRECISIONS = {"float": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# upstream resize_lora.py: the three naming schemes of the two LoRA matrices (kohya, PEFT, ControlLoRA)
DOWN_UP_NAMES = (("lora_down", "lora_up"), ("lora_A", "lora_B"), ("down", "up"))
MIN_SV = 1e-6  # upstream: a LoRA whose largest singular value is this small is a zero matrix (rank 1)
DYNAMIC_METHODS = ("sv_ratio", "sv_fro", "sv_cumulative")
FAMILY_NAMES = {"sd": "SD1.x/SD2.x", "sd1": "SD1.x", "sd2": "SD2.x", "sdxl": "SDXL", "flux": "FLUX.1"}
A_FAMILY = {k: ("an " if v.startswith("S") else "a ") + v for k, v in FAMILY_NAMES.items()}  # "an SDXL", "a FLUX.1"
BASE_MODEL_VERSIONS = {"sd1": "sd_v1", "sd2": "sd_v2", "sdxl": "sdxl_base_v1-0", "flux": "flux1"}
SVD_BATCH_ELEMENTS = 1 << 27  # matrices stacked per batched SVD call (elements, fp32: 512 MiB)


class ToolError(UserError, ValueError):
    """Bad input to a tool: printed as one `error: ...` line, exit status 2."""


# ----------------------------------------------------------------------------------------------------------
# running a tool


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Our own options of every tool: --dump_options (the GUI's forms) and --overwrite."""
    from library.option_dump import add_dump_options_argument

    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing output file (without it an existing file stops the tool)")
    add_dump_options_argument(parser)


def run_tool(parser: argparse.ArgumentParser, main: Callable[[argparse.Namespace], None],
             argv: list[str] | None = None) -> int:
    """--dump_options, then parse and run `main`; the errors a user can cause become one line on stderr and
    exit status 2 (no traceback)."""
    from library import option_dump
    from library.train_util import setup_logging

    option_dump.dump_if_asked(parser, argv)
    args = parser.parse_args(argv)
    setup_logging()
    try:
        main(args)
    except (UserError, FileExistsError, FileNotFoundError) as e:  # UserError: ours, the loaders', the savers'
        print(f"error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)
    return 0


def output_path(path: str | None, flag: str, overwrite: bool, suffixes=(".safetensors", ".ckpt", ".pt", ".pth"),
                folder_ok: bool = False) -> str:
    """--save_to: given, of an allowed type, and not an existing file unless --overwrite."""
    if not path:
        raise ToolError(f"{flag} is required: the output file ({', '.join(suffixes)})")
    suffix = Path(path).suffix.lower()
    if suffix not in suffixes and not (folder_ok and suffix == ""):
        allowed = ", ".join(suffixes) + (" or a folder (diffusers)" if folder_ok else "")
        raise ToolError(f"{flag} {path}: unsupported file type {suffix or '(none)'!r}; allowed: {allowed}")
    if os.path.exists(path) and not overwrite:
        raise ToolError(f"{flag} {path} already exists; choose another name or pass --overwrite")
    return path


def check_inputs(paths: Iterable[str | None], flag: str) -> None:
    for p in paths:
        if p is not None and not os.path.exists(p):
            raise ToolError(f"{flag}: file not found: {p}")


def str_to_dtype(name: str | None, flag: str = "--save_precision") -> torch.dtype | None:
    """float / fp16 / bf16 (upstream's names; flux_merge_lora also takes fp32/float32, fp8 names) -> dtype."""
    if name is None or name == "None":
        return None
    aliases = {"fp32": "float", "float32": "float", "fp8": "fp8_e4m3fn"}
    name = aliases.get(name, name)
    if name in PRECISIONS:
        return PRECISIONS[name]
    if name.startswith("fp8_") and hasattr(torch, "float8_" + name[4:]):
        return getattr(torch, "float8_" + name[4:])
    raise ToolError(f"{flag} {name}: unknown precision; allowed: float, fp16, bf16, fp8_e4m3fn, fp8_e5m2")


def pick_device(name: str | None) -> torch.device:
    """--device: as given; unset = the GPU when there is one (upstream: the CPU)."""
    if name:
        try:
            return torch.device(name)
        except RuntimeError as e:
            raise ToolError(f"--device {name}: {e}") from e
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def progress(items, desc: str | None, total: int | None = None):
    """A progress bar on stderr (none when desc is None: a caller with its own bar)."""
    from tqdm import tqdm

    return tqdm(items, desc=desc, total=total, file=sys.stderr, mininterval=1.0, dynamic_ncols=True,
                disable=desc is None)


# ----------------------------------------------------------------------------------------------------------
# files


def load_lora(path: str, dtype: torch.dtype | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A LoRA file (.safetensors with its metadata, or a torch file) -> (state dict, metadata)."""
    if not os.path.isfile(path):
        raise ToolError(f"LoRA file not found: {path}")
    try:
        if Path(path).suffix.lower() == ".safetensors":
            from safetensors import safe_open

            with safe_open(path, framework="pt") as f:
                metadata = dict(f.metadata() or {})
                sd = {k: f.get_tensor(k) for k in f.keys()}
        else:
            sd, metadata = torch.load(path, map_location="cpu", weights_only=True), {}
    except Exception as e:  # noqa: BLE001 - any unreadable file is the user's input
        raise ToolError(f"{path}: cannot read the file ({str(e).splitlines()[0][:200]})") from e
    if not isinstance(sd, dict):
        raise ToolError(f"{path}: not a LoRA state dict")
    if dtype is not None:
        sd = {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in sd.items()}
    return sd, metadata


def lora_keys(path: str) -> list[str]:
    """A LoRA file's key names; of a .safetensors file only its header is read."""
    if Path(path).suffix.lower() == ".safetensors" and os.path.isfile(path):
        from safetensors import safe_open

        try:
            with safe_open(path, framework="pt") as f:
                return list(f.keys())
        except Exception:  # noqa: BLE001 - load_lora names what is wrong with the file
            pass
    return list(load_lora(path)[0])


def cast_floats(sd: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    if dtype is None:
        return sd
    return {k: (v.to(dtype) if v.is_floating_point() and v.dtype != dtype else v) for k, v in sd.items()}


def save_lora(path: str, sd: dict[str, torch.Tensor], metadata: dict[str, str] | None, *, overwrite: bool,
              hashes: bool = True) -> None:
    """Atomic write; .safetensors gets `metadata` with sshs_model_hash / sshs_legacy_hash of these tensors
    (upstream's precalculate_safetensors_hashes); a .ckpt/.pt/.pth file holds the tensors only, as upstream."""
    from library import train_util

    sd = {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    if Path(path).suffix.lower() == ".safetensors":
        metadata = {k: str(v) for k, v in (metadata or {}).items()}
        if hashes:
            metadata["sshs_model_hash"], metadata["sshs_legacy_hash"] = train_util.model_hashes(sd, metadata)
        train_util.save_safetensors_atomic(sd, path, metadata or None, overwrite=overwrite)
    else:
        train_util.save_torch_atomic(sd, path, overwrite=overwrite)
    logger.info("saved %s", path)


def file_title(path: str) -> str:
    """A model's title for modelspec.merged_from: its modelspec.title, else the file name without extension."""
    if Path(path).suffix.lower() == ".safetensors" and os.path.isfile(path):
        from safetensors import safe_open

        try:
            with safe_open(path, framework="pt") as f:
                title = (f.metadata() or {}).get("modelspec.title")
            if title:
                return title
        except Exception:  # noqa: BLE001 - a title is a nicety
            pass
    return Path(path).stem if Path(path).suffix else Path(path).name


def merged_from(paths: Iterable[str]) -> str:
    return ", ".join(file_title(p) for p in paths)


def modelspec(family: str, *, lora: bool, title: str, merged: str | None = None, v_prediction: bool = False,
              flux_variant: str | None = None) -> dict[str, str]:
    """modelspec.* as upstream's sai_model_spec.build_metadata writes them for a tool's output."""
    from library import metadata

    args = argparse.Namespace(metadata_title=title, metadata_merged_from=merged)
    return metadata.modelspec_metadata(args, family="sd1" if family == "sd" else family, lora=lora,
                                       v_prediction=v_prediction, flux_variant=flux_variant)


def minimum_metadata(v2: str | None, base_model: str | None, module: str, dim: str, alpha: str,
                     network_args: dict | None) -> dict[str, str]:
    """upstream's build_minimum_network_metadata."""
    md = {"ss_network_module": module, "ss_network_dim": dim, "ss_network_alpha": alpha}
    if v2 is not None:
        md["ss_v2"] = v2
    if base_model is not None:
        md["ss_base_model_version"] = base_model
    if network_args is not None:
        md["ss_network_args"] = json.dumps(network_args)
    return md


# ----------------------------------------------------------------------------------------------------------
# LoRA state dicts


@dataclass
class LoraModule:
    """One LoRA module of a file: its name (key prefix), the keys of its matrices, and alpha (None: absent)."""

    name: str
    down_key: str
    up_key: str
    down: torch.Tensor
    up: torch.Tensor
    alpha: float | None

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    @property
    def scale(self) -> float:
        return 1.0 if self.alpha is None else self.alpha / self.rank

    @property
    def is_conv(self) -> bool:
        return self.down.dim() == 4

    @property
    def kernel(self) -> tuple[int, int]:
        return tuple(self.down.shape[2:4]) if self.is_conv else (1, 1)


def lora_modules(sd: dict[str, torch.Tensor]) -> dict[str, LoraModule]:
    """The LoRA modules of a state dict, in file order (kohya lora_down/lora_up, PEFT lora_A/lora_B and
    ControlLoRA down/up, as upstream's resize_lora.py matches them: the name in the last one or two key parts)."""
    out = {}
    for key, value in sd.items():
        parts = key.split(".")
        for down_name, up_name in DOWN_UP_NAMES:
            if len(parts) >= 2 and parts[-2] == down_name:
                base, suffix = ".".join(parts[:-2]), "." + parts[-1]
            elif parts[-1] == down_name:
                base, suffix = ".".join(parts[:-1]), ""
            else:
                continue
            up_key = f"{base}.{up_name}{suffix}"
            if up_key in sd:
                alpha = sd.get(base + ".alpha")
                out[base] = LoraModule(base, key, up_key, value, sd[up_key],
                                       None if alpha is None else float(alpha))
            break
    return out


def delta_weight(down: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """up x down shaped like the layer's weight: Linear (out, in), Conv2d (out, in, k, k) for a 1x1 or k x k
    down and a 1x1 up (kohya's conv LoRA)."""
    w = up.reshape(up.shape[0], -1) @ down.reshape(down.shape[0], -1)
    return w.reshape(up.shape[0], *down.shape[1:]) if down.dim() == 4 else w


def effective_weight(m: LoraModule) -> torch.Tensor:
    """up x down x alpha / rank in float32 (what the LoRA adds to the layer at multiplier 1)."""
    return delta_weight(m.down.float(), m.up.float()) * m.scale


def as_layer_weight(delta: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A delta weight shaped for the layer: a Linear layer with a 1x1-conv LoRA (SD1's proj_in/out) and the
    other way round."""
    if delta.shape == weight.shape:
        return delta
    if delta.numel() == weight.numel():
        return delta.reshape(weight.shape)
    raise ToolError(f"LoRA delta of shape {tuple(delta.shape)} does not fit a layer of shape {tuple(weight.shape)}")


# ----------------------------------------------------------------------------------------------------------
# SVD


def _batches(items: list, numel: Callable) -> Iterable[list]:
    batch, size = [], 0
    for it in items:
        n = numel(it)
        if batch and size + n > SVD_BATCH_ELEMENTS:
            yield batch
            batch, size = [], 0
        batch.append(it)
        size += n
    if batch:
        yield batch


def _same_shape_batches(mats: dict[str, torch.Tensor], bytes_per_element: int = 1
                        ) -> Iterable[tuple[tuple, list[str]]]:
    """(shape, names) batches of the matrices of one shape, each as much as one stacked call takes."""
    by_shape: dict[tuple, list[str]] = {}
    for name, m in mats.items():
        by_shape.setdefault(tuple(m.shape), []).append(name)
    for shape, names in by_shape.items():
        for batch in _batches(names, lambda n: bytes_per_element * mats[n].numel()):
            yield shape, batch


def svd_many(mats: dict[str, torch.Tensor], device: torch.device, desc: str | None = "svd"
             ) -> Iterable[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(name, U, S, Vh) of every 2-D matrix, reduced SVD in float32 on `device`, matrices of one shape stacked
    into batched torch.linalg.svd calls; results on `device`."""
    bar = progress(None, desc, total=len(mats))
    for _, batch in _same_shape_batches(mats):
        stack = torch.stack([mats[n].to(device, torch.float32) for n in batch])
        U, S, Vh = torch.linalg.svd(stack, full_matrices=False)
        for i, n in enumerate(batch):
            yield n, U[i], S[i], Vh[i]
        bar.update(len(batch))
    bar.close()


GRAM_MIN_RATIO = 1e-5  # a kept singular value below this share of the largest: the Gram route loses it, full SVD


def top_svd_many(mats: dict[str, torch.Tensor], ranks: dict[str, int], device: torch.device,
                 desc: str | None = "svd") -> Iterable[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(name, U, S, Vh) of every 2-D matrix M, cut to its rank (at most min(out, in)), in float32 on `device`:
    the eigendecomposition of the Gram matrix of M's smaller side (M M^T or M^T M) in float64, the other side's
    vectors from M itself (V = M^T U / S). The same top singular triplets as the full SVD within float32 noise
    (float64 squares the range it resolves: singular values down to GRAM_MIN_RATIO of the largest keep float32
    accuracy), at a fraction of its time for a 3072 x 12288 matrix; same shapes run as one batch. A matrix with
    a kept singular value below that (a zero difference, a rank below the cut) goes through torch.linalg.svd.
    Each pair's sign (arbitrary in any SVD) is the eigensolver's, not LAPACK's or cuSOLVER's SVD's."""
    shape_rank: dict[tuple, int] = {}
    for name, m in mats.items():
        shape_rank[tuple(m.shape)] = max(shape_rank.get(tuple(m.shape), 0), ranks[name])
    bar = progress(None, desc, total=len(mats))
    for (rows, cols), batch in _same_shape_batches(mats, bytes_per_element=2):  # float64
        k = min(shape_rank[(rows, cols)], rows, cols)
        M = torch.stack([mats[n].to(device, torch.float64) for n in batch])
        wide = rows <= cols
        gram = M @ M.transpose(1, 2) if wide else M.transpose(1, 2) @ M
        evals, evecs = torch.linalg.eigh(gram)  # ascending
        del gram
        S = evals[:, -k:].flip(-1).clamp_min(0).sqrt()
        side = evecs[:, :, -k:].flip(-1)  # U (wide) or V
        del evecs
        ok = S[:, -1] > S[:, 0] * GRAM_MIN_RATIO
        inv = torch.where(ok[:, None], 1 / S.clamp_min(torch.finfo(S.dtype).tiny), 0)
        if wide:
            U, Vh = side, (side.transpose(1, 2) @ M) * inv[:, :, None]
        else:
            U, Vh = (M @ side) * inv[:, None, :], side.transpose(1, 2)
        for i, (n, fits) in enumerate(zip(batch, ok.tolist())):  # one read of the flags from the device
            if fits:
                yield n, U[i].float(), S[i].float(), Vh[i].float()
            else:
                u, s, vh = torch.linalg.svd(M[i].float(), full_matrices=False)
                yield n, u[:, :k], s[:k], vh[:k]
        del M, U, Vh, side
        bar.update(len(batch))
    bar.close()


def svd_of_products(factors: dict[str, tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                    desc: str = "svd") -> Iterable[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(name, U, S, Vh) of A @ B for each (A (m x r), B (r x n)) without forming A @ B: QR of A and B^T, then
    the SVD of the r x r core (exact; S has r values, the rest of A @ B's singular values are 0). Same shapes
    run as one batch, in float32 on `device`."""
    by_shape: dict[tuple, list[str]] = {}
    for name, (a, b) in factors.items():
        by_shape.setdefault((tuple(a.shape), tuple(b.shape)), []).append(name)
    bar = progress(None, desc, total=len(factors))
    for _, names in by_shape.items():
        for batch in _batches(names, lambda n: factors[n][0].numel() + factors[n][1].numel()):
            a = torch.stack([factors[n][0].to(device, torch.float32) for n in batch])
            b = torch.stack([factors[n][1].to(device, torch.float32) for n in batch])
            qa, ra = torch.linalg.qr(a)
            qb, rb = torch.linalg.qr(b.transpose(1, 2))
            uc, s, vhc = torch.linalg.svd(ra @ rb.transpose(1, 2))
            U, Vh = qa @ uc, vhc @ qb.transpose(1, 2)
            for i, n in enumerate(batch):
                yield n, U[i], s[i], Vh[i]
            bar.update(len(batch))
    bar.close()


def pad_singular_values(S: torch.Tensor, length: int) -> torch.Tensor:
    """S with zeros up to `length` (= min(out, in) of the full matrix, as upstream's full SVD has)."""
    return torch.cat([S, S.new_zeros(length - S.shape[0])]) if length > S.shape[0] else S


def _index_sv_cumulative(S: torch.Tensor, target: float) -> int:
    cumulative = torch.cumsum(S, dim=0) / float(torch.sum(S))
    return max(1, min(int(torch.searchsorted(cumulative, target)) + 1, len(S) - 1))


def _index_sv_fro(S: torch.Tensor, target: float) -> int:
    sq = S.pow(2)
    cumulative = torch.cumsum(sq, dim=0) / float(torch.sum(sq))
    return max(1, min(int(torch.searchsorted(cumulative, target ** 2)) + 1, len(S) - 1))


def _index_sv_ratio(S: torch.Tensor, target: float) -> int:
    return max(1, min(int(torch.sum(S > S[0] / target).item()), len(S) - 1))


_INDEX = {"sv_ratio": _index_sv_ratio, "sv_fro": _index_sv_fro, "sv_cumulative": _index_sv_cumulative}


@dataclass
class RankChoice:
    rank: int
    alpha: float
    sum_retained: float
    fro_retained: float
    max_ratio: float


def choose_rank(S: torch.Tensor, max_rank: int, method: str | None, param: float | None,
                scale: float = 1.0) -> RankChoice:
    """upstream's resize_lora.rank_resize: the new rank (dynamic methods: index + 1, capped at max_rank; a zero
    matrix: 1), alpha = scale * rank, and the report's retained sums. S: all min(out, in) singular values."""
    S = S.float().cpu()
    rank = _INDEX[method](S, param) + 1 if method else max_rank
    if S[0] <= MIN_SV:
        rank = 1
    elif rank > max_rank:
        rank = max_rank
    s_abs = S.abs()
    sq = S.pow(2)
    fro = float(torch.sqrt(sq[:rank].sum()) / torch.sqrt(sq.sum())) if float(sq.sum()) > 0 else float("nan")
    total = float(s_abs.sum())
    return RankChoice(rank=rank, alpha=float(scale * rank),
                      sum_retained=float(s_abs[:rank].sum()) / total if total > 0 else float("nan"),
                      fro_retained=fro,
                      max_ratio=float(S[0] / S[rank - 1]) if float(S[rank - 1]) != 0 else float("inf"))


def truncate(U: torch.Tensor, S: torch.Tensor, Vh: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(up, down) = (U[:, :r] diag(S[:r]), Vh[:r]); components beyond the available ones are zero (upstream's
    full SVD has noise there)."""
    k = min(rank, S.shape[0])
    up = U[:, :k] * S[:k]
    down = Vh[:k]
    if k < rank:
        up = torch.cat([up, up.new_zeros(up.shape[0], rank - k)], dim=1)
        down = torch.cat([down, down.new_zeros(rank - k, down.shape[1])], dim=0)
    return up, down


def clamp_quantile(up: torch.Tensor, down: torch.Tensor, quantile: float) -> tuple[torch.Tensor, torch.Tensor]:
    """upstream's extract/svd-merge clamping: both matrices into [-q, q], q = that quantile of all their values."""
    dist = torch.cat([up.flatten(), down.flatten()])
    if dist.numel() > 16_000_000:  # torch.quantile's input limit: a strided sample of the values
        dist = dist[:: math.ceil(dist.numel() / 16_000_000)]
    hi = torch.quantile(dist, quantile)
    return up.clamp(-hi, hi), down.clamp(-hi, hi)


def to_lora_shapes(up: torch.Tensor, down: torch.Tensor, weight_shape: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D (up, down) of a matrix flattened from a weight of `weight_shape` -> kohya's LoRA shapes."""
    if len(weight_shape) == 4:
        return up.reshape(up.shape[0], up.shape[1], 1, 1), down.reshape(down.shape[0], *weight_shape[1:])
    return up, down


# ----------------------------------------------------------------------------------------------------------
# families


_FAMILY_PATTERNS = (
    ("flux", re.compile(r"^lora_unet_(double|single)_blocks_|^(transformer\.)?(single_)?transformer_blocks\.\d+\.|"
                        r"^(diffusion_model\.)?(double|single)_blocks\.\d+\.")),
    ("sdxl", re.compile(r"^lora_(unet_(input_blocks|output_blocks|middle_block)_|te[12]_)")),
    ("sd", re.compile(r"^lora_(unet_(down_blocks|up_blocks|mid_block)_|te_)")),
)


def lora_family(keys: Iterable[str]) -> str | None:
    """sd (SD1.x/SD2.x), sdxl or flux from a LoRA's key names; None when none of them says."""
    keys = list(keys)
    for family, pattern in _FAMILY_PATTERNS:  # FLUX first: its CLIP-L modules are named lora_te1_ as SDXL's
        if any(pattern.search(k) for k in keys):
            return family
    return None


def check_lora_family(path: str, keys: Iterable[str], expected: tuple[str, ...], model_label: str,
                      hint: str = "") -> str | None:
    family = lora_family(keys)
    if family is not None and family not in expected:
        raise ToolError(f"{path}: {A_FAMILY[family]} LoRA, but the model is {model_label}"
                        + (f"; {hint}" if hint else ""))
    return family


def family_hint(family: str | None) -> str:
    return {"sd": "use merge_lora.py for SD1.x/SD2.x", "sdxl": "use sdxl_merge_lora.py for SDXL",
            "flux": "use flux_merge_lora.py for FLUX.1"}.get(family or "", "")


# ----------------------------------------------------------------------------------------------------------
# SD / SDXL models: kohya LoRA name -> layer


def sd_layer_map(text_encoders: list, unet, conv: bool = True) -> dict[str, torch.nn.Module]:
    """Every layer a networks.lora LoRA can target, by its kohya name (lora_te_ / lora_te1_ / lora_te2_ with
    canonical text_model_ paths, lora_unet_ with SGM names for SDXL): the naming of networks/lora.py."""
    from networks import lora

    out = {}
    for i, te in enumerate(text_encoders):
        prefix = lora.LORA_PREFIX_TEXT_ENCODER if len(text_encoders) == 1 else f"{lora.LORA_PREFIX_TEXT_ENCODER}{i + 1}"
        names = lora._text_encoder_names(te)
        for path, layer in lora.target_layers(te, lora.TEXT_ENCODER_TARGET_MODULES):
            out[f"{prefix}_{names.get(path, path)}".replace(".", "_")] = layer
    name_map = lora._unet_name_map(unet, text_encoders)
    targets = lora.UNET_TARGET_MODULES + (lora.UNET_CONV_TARGET_MODULES if conv else ())
    for path, layer in lora.target_layers(unet, targets):
        out[f"{lora.LORA_PREFIX_UNET}_{lora._kohya_unet_path(path, name_map)}".replace(".", "_")] = layer
    return out


def stored_dtype(path: str) -> torch.dtype:
    """The dtype of a .safetensors single file's UNet weights (float32 for anything else): upstream loads the
    models of extract_lora_from_models.py in the dtype they are stored in."""
    if Path(path).suffix.lower() != ".safetensors" or not os.path.isfile(path):
        return torch.float32
    from safetensors import safe_open

    names = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
    with safe_open(path, framework="pt") as f:
        key = next((k for k in f.keys() if k.startswith("model.diffusion_model.") and k.endswith(".weight")), None)
        return torch.float32 if key is None else names.get(f.get_slice(key).get_dtype(), torch.float32)


def holds_exactly(dtype: torch.dtype, stored: torch.dtype) -> bool:
    """Every `stored` value is a `dtype` value (fp16 and bf16 in fp32)."""
    return stored == dtype or (dtype == torch.float32 and stored in (torch.float16, torch.bfloat16))


def load_sd_model(path: str, family: str, dtype: torch.dtype, device: torch.device | str = "cpu", *,
                  keep_exact: bool = False):
    """An SD1.x/SD2.x/SDXL model as the trainers read it (single file or diffusers folder), in `dtype` on
    `device`; a path that is no model of that family is a ToolError naming it. The tensors move in the dtypes
    the file stores and are cast there (a GPU casts fast; fp16 moves half the bytes of fp32). keep_exact:
    tensors whose values `dtype` holds exactly stay as stored (merge_into_layers casts the layers it changes;
    the saved bits are the same)."""
    from library import model_util

    if not os.path.exists(path):
        raise ToolError(f"model not found: {path}")
    if os.path.isdir(path) and not model_util._is_diffusers_folder(Path(path)):
        raise ToolError(f"{path}: a folder, but not a diffusers model (no model_index.json or unet/config.json)")
    detected = model_util.detect_family(path)
    if detected is not None and detected != family and not {detected, family} <= {"sd1", "sd2"}:
        raise ToolError(f"{path}: {A_FAMILY[detected]} model, expected {FAMILY_NAMES[family]}"
                        + {"sdxl": " (--sdxl / sdxl_merge_lora.py for SDXL)"}.get(detected, ""))
    stored = None if os.path.isfile(path) else dtype  # a single file's tensors uncast and uncopied
    comps = model_util.load_sd_components(path, family, dtype=stored, tokenizers=False)
    for m in [comps.unet, comps.vae, *comps.text_encoders]:
        m.to(device)
        for t in [*m.parameters(), *m.buffers()]:
            if t.is_floating_point() and not (keep_exact and holds_exactly(dtype, t.dtype)):
                t.data = t.data.to(dtype)
    comps.extra_state = {k: (v.to(dtype) if v.is_floating_point() and not (keep_exact and holds_exactly(dtype, v.dtype))
                             else v) for k, v in comps.extra_state.items()}
    return comps


# ----------------------------------------------------------------------------------------------------------
# layer-block weights (--lbws of sdxl_merge_lora.py / svd_merge_lora.py, upstream's LBW presets)

_LBW_NAMES = ["BASE"] + [f"IN{i:02d}" for i in range(12)] + ["MID"] + [f"OUT{i:02d}" for i in range(12)]
_LBW_OFF = {  # layers each preset length leaves out (the others are listed in order)
    12: {"IN00", "IN01", "IN02", "IN03", "IN06", "IN09", "IN10", "IN11", "OUT06", "OUT07", "OUT08", "OUT09",
         "OUT10", "OUT11"},
    17: {"IN00", "IN03", "IN06", "IN09", "IN10", "IN11", "OUT00", "OUT01", "OUT02"},
    20: {"IN09", "IN10", "IN11", "OUT09", "OUT10", "OUT11"},
    26: set(),
}
_RE_UPDOWN = re.compile(r"(up|down)_blocks_(\d+)_(resnets|upsamplers|downsamplers|attentions)_(\d+)_")


def parse_lbws(lbws: list[str]) -> tuple[list[list[float]], bool, list[int]]:
    """--lbws "[1,0,...]" per model -> (weights, is_sdxl (lengths 12 and 20), the 26-layer indices they set)."""
    try:
        parsed = [json.loads(x) for x in lbws]
    except ValueError as e:
        raise ToolError(f"--lbws: each value must be a JSON list of numbers, e.g. \"[1,0,1,...]\" ({e})") from e
    if not all(isinstance(x, list) and all(isinstance(v, (int, float)) for v in x) for x in parsed):
        raise ToolError("--lbws: each value must be a JSON list of numbers")
    lengths = {len(x) for x in parsed}
    if len(lengths) != 1 or next(iter(lengths)) not in _LBW_OFF:
        raise ToolError(f"--lbws: all lists must have the same length, one of {sorted(_LBW_OFF)}; got "
                        f"{sorted(lengths)}")
    n = lengths.pop()
    targets = [i for i, name in enumerate(_LBW_NAMES) if name not in _LBW_OFF[n]]
    return parsed, n in (12, 20), targets


def lbw_layer_weights(lbw: list[float], targets: list[int]) -> list[float]:
    weights = [1.0] * len(_LBW_NAMES)
    for i, v in zip(targets, lbw):
        weights[i] = float(v)
    logger.info("lbw: %s", dict(zip(_LBW_NAMES, weights)))
    return weights


def lbw_index(lora_name: str, is_sdxl: bool) -> int:
    """upstream's get_lbw_block_index: 0 = text encoder (BASE), 1.. = IN00.., 13 = MID, 14.. = OUT00..;
    -1 = not in a numbered block."""
    if "text_model_encoder_" in lora_name:
        return 0
    if is_sdxl:
        if not lora_name.startswith("lora_unet_"):
            return -1
        name = lora_name[len("lora_unet_"):]
        if name.startswith(("time_embed_", "label_emb_")):
            return 1
        if name.startswith("input_blocks_"):
            return 1 + int(name.split("_")[2])
        if name.startswith("middle_block_"):
            return 13
        if name.startswith("output_blocks_"):
            return 14 + int(name.split("_")[2])
        return 23 if name.startswith("out_") else -1
    m = _RE_UPDOWN.search(lora_name)
    if m:
        side, i, kind, j = m.group(1), int(m.group(2)), m.group(3), int(m.group(4))
        if side == "down":
            idx = 3 * i + j + 1 if kind in ("resnets", "attentions") else 3 * (i + 1) if kind == "downsamplers" else None
            return -1 if idx is None else 1 + idx
        idx = 3 * i + j if kind in ("resnets", "attentions") else 3 * i + 2 if kind == "upsamplers" else None
        return -1 if idx is None else 1 + 12 + 1 + idx
    return 13 if "mid_block_" in lora_name else -1


def lbw_factor(lora_name: str, weights: list[float] | None, targets: list[int], is_sdxl: bool) -> float:
    if weights is None:
        return 1.0
    i = lbw_index(lora_name, is_sdxl)
    return weights[i] if i in targets else 1.0


# ----------------------------------------------------------------------------------------------------------
# merging LoRAs into one (merge_lora.py / sdxl_merge_lora.py / flux_merge_lora.py without a model)


def merge_lora_files(models: list[str], ratios: list[float], dtype: torch.dtype, *, concat: bool, shuffle: bool,
                     lbws: list[str] | None = None, module: str = "networks.lora", families=("sd", "sdxl"),
                     convert=None) -> tuple[dict[str, torch.Tensor], dict[str, str], str | None]:
    """upstream's merge_lora_models: each LoRA's matrices summed (or concatenated along the rank with --concat)
    after scaling both by sqrt(alpha / first alpha) * ratio (|.| on up), alpha = the first file's; --shuffle
    permutes each module's rank. Returns (state dict, minimum metadata, ss_v2 of the first file)."""
    weights, is_sdxl, targets = parse_lbws(lbws) if lbws else ([None] * len(models), False, [])
    is_sdxl = is_sdxl or families == ("sdxl",)  # sdxl_merge_lora.py numbers the blocks as SDXL's
    base_alphas: dict[str, float] = {}
    base_dims: dict[str, int] = {}
    merged: dict[str, torch.Tensor] = {}
    v2 = base_model = None
    seen_family = None
    for path, ratio, lbw in zip(models, ratios, weights):
        logger.info("loading: %s", path)
        sd, md = load_lora(path, dtype)
        if convert is not None:
            sd = convert(sd)
        fam = lora_family(sd)
        if fam is not None and fam not in families:
            raise ToolError(f"{path}: {A_FAMILY[fam]} LoRA; {family_hint(fam)}")
        if fam is not None and seen_family is not None and fam != seen_family:
            raise ToolError(f"{path}: {A_FAMILY[fam]} LoRA, the LoRAs before it are {FAMILY_NAMES[seen_family]}")
        seen_family = seen_family or fam
        v2 = md.get("ss_v2") if v2 is None else v2
        base_model = md.get("ss_base_model_version") if base_model is None else base_model
        layer_w = lbw_layer_weights(lbw, targets) if lbw is not None else None
        mods = lora_modules(sd)
        for name, m in mods.items():
            alpha = m.alpha if m.alpha is not None else float(m.rank)
            base_alphas.setdefault(name, alpha)
            base_dims.setdefault(name, m.rank)
        logger.info("dim: %s, alpha: %s", sorted({m.rank for m in mods.values()}),
                    sorted({m.alpha if m.alpha is not None else m.rank for m in mods.values()}))
        for name, m in progress(mods.items(), "merging", total=len(mods)):
            alpha = m.alpha if m.alpha is not None else float(m.rank)
            s = math.sqrt(alpha / base_alphas[name]) * ratio * lbw_factor(name, layer_w, targets, is_sdxl)
            for key, value, concat_dim, factor in ((m.down_key, m.down, 0, s), (m.up_key, m.up, 1, abs(s))):
                value = value * factor
                if key not in merged:
                    merged[key] = value
                elif concat:
                    merged[key] = torch.cat([merged[key], value], dim=concat_dim)
                elif merged[key].shape != value.shape:
                    raise ToolError(
                        f"{path}: {key} has shape {tuple(value.shape)}, the LoRAs before it "
                        f"{tuple(merged[key].shape)}: different ranks (dims) cannot be added; merge them with "
                        "--concat, or into one rank with svd_merge_lora.py")
                else:
                    merged[key] = merged[key] + value
    out = dict(merged)
    for name, alpha in base_alphas.items():
        out[name + ".alpha"] = torch.tensor(alpha)
    if shuffle:
        for name, m in lora_modules(out).items():
            perm = torch.randperm(m.rank)
            out[m.down_key] = m.down[perm]
            out[m.up_key] = m.up[:, perm]
    dims, alphas = sorted(set(base_dims.values())), sorted(set(base_alphas.values()))
    logger.info("merged: dim %s, alpha %s", dims, alphas)
    md = minimum_metadata(v2, base_model, module, str(dims[0]) if len(dims) == 1 else "Dynamic",
                          str(alphas[0]) if len(alphas) == 1 else "Dynamic", None)
    return out, md, v2


def check_models_ratios(models: list[str] | None, ratios: list[float] | None, lbws: list[str] | None = None) -> None:
    models, ratios = models or [], ratios or []
    if not models:
        raise ToolError("--models: give at least one LoRA file")
    if len(models) != len(ratios):
        raise ToolError(f"--models and --ratios: {len(models)} models but {len(ratios)} ratios; give one ratio per "
                        "model")
    if lbws and len(lbws) != len(models):
        raise ToolError(f"--lbws: {len(lbws)} values for {len(models)} models; give one per model")
    check_inputs(models, "--models")


def merge_into_layers(layers: dict[str, torch.nn.Module], models: list[str], ratios: list[float],
                      dtype: torch.dtype, device: torch.device, *, families: tuple[str, ...], model_label: str,
                      lbws: list[str] | None = None, is_sdxl: bool = False) -> None:
    """W += ratio * up x down * alpha / rank (times the layer-block weight) for every module of each LoRA, in
    `dtype` on `device` (upstream's merge_to_sd_model)."""
    weights, _, targets = parse_lbws(lbws) if lbws else ([None] * len(models), False, [])
    for path, ratio, lbw in zip(models, ratios, weights):
        logger.info("loading: %s", path)
        sd, _ = load_lora(path)
        check_lora_family(path, sd, families, model_label, family_hint(lora_family(sd)))
        layer_w = lbw_layer_weights(lbw, targets) if lbw is not None else None
        mods = lora_modules(sd)
        missing = []
        for name, m in progress(mods.items(), "merging", total=len(mods)):
            layer = layers.get(name)
            if layer is None:
                missing.append(name)
                continue
            factor = ratio * m.scale * lbw_factor(name, layer_w, targets, is_sdxl)
            delta = delta_weight(m.down.to(device).to(dtype), m.up.to(device).to(dtype)) * factor
            w = layer.weight
            try:
                delta = as_layer_weight(delta, w)
            except ToolError as e:
                raise ToolError(f"{path}: module {name}: {e}; a LoRA for another model?") from e
            # in place into the fresh delta (no fp32 copy of W); the sum stays in `dtype`, unrounded for the next LoRA
            w.data = delta.to(w.device).add_(w.data)
        if missing:
            if len(missing) == len(mods):
                raise ToolError(f"{path}: none of its {len(mods)} modules is a layer of the model ({model_label}); "
                                f"e.g. {missing[0]}")
            logger.warning("%s: %d modules have no layer in the model and were skipped, e.g. %s", path,
                           len(missing), missing[:3])
        logger.info("merged %d modules of %s (ratio %s)", len(mods) - len(missing), path, ratio)


# ----------------------------------------------------------------------------------------------------------
# merge_lora.py / sdxl_merge_lora.py


def _is_oft(path: str) -> bool:
    return any(".oft_blocks" in k for k in lora_keys(path))


def merge_oft_into_unet(comps, models: list[str], ratios: list[float], lbws: list[str] | None, dtype,
                        device) -> None:
    """OFT files (networks.oft) into the UNet: each layer's weight rotated by the file's blocks at multiplier
    ratio (times the layer-block weight)."""
    from networks import oft

    weights, _, targets = parse_lbws(lbws) if lbws else ([None] * len(models), False, [])
    for path, ratio, lbw in zip(models, ratios, weights):
        sd, _ = load_lora(path)
        if not any(".oft_blocks" in k for k in sd):
            raise ToolError(f"{path}: a LoRA among OFT files; merge LoRA and OFT files in separate runs")
        network, _ = oft.create_network_from_weights(ratio, None, None, comps.text_encoders, comps.unet,
                                                     weights_sd=sd)
        layer_w = lbw_layer_weights(lbw, targets) if lbw is not None else None
        for module in progress(network.unet_ofts, "merging OFT"):
            prefix = module.oft_name + "."
            module.load_state_dict({k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}, strict=False)
            module.to(device, dtype)
            module.multiplier = ratio * lbw_factor(module.oft_name, layer_w, targets, True)
            module.merge_to_org()
        logger.info("merged %d OFT modules of %s", len(network.unet_ofts), path)


def run_sd_merge(args: argparse.Namespace, family: str) -> None:
    """merge_lora.py (family sd1/sd2) and sdxl_merge_lora.py (sdxl): LoRAs into a model (--sd_model) or into
    one LoRA."""
    check_models_ratios(args.models, args.ratios, getattr(args, "lbws", None))
    lbws = getattr(args, "lbws", None) or None
    merge_dtype = str_to_dtype(args.precision, "--precision")
    save_dtype = str_to_dtype(args.save_precision) or merge_dtype
    is_sdxl = family == "sdxl"
    v2 = family == "sd2"
    title = Path(args.save_to or "").stem
    if args.sd_model is not None:
        output_path(args.save_to, "--save_to", args.overwrite, suffixes=(".safetensors", ".ckpt"))
        families = ("sdxl",) if is_sdxl else ("sd",)
        for path in args.models:  # before the model loads
            keys = lora_keys(path)
            check_lora_family(path, keys, families, FAMILY_NAMES[family], family_hint(lora_family(keys)))
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        logger.info("loading %s model: %s", FAMILY_NAMES[family], args.sd_model)
        comps = load_sd_model(args.sd_model, family, merge_dtype, device, keep_exact=True)
        if is_sdxl and _is_oft(args.models[0]):
            comps.unet.to(merge_dtype)  # OFT rotates each layer in the layer's dtype
            merge_oft_into_unet(comps, args.models, args.ratios, lbws, merge_dtype, device)
        else:
            layers = sd_layer_map(comps.text_encoders, comps.unet)
            merge_into_layers(layers, args.models, args.ratios, merge_dtype, device, families=families,
                              model_label=FAMILY_NAMES[family], lbws=lbws, is_sdxl=is_sdxl)
        md = None
        if not args.no_metadata:
            md = modelspec(family, lora=False, title=title, merged=merged_from([args.sd_model] + args.models),
                           v_prediction=v2)
            if v2:
                logger.warning("Cannot determine if model is for v-prediction, so save metadata as v-prediction")
        from library import model_util

        logger.info("saving %s model to: %s", FAMILY_NAMES[family], args.save_to)
        model_util.save_sd_checkpoint(args.save_to, comps, save_dtype=save_dtype, metadata=md,
                                      overwrite=args.overwrite)
        return
    output_path(args.save_to, "--save_to", args.overwrite)
    if any(_is_oft(p) for p in args.models):
        raise ToolError("OFT files cannot be merged with each other, only into a model (--sd_model)")
    state_dict, md, file_v2 = merge_lora_files(args.models, args.ratios, merge_dtype, concat=args.concat,
                                               shuffle=args.shuffle, lbws=lbws,
                                               families=("sdxl",) if is_sdxl else ("sd",))
    state_dict = cast_floats(state_dict, save_dtype)
    v2_lora = file_v2 == "True" and not is_sdxl
    if not args.no_metadata:
        md.update(modelspec("sdxl" if is_sdxl else ("sd2" if v2_lora else "sd1"), lora=True, title=title,
                            merged=merged_from(args.models), v_prediction=v2_lora))
        if v2_lora:
            logger.warning("Cannot determine if LoRA is for v-prediction, so save metadata as v-prediction")
    logger.info("saving model to: %s", args.save_to)
    save_lora(args.save_to, state_dict, md, overwrite=args.overwrite)


def add_precision_arguments(parser: argparse.ArgumentParser) -> None:
    """--save_precision / --precision of merge_lora.py, sdxl_merge_lora.py and svd_merge_lora.py."""
    parser.add_argument("--save_precision", type=str, default=None, choices=[None, "float", "fp16", "bf16"],
                        help="precision in saving (default: the merging precision)")
    parser.add_argument("--precision", type=str, default="float", choices=["float", "fp16", "bf16"],
                        help="precision in merging (float is recommended)")


def add_models_arguments(parser: argparse.ArgumentParser, lbws: bool) -> None:
    """--models / --ratios (/ --lbws) / --no_metadata of the merging tools."""
    parser.add_argument("--models", type=str, nargs="*", help="LoRA files to merge")
    parser.add_argument("--ratios", type=float, nargs="*", help="ratio of each LoRA (one per --models)")
    if lbws:
        parser.add_argument("--lbws", type=str, nargs="*",
                            help="layer-block weights of each LoRA, a JSON list of 12, 17, 20 or 26 numbers each")
    parser.add_argument("--no_metadata", action="store_true",
                        help="do not save modelspec metadata (a LoRA keeps the minimum ss_* metadata)")


def add_concat_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concat", action="store_true",
                        help="concatenate the LoRAs instead of adding them (the output rank is the sum of ranks)")
    parser.add_argument("--shuffle", action="store_true", help="shuffle each module's rank components")


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", type=str, default=None,
                        help="device for the SVDs, e.g. cuda or cpu (default: the GPU when there is one)")


def add_sd_merge_arguments(parser: argparse.ArgumentParser, lbws: bool) -> None:
    add_precision_arguments(parser)
    parser.add_argument("--sd_model", type=str, default=None,
                        help="model to merge the LoRAs into (single file or diffusers folder); omitted: the LoRAs "
                             "are merged into one LoRA")
    parser.add_argument("--save_to", type=str, default=None,
                        help="output file: .safetensors or .ckpt (a model), .safetensors/.ckpt/.pt (a LoRA)")
    add_models_arguments(parser, lbws)
    add_concat_arguments(parser)


# ----------------------------------------------------------------------------------------------------------
# extracting a LoRA from the difference of two models (extract_lora_from_models.py, flux_extract_lora.py)


def add_extract_arguments(parser: argparse.ArgumentParser) -> None:
    """The options both extract tools have (upstream's names and defaults)."""
    parser.add_argument("--save_precision", type=str, default=None, choices=[None, "float", "fp16", "bf16"],
                        help="precision in saving (default: float)")
    parser.add_argument("--dim", type=int, default=4, help="rank of the LoRA (default 4)")
    add_device_argument(parser)
    parser.add_argument("--clamp_quantile", type=float, default=0.99,
                        help="values are clamped at this quantile, (0-1]; default 0.99")
    parser.add_argument("--no_metadata", action="store_true",
                        help="do not save modelspec metadata (the minimum ss_* metadata is kept)")


def check_extract_arguments(args: argparse.Namespace) -> None:
    if args.dim < 1 or (getattr(args, "conv_dim", None) is not None and args.conv_dim < 1):
        raise ToolError("--dim / --conv_dim must be at least 1")
    if not 0 < args.clamp_quantile <= 1:
        raise ToolError(f"--clamp_quantile {args.clamp_quantile}: must be in (0, 1]")


def extract_from_diffs(diffs: dict[str, torch.Tensor], ranks: dict[str, int], device: torch.device,
                       clamp: float, save_dtype: torch.dtype | None, desc: str | None = "extracting",
                       alpha_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A LoRA (up, down, alpha = rank) of each weight difference: the SVD cut to the module's rank (at most the
    layer's in/out size), both matrices clamped at the `clamp` quantile (upstream's rule). 3x3 convs are
    decomposed flattened to (out, in * 3 * 3)."""
    mats = {n: d.reshape(d.shape[0], -1) for n, d in diffs.items()}
    out = {}
    with torch.no_grad():
        for name, U, S, Vh in top_svd_many(mats, ranks, device, desc=desc):
            shape = tuple(diffs[name].shape)
            rank = min(ranks[name], shape[0], shape[1])
            up, down = truncate(U, S, Vh, rank)
            up, down = clamp_quantile(up, down, clamp)
            up, down = to_lora_shapes(up, down, shape)
            out[name + ".lora_up.weight"] = up.to("cpu", save_dtype or torch.float32).contiguous()
            out[name + ".lora_down.weight"] = down.to("cpu", save_dtype or torch.float32).contiguous()
            out[name + ".alpha"] = torch.tensor(rank, dtype=save_dtype or alpha_dtype)
    return out


# ----------------------------------------------------------------------------------------------------------
# FLUX.1: BFL state dicts, kohya <-> diffusers (ai-toolkit) LoRA layouts


def flux_transformer_state_dict(path: str, flag: str, device="cpu", folder_dtype: torch.dtype = torch.float32
                                ) -> tuple[dict[str, torch.Tensor], bool]:
    """A FLUX.1 transformer as a BFL state dict (keys as in the file; a diffusers folder converted to BFL keys),
    its tensors on `device` in their stored dtype; (state dict, came from a diffusers folder)."""
    from library import flux_models

    if not os.path.exists(path):
        raise ToolError(f"{flag}: not found: {path}")
    if os.path.isdir(path):
        if not (flux_models.is_diffusers_folder(path) or (Path(path) / "config.json").is_file()
                or (Path(path) / "transformer" / "config.json").is_file()):
            raise ToolError(f"{flag} {path}: a folder, but not a FLUX.1 diffusers model (no model_index.json or "
                            "transformer/config.json)")
        model = flux_models.load_flux_transformer(path, dtype=folder_dtype)
        sd = flux_models.diffusers_to_bfl(model.state_dict())
        return {k: v.to(device) for k, v in sd.items()}, True
    from safetensors.torch import load_file

    try:
        sd = load_file(path, device=str(device))
    except Exception as e:  # noqa: BLE001
        raise ToolError(f"{flag} {path}: cannot read it as safetensors ({str(e).splitlines()[0][:200]})") from e
    if not any(".double_blocks." in "." + k or ".single_blocks." in "." + k for k in sd):
        raise ToolError(f"{flag} {path}: no FLUX.1 transformer (no double_blocks / single_blocks weights)")
    return sd, False


def lora_name_map(keys: Iterable[str], prefix: str) -> dict[str, str]:
    """kohya LoRA name -> the `.weight` key it targets in a state dict (upstream's naming: prefix + the module
    path with '.' -> '_'; BFL files' "model.diffusion_model." prefix is not part of the name)."""
    from library.flux_models import _BFL_PREFIXES

    out = {}
    for key in keys:
        if not key.endswith(".weight"):
            continue
        module = key[: -len(".weight")]
        for p in _BFL_PREFIXES:
            if module.startswith(p):
                module = module[len(p):]
                break
        out[f"{prefix}_{module.replace('.', '_')}"] = key
    return out


def _block_counts(names: Iterable[str]) -> tuple[int, int]:
    double = {int(m.group(1)) for n in names if (m := re.search(r"(?:double_blocks|^transformer_blocks)[._](\d+)[._]", n))}
    single = {int(m.group(1)) for n in names if (m := re.search(r"(?:single_blocks|single_transformer_blocks)[._](\d+)[._]", n))}
    return (max(double) + 1 if double else 0), (max(single) + 1 if single else 0)


_CLIP_MODULE = re.compile(r"^text_model_encoder_layers_(\d+)_(self_attn_(?:q|k|v|out)_proj|mlp_fc[12])$")


def _clip_path(rest: str) -> str | None:
    m = _CLIP_MODULE.match(rest)
    if not m:
        return None
    part = m.group(2)
    part = part.replace("self_attn_", "self_attn.").replace("mlp_", "mlp.")
    return f"text_model.encoder.layers.{m.group(1)}.{part}"


def is_diffusers_flux_lora(sd: dict) -> bool:
    return any(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in sd) and \
        not any(k.startswith("lora_unet_") for k in sd)


def flux_lora_to_diffusers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """kohya FLUX.1 LoRA (BFL module names, fused qkv / linear1, alpha) -> diffusers' PEFT layout (ai-toolkit's:
    `transformer.<module>.lora_A/B.weight`, CLIP-L as `text_encoder.<module>`, no alpha: alpha / rank is folded
    into both matrices). A fused module is split into its parts: a block-diagonal up (a LoRA made from parts)
    gives each part its own rows of down, otherwise each part gets all of down and its rows of up."""
    from library.flux_models import bfl_linear_map

    mods = lora_modules(sd)
    n_double, n_single = _block_counts(mods)
    bfl = {f"lora_unet_{k.replace('.', '_')}": v for k, v in bfl_linear_map(n_double, n_single).items()}
    out, skipped = {}, []
    for name, m in mods.items():
        s = math.sqrt(m.scale)
        down, up = m.down * s, m.up * s
        if name.startswith("lora_te1_") and (path := _clip_path(name[len("lora_te1_"):])):
            out[f"text_encoder.{path}.lora_A.weight"] = down.contiguous()
            out[f"text_encoder.{path}.lora_B.weight"] = up.contiguous()
            continue
        parts = bfl.get(name)
        if parts is None:
            skipped.append(name)
            continue
        if len(parts) == 1:
            out[f"transformer.{parts[0]}.lora_A.weight"] = down.contiguous()
            out[f"transformer.{parts[0]}.lora_B.weight"] = up.contiguous()
            continue
        width = down.shape[1]
        dims = [width] * 3 + ([up.shape[0] - 3 * width] if len(parts) == 4 else [])
        if sum(dims) != up.shape[0]:
            raise ToolError(f"{name}: lora_up has {up.shape[0]} rows, expected {sum(dims)} for {len(parts)} parts")
        rows = torch.split(up, dims, dim=0)
        r = m.rank // len(parts) if m.rank % len(parts) == 0 else None
        block_diag = r is not None and all(
            bool((rows[i][:, : i * r] == 0).all() and (rows[i][:, (i + 1) * r:] == 0).all()) for i in range(len(parts)))
        for i, part in enumerate(parts):
            if block_diag:
                out[f"transformer.{part}.lora_A.weight"] = down[i * r:(i + 1) * r].contiguous()
                out[f"transformer.{part}.lora_B.weight"] = rows[i][:, i * r:(i + 1) * r].contiguous()
            else:
                out[f"transformer.{part}.lora_A.weight"] = down.clone()
                out[f"transformer.{part}.lora_B.weight"] = rows[i].contiguous()
    if skipped:
        logger.warning("%d modules have no diffusers counterpart and were left out, e.g. %s", len(skipped),
                       skipped[:3])
    return out


def flux_lora_from_diffusers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers / ai-toolkit FLUX.1 LoRA (`transformer.<module>.lora_A/B.weight`, also without the
    "transformer." prefix or with "diffusion_model.") -> kohya's layout: the q/k/v (and proj_mlp) parts of one
    BFL Linear side by side in down, block-diagonal in up, alpha = the new rank (scale 1, as the file has)."""
    from library.flux_models import bfl_linear_map

    mods = {}
    for name, m in lora_modules(sd).items():
        path = name
        for p in ("diffusion_model.", "transformer."):
            if path.startswith(p):
                path = path[len(p):]
        mods[path] = m
    n_double, n_single = _block_counts(mods)
    out, used = {}, set()
    for bfl_name, parts in bfl_linear_map(n_double, n_single).items():
        found = [mods.get(p) for p in parts]
        if not any(found):
            continue
        if not all(found):
            raise ToolError(f"{bfl_name}: the LoRA has {sum(f is not None for f in found)} of its {len(parts)} parts "
                            f"({', '.join(parts)}); kohya's layout needs all")
        name = "lora_unet_" + bfl_name.replace(".", "_")
        used.update(parts)
        downs = [f.down * math.sqrt(f.scale) for f in found]
        ups = [f.up * math.sqrt(f.scale) for f in found]
        if len(found) == 1:
            down, up = downs[0], ups[0]
        else:
            down = torch.cat(downs, dim=0)
            up = torch.zeros(sum(u.shape[0] for u in ups), down.shape[0], dtype=ups[0].dtype)
            row = col = 0
            for u in ups:
                up[row:row + u.shape[0], col:col + u.shape[1]] = u
                row, col = row + u.shape[0], col + u.shape[1]
        out[name + ".lora_down.weight"] = down.contiguous()
        out[name + ".lora_up.weight"] = up.contiguous()
        out[name + ".alpha"] = torch.tensor(float(down.shape[0]), dtype=down.dtype)
    for path, m in mods.items():
        if path.startswith("text_encoder.text_model."):
            name = "lora_te1_" + path[len("text_encoder."):].replace(".", "_")
            out[name + ".lora_down.weight"] = m.down * math.sqrt(m.scale)
            out[name + ".lora_up.weight"] = m.up * math.sqrt(m.scale)
            out[name + ".alpha"] = torch.tensor(float(m.rank), dtype=m.down.dtype)
            used.add(path)
    left = sorted(set(mods) - used)
    if left:
        logger.warning("%d modules have no kohya counterpart and were left out, e.g. %s", len(left), left[:3])
    return out
