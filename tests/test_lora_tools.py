"""The LoRA tool scripts (sd-scripts/networks/*.py, issue 27) on tiny models built here, run in-process through
their main(argv) (one subprocess checks the real exit status):

- resize_lora.py: on an SDXL LoRA with 3x3-conv modules, each of the four methods gives the ranks upstream's
  rules give and the same per-module effective weights (up x down x alpha / rank) within 1e-3 relative of a
  float64 full-matrix SVD computed here with upstream's rules written out again;
- sdxl_merge_lora.py into a tiny SDXL model: the model loads in our loader and in diffusers' single-file loader,
  each layer moved by exactly the LoRA's effective weight; extract_lora_from_models.py --sdxl gives the LoRA back;
- LoRA-to-LoRA merges (sum, --concat), svd_merge_lora.py, extract_lora_from_dylora.py, check_lora_weights.py;
- FLUX.1: flux_merge_lora.py into the transformer and CLIP-L, flux_extract_lora.py back, convert_flux_lora.py to
  diffusers' layout, which diffusers' FluxPipeline loads and fuses into the same weights as our merge;
- bad input: one `error:` line, exit 2 (another family's LoRA, ranks that do not add, a folder that is no model).
"""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from kohya_gui import REPO
from library import lora_tools
from networks import (check_lora_weights, convert_flux_lora, extract_lora_from_dylora, extract_lora_from_models,
                      flux_extract_lora, flux_merge_lora, merge_lora, resize_lora, sdxl_merge_lora, svd_merge_lora)

pytestmark = pytest.mark.usefixtures("one_thread")

TOOLS = (resize_lora, merge_lora, sdxl_merge_lora, flux_merge_lora, svd_merge_lora, extract_lora_from_models,
         flux_extract_lora, extract_lora_from_dylora, check_lora_weights, convert_flux_lora)


def _metadata(path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def _effective(sd: dict) -> dict[str, torch.Tensor]:
    return {n: lora_tools.effective_weight(m).double() for n, m in lora_tools.lora_modules(sd).items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _spectrum_lora(network, seed: int) -> dict[str, torch.Tensor]:
    """Each module's up x down given a decaying spectrum of its own (so the dynamic methods pick various ranks)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for lora in network.text_encoder_loras + network.unet_loras:
        down, up = lora.lora_down.weight, lora.lora_up.weight
        r, m, n = down.shape[0], up.shape[0], down[0].numel()
        q_up, _ = torch.linalg.qr(torch.randn(m, r, generator=g))
        q_down, _ = torch.linalg.qr(torch.randn(n, r, generator=g))
        decay = 0.2 + 1.5 * torch.rand((), generator=g)
        s = 0.5 * torch.exp(-decay * torch.arange(r, dtype=torch.float32))
        sd[lora.lora_name + ".lora_up.weight"] = (q_up * s).reshape(up.shape).contiguous()
        sd[lora.lora_name + ".lora_down.weight"] = q_down.T.reshape(down.shape).contiguous()
        sd[lora.lora_name + ".alpha"] = torch.tensor(float(lora.alpha))
    return sd


@pytest.fixture(scope="module")
def sdxl_lora(tiny_sdxl_single_file, tmp_path_factory):
    """A rank-8 SDXL LoRA with rank-6 3x3-conv modules (alpha 4 / 3) on the tiny SDXL model."""
    from library.model_util import load_sd_components
    from networks import lora

    comps = load_sd_components(str(tiny_sdxl_single_file), "sdxl", tokenizers=False)
    network = lora.create_network(1.0, 8, 4, None, comps.text_encoders, comps.unet, conv_dim=6, conv_alpha=3)
    sd = _spectrum_lora(network, seed=1)
    path = tmp_path_factory.mktemp("lora_tools") / "sdxl_lora.safetensors"
    lora_tools.save_lora(str(path), sd, {"ss_network_dim": "8", "ss_network_alpha": "4", "ss_v2": "False",
                                         "ss_base_model_version": "sdxl_base_v1-0",
                                         "ss_training_comment": "made in the test"}, overwrite=False)
    assert any(v.dim() == 4 and v.shape[-1] == 3 for v in sd.values())  # 3x3 convs are in it
    return path


# -- resize ------------------------------------------------------------------------------------------------------

def _upstream_rank(S: torch.Tensor, rank: int, method: str | None, param: float | None) -> int:
    """upstream resize_lora.rank_resize, written out again (index + 1, capped, zero matrix -> 1)."""
    n = len(S)
    if method == "sv_ratio":
        new = max(1, min(int(torch.sum(S > S[0] / param)), n - 1)) + 1
    elif method == "sv_cumulative":
        cum = torch.cumsum(S, 0) / torch.sum(S)
        new = max(1, min(int(torch.searchsorted(cum, param)) + 1, n - 1)) + 1
    elif method == "sv_fro":
        cum = torch.cumsum(S ** 2, 0) / torch.sum(S ** 2)
        new = max(1, min(int(torch.searchsorted(cum, param ** 2)) + 1, n - 1)) + 1
    else:
        new = rank
    return 1 if S[0] <= 1e-6 else min(new, rank)


METHODS = [(None, None), ("sv_ratio", 3.0), ("sv_fro", 0.9), ("sv_cumulative", 0.7)]


@pytest.mark.parametrize("method,param", METHODS, ids=[m or "fixed" for m, _ in METHODS])
def test_resize_gives_upstreams_ranks_and_effective_weights(sdxl_lora, tmp_path, capsys, method, param):
    out = tmp_path / "resized.safetensors"
    argv = ["--model", str(sdxl_lora), "--save_to", str(out), "--new_rank", "5", "--new_conv_rank", "4",
            "--device", "cpu", "--verbose"]
    if method:
        argv += ["--dynamic_method", method, "--dynamic_param", str(param)]
    assert resize_lora.main(argv) == 0
    report = capsys.readouterr().out

    original, resized = load_file(str(sdxl_lora)), load_file(str(out))
    mods_in, mods_out = lora_tools.lora_modules(original), lora_tools.lora_modules(resized)
    assert set(mods_in) == set(mods_out)
    ranks = set()
    for name, m in mods_in.items():
        full = lora_tools.delta_weight(m.down.double(), m.up.double()).reshape(m.up.shape[0], -1)
        U, S, Vh = torch.linalg.svd(full)  # float64, full matrices, as upstream decomposes up x down
        rank = _upstream_rank(S, 4 if m.is_conv else 5, method, param)
        got = mods_out[name]
        assert got.rank == rank, name
        assert got.alpha == pytest.approx(m.scale * rank)
        expected = ((U[:, :rank] * S[:rank]) @ Vh[:rank]) * m.scale
        assert _rel(lora_tools.effective_weight(got).double().reshape(expected.shape), expected) < 1e-3, name
        assert got.down.shape[1:] == m.down.shape[1:] and got.up.shape[2:] == m.up.shape[2:]
        ranks.add(rank)
        assert f"{name:75} | sum(S) retained:" in report
    if method:
        assert len(ranks) > 1, "the spectra should make the dynamic method pick several ranks"
        assert f", dynamic | dim: " in report
    assert "Average Frobenius norm retention:" in report

    md = _metadata(out)
    if method:
        assert md["ss_network_dim"] == md["ss_network_alpha"] == "Dynamic"
        assert md["ss_training_comment"] == f"Dynamic resize with {method}: {param} from 8; made in the test"
    else:
        assert md["ss_network_dim"] == "5"
        assert md["ss_training_comment"] == "dimension is resized from 8 to 5 (conv: 4); made in the test"
    from library import train_util

    assert (md["sshs_model_hash"], md["sshs_legacy_hash"]) == train_util.model_hashes(resized, md)


# -- merge into SDXL, extract back ------------------------------------------------------------------------------

def test_merge_into_sdxl_loads_everywhere_and_extracts_back(sdxl_lora, tiny_sdxl_single_file, tiny_sdxl_diffusers,
                                                            tmp_path):
    from diffusers import StableDiffusionXLPipeline

    merged = tmp_path / "merged.safetensors"
    assert sdxl_merge_lora.main(["--sd_model", str(tiny_sdxl_single_file), "--models", str(sdxl_lora),
                                 "--ratios", "1.0", "--save_to", str(merged)]) == 0
    md = _metadata(merged)
    assert md["modelspec.merged_from"] == "tiny random sdxl, sdxl_lora"  # titles, else file names
    assert md["modelspec.architecture"] == "stable-diffusion-xl-v1-base" and md["modelspec.title"] == "merged"

    base = lora_tools.load_sd_model(str(tiny_sdxl_single_file), "sdxl", torch.float32)
    ours = lora_tools.load_sd_model(str(merged), "sdxl", torch.float32)
    layers_b = lora_tools.sd_layer_map(base.text_encoders, base.unet)
    layers_m = lora_tools.sd_layer_map(ours.text_encoders, ours.unet)
    effective = _effective(load_file(str(sdxl_lora)))
    for name, w in effective.items():
        moved = (layers_m[name].weight - layers_b[name].weight).detach().double()
        assert _rel(moved, w.reshape(moved.shape)) < 1e-4, name
    pipe = StableDiffusionXLPipeline.from_single_file(str(merged), config=str(tiny_sdxl_diffusers),
                                                      local_files_only=True)
    name = next(n for n in effective if n.startswith("lora_unet_") and effective[n].dim() == 4)
    assert torch.allclose(dict(pipe.unet.named_modules())[next(
        p for p, mod in ours.unet.named_modules() if mod is layers_m[name])].weight, layers_m[name].weight)

    extracted = tmp_path / "extracted.safetensors"
    assert extract_lora_from_models.main(["--sdxl", "--model_org", str(tiny_sdxl_single_file), "--model_tuned",
                                          str(merged), "--save_to", str(extracted), "--dim", "8", "--conv_dim", "6",
                                          "--clamp_quantile", "1", "--device", "cpu"]) == 0
    back = _effective(load_file(str(extracted)))
    assert set(back) == set(effective)
    errors = {n: _rel(back[n].reshape(w.shape), w) for n, w in effective.items()}
    total = math.sqrt(sum(float((back[n].reshape(w.shape) - w).norm() ** 2) for n, w in effective.items())
                      / sum(float(w.norm() ** 2) for w in effective.values()))
    assert total < 0.05, total
    assert sorted(errors.values())[int(0.9 * len(errors))] < 0.05  # upstream's clamp (-q..q) cuts a few tails
    md = _metadata(extracted)
    assert md["ss_network_dim"] == "8" and json.loads(md["ss_network_args"]) == {"conv_dim": "6", "conv_alpha": "6.0"}
    assert md["ss_base_model_version"] == "sdxl_base_v1-0" and md["modelspec.architecture"].endswith("/lora")


@pytest.mark.parametrize("save_precision", ["fp16", "float"])
def test_merge_into_an_fp16_model_saves_the_bits_of_an_all_fp32_merge(sdxl_lora, tiny_sdxl_single_file, tmp_path,
                                                                       save_precision):
    """The merge keeps the file's fp16 tensors uncast and upcasts only the layers it changes: every saved tensor
    has the bits of upstream's recipe (the whole model in fp32, W += ratio * up x down * alpha / rank per LoRA,
    then cast to --save_precision), two LoRAs accumulating in fp32."""
    from library import model_util

    fp16_model = tmp_path / "fp16.safetensors"
    model_util.save_sd_checkpoint(fp16_model, model_util.load_sd_components(str(tiny_sdxl_single_file), "sdxl",
                                                                            tokenizers=False),
                                  save_dtype=torch.float16)
    merged = tmp_path / "merged.safetensors"
    assert sdxl_merge_lora.main(["--sd_model", str(fp16_model), "--models", str(sdxl_lora), str(sdxl_lora),
                                 "--ratios", "0.7", "-0.3", "--save_precision", save_precision,
                                 "--save_to", str(merged)]) == 0

    comps = model_util.load_sd_components(str(fp16_model), "sdxl", dtype=torch.float32, tokenizers=False)
    layers = lora_tools.sd_layer_map(comps.text_encoders, comps.unet)
    for ratio in (0.7, -0.3):
        for name, m in lora_tools.lora_modules(load_file(str(sdxl_lora))).items():
            w = layers[name].weight
            w.data = w.data + (m.up.float().reshape(m.up.shape[0], -1) @ m.down.float().reshape(m.rank, -1)
                               ).reshape(w.shape) * (ratio * m.scale)
    reference = tmp_path / "reference.safetensors"
    model_util.save_sd_checkpoint(reference, comps, save_dtype=torch.float16 if save_precision == "fp16" else None)
    ours, ref = load_file(str(merged)), load_file(str(reference))
    assert set(ours) == set(ref) and len(ours) > 100
    dtype = torch.float16 if save_precision == "fp16" else torch.float32
    assert {v.dtype for v in ours.values() if v.is_floating_point()} == {dtype}
    assert [k for k in ref if not torch.equal(ours[k], ref[k])] == []
    q_proj = model_util.SDXL_TE1_PREFIX + "text_model.encoder.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(ours[q_proj], load_file(str(fp16_model))[q_proj].to(dtype))  # the LoRAs moved it


def test_streamed_safetensors_writer_writes_the_librarys_bytes(tiny_sdxl_single_file, tmp_path):
    """save_sd_checkpoint writes a model on a GPU with safetensors_io.save_file_streamed: its file is the one
    safetensors.torch.save_file writes (the same header, length and tensor order, the data byte for byte; only
    the order of the metadata keys, which the library takes from a hash map, may differ), for every dtype, odd
    shapes, non-contiguous views, a cast on the way and buffers smaller than a tensor (run here on the CPU)."""

    def parts(path):
        raw = path.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        return n, json.loads(raw[8:8 + n]), raw[8 + n:]

    from safetensors.torch import save_file

    from library import model_util
    from library.safetensors_io import save_file_streamed

    g = torch.Generator().manual_seed(0)
    tensors = {"b.w": torch.randn(30, 7, generator=g), "a.h": torch.randn(13, generator=g).half(),
               "c.bf": torch.randn(5, 3, generator=g).bfloat16(), "f64": torch.randn(3, dtype=torch.float64),
               "i64": torch.arange(7), "i32": torch.arange(5, dtype=torch.int32), "i16": torch.arange(3).short(),
               "i8": torch.arange(3, dtype=torch.int8), "u8": torch.arange(11, dtype=torch.uint8),
               "flag": torch.tensor([True, False, True]), "scalar": torch.tensor(3.5), "empty": torch.empty(0, 4),
               "view": torch.randn(8, 6, generator=g).t(), "f8": torch.randn(5, generator=g).to(torch.float8_e4m3fn),
               "f8b": torch.randn(2, 3, generator=g).to(torch.float8_e5m2)}
    meta = {"modelspec.title": "Zürich ☃ \"quoted\"", "format": "pt"}
    for cast, chunk in ((None, 64), (torch.float16, 1 << 20)):  # buffers smaller / larger than all the data
        ref, ours = tmp_path / f"ref{cast}.safetensors", tmp_path / f"ours{cast}.safetensors"
        save_file({k: (v.to(cast) if cast and v.is_floating_point() else v).contiguous() for k, v in tensors.items()},
                  str(ref), metadata=meta)
        save_file_streamed(tensors, ours, meta, float_dtype=cast, chunk_bytes=chunk)
        assert parts(ours) == parts(ref), cast

    comps = model_util.load_sd_components(str(tiny_sdxl_single_file), "sdxl", tokenizers=False)
    saved = model_util.save_sd_checkpoint(tmp_path / "lib.safetensors", comps, save_dtype="fp16", metadata=meta)
    meta_pt = {**meta, "format": "pt"}
    save_file_streamed(model_util.components_to_ldm_state_dict(comps), tmp_path / "streamed.safetensors", meta_pt,
                       float_dtype=torch.float16, chunk_bytes=4096)
    assert parts(tmp_path / "streamed.safetensors") == parts(saved)


def _mapped_files(tensors) -> set[str]:
    """The files whose memory mappings hold these tensors' data (/proc/self/maps)."""
    maps = []
    for line in open("/proc/self/maps").read().splitlines():
        fields = line.split()
        if len(fields) >= 6:
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            maps.append((lo, hi, fields[5]))
    return {name for t in tensors for lo, hi, name in maps if lo <= t.data_ptr() < hi}


def test_save_over_the_memory_mapped_file_the_model_came_from(tiny_sdxl_single_file, tmp_path, writes_fail_past):
    """A trainer or tool that saves over the checkpoint its model was read from (--overwrite_output, --save_to =
    --sd_model): the model's tensors are memory-mapped from that file while the new one is written. The save
    writes a temporary file and renames it over the old one at the end, so the mapped tensors keep their values,
    the new file has the bytes a save to a fresh name has, and a save the disk refuses halfway leaves the old file
    whole and no temporary file behind."""
    import shutil

    from library import model_util
    from library.errors import SaveError

    path = tmp_path / "model.safetensors"
    shutil.copyfile(tiny_sdxl_single_file, path)
    before = path.read_bytes()
    comps = model_util.load_sd_components(str(path), "sdxl", dtype=None, tokenizers=False)  # as stored: mapped
    params = list(comps.unet.parameters())
    assert str(path) in _mapped_files(params)
    kept = [p.detach().clone() for p in params]
    with torch.no_grad():
        params[0].add_(1.0)  # a trained weight (the mapping is private: the file keeps its bytes)
    kept[0] += 1.0

    with writes_fail_past(len(before) // 3), pytest.raises(SaveError, match="File too large"):
        model_util.save_sd_checkpoint(path, comps, save_dtype="bf16", overwrite=True)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]

    fresh = model_util.save_sd_checkpoint(tmp_path / "fresh" / "model.safetensors", comps, save_dtype="bf16")
    model_util.save_sd_checkpoint(path, comps, save_dtype="bf16", overwrite=True)
    assert all(torch.equal(p, k) for p, k in zip(params, kept))  # the old file's mapping is still read
    assert path.read_bytes() == fresh.read_bytes() != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "model.safetensors"]


def test_merge_saved_over_its_own_input(sdxl_lora, tiny_sdxl_single_file, tmp_path, writes_fail_past, capsys):
    """sdxl_merge_lora.py --save_to naming its --sd_model (with --overwrite): the merged file is the one a merge to
    another folder writes; when the disk refuses that save halfway, the input stays whole (one error line, exit 2)."""
    import shutil

    for folder in ("a", "b", "c"):
        (tmp_path / folder).mkdir()
    for folder in ("a", "b"):
        shutil.copyfile(tiny_sdxl_single_file, tmp_path / folder / "model.safetensors")
    model, elsewhere = tmp_path / "b" / "model.safetensors", tmp_path / "c" / "model.safetensors"
    argv = ["--models", str(sdxl_lora), "--ratios", "0.8", "--save_precision", "fp16"]
    assert sdxl_merge_lora.main(["--sd_model", str(tmp_path / "a" / "model.safetensors"), "--save_to",
                                 str(elsewhere), *argv]) == 0
    before = model.read_bytes()
    with writes_fail_past(elsewhere.stat().st_size // 2):
        assert sdxl_merge_lora.main(["--sd_model", str(model), "--save_to", str(model), "--overwrite", *argv]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"error: cannot save {model}: File too large")
    assert model.read_bytes() == before and [p.name for p in model.parent.iterdir()] == ["model.safetensors"]

    assert sdxl_merge_lora.main(["--sd_model", str(model), "--save_to", str(model), "--overwrite", *argv]) == 0
    ours, ref = load_file(str(model)), load_file(str(elsewhere))
    assert set(ours) == set(ref) and [k for k in ref if not torch.equal(ours[k], ref[k])] == []
    undated = [{k: v for k, v in _metadata(p).items() if k != "modelspec.date"} for p in (model, elsewhere)]
    assert undated[0] == undated[1] and model.read_bytes() != before
    assert [p.name for p in model.parent.iterdir()] == ["model.safetensors"]


# -- LoRA to LoRA -----------------------------------------------------------------------------------------------

def test_merge_loras_sum_and_concat(sdxl_lora, tmp_path):
    summed, concat = tmp_path / "sum.safetensors", tmp_path / "concat.safetensors"
    assert sdxl_merge_lora.main(["--models", str(sdxl_lora), str(sdxl_lora), "--ratios", "0.5", "0.25",
                                 "--save_to", str(summed)]) == 0
    assert sdxl_merge_lora.main(["--models", str(sdxl_lora), str(sdxl_lora), "--ratios", "1", "1", "--concat",
                                 "--save_to", str(concat)]) == 0
    original = load_file(str(sdxl_lora))
    s = load_file(str(summed))
    for key, v in original.items():  # upstream: each matrix times ratio (|ratio| on up), alpha of the first
        expected = v if key.endswith(".alpha") else v * 0.75
        assert torch.allclose(s[key], expected, atol=1e-6), key
    eff_in, eff_concat = _effective(original), _effective(load_file(str(concat)))
    for name, w in eff_in.items():  # rank doubled with the same alpha: the same effective weight
        assert _rel(eff_concat[name], w) < 1e-6
    md = _metadata(concat)
    assert md["ss_network_dim"] == "Dynamic" or md["ss_network_dim"] == "8"
    assert md["modelspec.merged_from"] == "sdxl_lora, sdxl_lora"


def test_svd_merge_adds_the_effective_weights(sdxl_lora, tmp_path, monkeypatch):
    resized = tmp_path / "r.safetensors"
    assert resize_lora.main(["--model", str(sdxl_lora), "--save_to", str(resized), "--new_rank", "3",
                             "--device", "cpu"]) == 0
    out = tmp_path / "svd.safetensors"
    monkeypatch.setattr(lora_tools, "clamp_quantile", lambda up, down, q: (up, down))  # upstream's fixed 0.99 clamp
    assert svd_merge_lora.main(["--models", str(sdxl_lora), str(resized), "--ratios", "0.7", "-0.4",
                                "--new_rank", "11", "--new_conv_rank", "9", "--save_to", str(out),
                                "--device", "cpu"]) == 0
    a, b, merged = (_effective(load_file(str(p))) for p in (sdxl_lora, resized, out))
    mods = lora_tools.lora_modules(load_file(str(out)))
    for name in a:
        assert _rel(merged[name], 0.7 * a[name] - 0.4 * b[name]) < 1e-3, name
        is3 = mods[name].is_conv and mods[name].kernel != (1, 1)
        layer_out, layer_in = mods[name].up.shape[0], mods[name].down.shape[1]
        assert mods[name].rank == min(9 if is3 else 11, layer_out, layer_in)
        assert mods[name].alpha == mods[name].rank
    monkeypatch.undo()
    clamped = tmp_path / "clamped.safetensors"
    assert svd_merge_lora.main(["--models", str(sdxl_lora), "--ratios", "1", "--new_rank", "8", "--save_to",
                                str(clamped), "--device", "cpu"]) == 0
    for name, m in lora_tools.lora_modules(load_file(str(clamped))).items():
        values = torch.cat([m.up.flatten(), m.down.flatten()])
        assert int((values.abs() == values.abs().max()).sum()) >= 2, name  # the clamped values sit at -q or q
    md = _metadata(out)
    assert json.loads(md["ss_network_args"]) == {"conv_dim": 9, "conv_alpha": 9}
    assert md["ss_network_dim"] == "11" and md["modelspec.architecture"] == "stable-diffusion-xl-v1-base/lora"


def test_dylora_split_and_check_weights(sdxl_lora, tmp_path, capsys):
    assert extract_lora_from_dylora.main(["--model", str(sdxl_lora), "--save_to", str(tmp_path / "dy.safetensors"),
                                          "--unit", "3"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dy-0003.safetensors", "dy-0006.safetensors"]
    original, part = load_file(str(sdxl_lora)), load_file(str(tmp_path / "dy-0003.safetensors"))
    for key, v in original.items():
        expected = v[:3] if "lora_down" in key else v[:, :3] if "lora_up" in key else v
        assert torch.equal(part[key], expected)
    md = _metadata(tmp_path / "dy-0006.safetensors")
    assert md["ss_network_dim"] == "6" and md["ss_training_comment"].startswith("split from DyLoRA, rank 8 to 6;")

    capsys.readouterr()
    assert check_lora_weights.main([str(sdxl_lora)]) == 0
    lines = capsys.readouterr().out.splitlines()
    n = sum(1 for k in original if "lora_up" in k or "lora_down" in k)
    assert lines[0] == f"number of LoRA modules: {n}" and len(lines) == n + 1
    key, shape, mean, minimum = lines[1].split(",")
    assert shape == str(tuple(original[key].shape)).replace(", ", "-")
    assert float(mean) == pytest.approx(float(original[key].abs().mean()))


# -- extract: the top singular triplets from the Gram matrix, against upstream's full SVD ---------------------

def _low_rank_plus_noise(g, m, n, rank, noise):
    a, b = torch.randn(m, rank, generator=g), torch.randn(rank, n, generator=g)
    return (a * torch.linspace(1, 0.5, rank)) @ b / (m * n) ** 0.25 + noise * torch.randn(m, n, generator=g) / n ** 0.5


def _upstream_extract(mat: torch.Tensor, rank: int, quantile: float):
    """upstream flux_extract_lora.py / extract_lora_from_models.py per module, written out again: full SVD in
    float32, up = U diag(S), down = Vh, both clamped at the quantile of all their values."""
    U, S, Vh = torch.linalg.svd(mat)
    up, down = U[:, :rank] @ torch.diag(S[:rank]), Vh[:rank]
    hi = torch.quantile(torch.cat([up.flatten(), down.flatten()]), quantile)
    return up.clamp(-hi, hi), down.clamp(-hi, hi)


def test_top_svd_from_the_gram_matrix_is_the_full_svds_within_float32_noise():
    g = torch.Generator().manual_seed(0)
    mats = {"wide": _low_rank_plus_noise(g, 48, 192, 8, 1e-3), "tall": _low_rank_plus_noise(g, 192, 48, 8, 0.3),
            "wide2": _low_rank_plus_noise(g, 48, 192, 8, 3.0), "noise": torch.randn(40, 100, generator=g),
            "rank2": _low_rank_plus_noise(g, 30, 50, 2, 0.0), "zero": torch.zeros(16, 24)}
    got = {n: (U, S, Vh) for n, U, S, Vh in
           lora_tools.top_svd_many(mats, dict.fromkeys(mats, 8), torch.device("cpu"), desc=None)}
    assert set(got) == set(mats)
    for name, mat in mats.items():
        U, S, Vh = got[name]
        assert U.dtype == S.dtype == Vh.dtype == torch.float32
        assert U.shape == (mat.shape[0], 8) and S.shape == (8,) and Vh.shape == (8, mat.shape[1])
        u, s, vh = torch.linalg.svd(mat.double(), full_matrices=False)  # the exact answer, float64
        u32, s32, vh32 = torch.linalg.svd(mat)  # upstream's, float32
        exact, upstream = (u[:, :8] * s[:8]) @ vh[:8], (u32[:, :8] * s32[:8]) @ vh32[:8]
        ours = (U * S) @ Vh
        if name == "zero":  # the full-SVD fallback: nothing to keep
            assert float(ours.abs().max()) == 0.0
            continue
        assert float((S.double() - s[:8]).abs().max()) <= 1e-6 * float(s[0])
        assert _rel(ours.double(), exact) <= max(2 * _rel(upstream.double(), exact), 1e-6), name
        assert float((U.T @ U - torch.eye(8)).abs().max()) < 1e-5 or name == "rank2"  # orthonormal columns


@pytest.mark.parametrize("quantile", [0.99, 1.0])
def test_extract_gives_upstreams_lora_but_for_the_svds_signs(quantile):
    """The clamp's threshold (the quantile of up's and down's values, clamped to [-q, q]) depends on each singular
    pair's sign, which no SVD fixes (LAPACK and cuSOLVER may choose either): with ours turned to upstream's signs,
    the clamped LoRA is upstream's within float32 noise."""
    g = torch.Generator().manual_seed(1)
    diffs = {f"m{i}": _low_rank_plus_noise(g, 96, 384, 16, noise) for i, noise in enumerate((1e-3, 0.3, 3.0))}
    diffs["tall"] = _low_rank_plus_noise(g, 384, 96, 16, 0.3)
    for name, U, S, Vh in lora_tools.top_svd_many(diffs, dict.fromkeys(diffs, 16), torch.device("cpu"), desc=None):
        up_ref, down_ref = _upstream_extract(diffs[name], 16, quantile)
        sign = torch.sign(((U * S) * up_ref).sum(0))
        up, down = lora_tools.clamp_quantile(*lora_tools.truncate(U * sign, S, Vh * sign[:, None], 16), quantile)
        assert _rel(up, up_ref) < 1e-4 and _rel(down, down_ref) < 1e-4, name
        assert _rel(up @ down, up_ref @ down_ref) < 1e-4, name


# -- FLUX.1 -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def flux_setup(tmp_path_factory):
    from library import flux_models, flux_tiny
    from networks import lora_flux

    root = tmp_path_factory.mktemp("flux_tools")
    paths = flux_tiny.make_tiny_flux(root / "model", diffusers_folder=True)
    transformer = flux_models.load_flux_transformer(paths["transformer"], dtype=torch.float32)
    clip = flux_models.load_clip_l(paths["clip_l"], torch.float32)
    network = lora_flux.create_network(1.0, 4, 2, None, [clip], transformer)
    network.apply_to([clip], transformer)
    g = torch.Generator().manual_seed(3)
    for p in network.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.1
    paths["lora"] = str(root / "flux_lora.safetensors")
    network.save_weights(paths["lora"], torch.float32, {"ss_base_model_version": "flux1"})
    return paths


def test_flux_merge_extract_convert_and_load_in_diffusers(flux_setup, tmp_path):
    from diffusers import FluxPipeline

    from library import flux_models

    p = flux_setup
    merged, clip_out = tmp_path / "merged.safetensors", tmp_path / "clip.safetensors"
    assert flux_merge_lora.main(["--flux_model", p["transformer"], "--clip_l", p["clip_l"], "--clip_l_save_to",
                                 str(clip_out), "--models", p["lora"], "--ratios", "1", "--save_to", str(merged)]) == 0
    assert _metadata(merged)["modelspec.merged_from"] == "flux, flux_lora"
    assert set(load_file(str(merged))) == set(load_file(p["transformer"]))

    diffusers_lora = tmp_path / "diffusers_lora.safetensors"
    assert convert_flux_lora.main(["--src", "sd-scripts", "--dst", "ai-toolkit", "--src_path", p["lora"],
                                   "--dst_path", str(diffusers_lora)]) == 0
    pipe = FluxPipeline.from_pretrained(p["diffusers"], torch_dtype=torch.float32)
    pipe.load_lora_weights(str(diffusers_lora))
    pipe.fuse_lora(components=["transformer", "text_encoder"], lora_scale=1.0)
    pipe.unload_lora_weights()  # fused weights stay, the LoRA layers go
    ours = flux_models.load_flux_transformer(str(merged), dtype=torch.float32).state_dict()
    theirs = pipe.transformer.state_dict()
    for key, value in ours.items():
        assert torch.allclose(theirs[key], value, atol=1e-5), key
    clip_merged = load_file(str(clip_out))
    te = {("text_model." + k if not k.startswith("text_model.") else k): v
          for k, v in pipe.text_encoder.state_dict().items()}
    assert torch.allclose(te["text_model.encoder.layers.0.self_attn.q_proj.weight"],
                          clip_merged["text_model.encoder.layers.0.self_attn.q_proj.weight"], atol=1e-5)
    assert not torch.allclose(clip_merged["text_model.encoder.layers.0.self_attn.q_proj.weight"],
                              load_file(p["clip_l"])["text_model.encoder.layers.0.self_attn.q_proj.weight"])

    back = tmp_path / "back.safetensors"
    assert convert_flux_lora.main(["--src", "ai-toolkit", "--dst", "sd-scripts", "--src_path", str(diffusers_lora),
                                   "--dst_path", str(back)]) == 0
    original = _effective(load_file(p["lora"]))
    for name, w in _effective(load_file(str(back))).items():
        assert _rel(w, original[name]) < 1e-5, name

    extracted = tmp_path / "extracted.safetensors"
    assert flux_extract_lora.main(["--model_org", p["diffusers"], "--model_tuned", str(merged), "--save_to",
                                   str(extracted), "--dim", "4", "--clamp_quantile", "1", "--device", "cpu"]) == 0
    got = _effective(load_file(str(extracted)))
    unet = {n: w for n, w in original.items() if n.startswith("lora_unet_") and "_blocks_" in n}
    assert set(got) == set(unet)
    total = math.sqrt(sum(float((got[n] - w).norm() ** 2) for n, w in unet.items())
                      / sum(float(w.norm() ** 2) for w in unet.values()))
    assert total < 0.05
    md = _metadata(extracted)
    assert md["ss_network_module"] == "networks.lora_flux" and md["modelspec.architecture"] == "flux-1-dev/lora"


def test_flux_extract_is_upstreams_method_within_float32_noise(flux_setup, tmp_path):
    """flux_extract_lora.py (the Gram route, default clamp) against upstream's per-module full SVD written out again,
    on a tuned model = original + a rank-6 change + full-rank noise: the same modules and ranks, and the same
    decompositions (effective weights within 1e-4 once the SVD's arbitrary signs are aligned, see the bench)."""
    import importlib.util

    from safetensors.torch import save_file

    spec = importlib.util.spec_from_file_location("bench_lora_tools", REPO / "tools" / "bench_lora_tools.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    org = load_file(flux_setup["transformer"])
    targets = [k for k in org if ("single_block" in k or "double_block" in k) and ".bias" not in k
               and "norm" not in k]
    assert targets
    g = torch.Generator().manual_seed(5)
    tuned = dict(org)
    for k in targets:
        tuned[k] = org[k] + _low_rank_plus_noise(g, *org[k].shape, 6, 0.05).to(org[k].dtype)
    tuned_path, ours, theirs = (str(tmp_path / f) for f in ("tuned.safetensors", "ours.safetensors",
                                                              "upstream.safetensors"))
    save_file(tuned, tuned_path)
    assert flux_extract_lora.main(["--model_org", flux_setup["transformer"], "--model_tuned", tuned_path,
                                   "--save_to", ours, "--dim", "4", "--device", "cpu"]) == 0
    upstream = {}
    for k in targets:
        diff = tuned[k].float() - org[k].float()
        up, down = _upstream_extract(diff, min(4, *diff.shape), 0.99)
        name = "lora_unet_" + k.replace(".weight", "").replace(".", "_")
        upstream |= {f"{name}.lora_up.weight": up.contiguous(), f"{name}.lora_down.weight": down.contiguous(),
                     f"{name}.alpha": torch.tensor(down.shape[0])}
    save_file(upstream, theirs)
    check = bench.compare_loras(ours, theirs, svd_signs=True)
    assert check["modules"] == [len(targets)] * 2 and check["ranks_equal"] == len(targets)
    assert check["max_rel_diff_svd_signs_aligned"] < 1e-4


def test_flux_lora_to_lora_merge_takes_diffusers_layout(flux_setup, tmp_path):
    diffusers_lora = tmp_path / "d.safetensors"
    assert convert_flux_lora.main(["--src", "sd-scripts", "--dst", "ai-toolkit", "--src_path", flux_setup["lora"],
                                   "--dst_path", str(diffusers_lora)]) == 0
    out = tmp_path / "merged.safetensors"
    assert flux_merge_lora.main(["--models", flux_setup["lora"], "--ratios", "1", "--save_to", str(out)]) == 0
    assert _metadata(out)["ss_network_module"] == "networks.lora_flux"
    both = tmp_path / "both.safetensors"
    assert flux_merge_lora.main(["--models", str(diffusers_lora), str(diffusers_lora), "--ratios", "1", "1",
                                 "--concat", "--diffusers", "--save_to", str(both)]) == 0
    original = _effective(load_file(flux_setup["lora"]))
    for name, w in _effective(load_file(str(both))).items():  # twice the rank, same alpha / rank: 1 x effective
        assert _rel(w, original[name]) < 1e-5, name


# -- bad input ----------------------------------------------------------------------------------------------------

def _one_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_bad_input_is_one_line_exit_2(sdxl_lora, tiny_sd1_single_file, tmp_path, capsys, flux_setup):
    out = str(tmp_path / "out.safetensors")
    assert merge_lora.main(["--sd_model", str(tiny_sd1_single_file), "--models", str(sdxl_lora), "--ratios", "1",
                            "--save_to", out]) == 2
    assert "an SDXL LoRA, but the model is SD1.x; use sdxl_merge_lora.py" in _one_error(capsys)
    assert flux_merge_lora.main(["--flux_model", flux_setup["transformer"], "--models", str(sdxl_lora),
                                 "--ratios", "1", "--save_to", out]) == 2
    assert "an SDXL LoRA, but the model is FLUX.1" in _one_error(capsys)
    resized = tmp_path / "r4.safetensors"
    assert resize_lora.main(["--model", str(sdxl_lora), "--save_to", str(resized), "--new_rank", "4",
                             "--device", "cpu"]) == 0
    capsys.readouterr()
    assert sdxl_merge_lora.main(["--models", str(sdxl_lora), str(resized), "--ratios", "1", "1",
                                 "--save_to", out]) == 2
    assert "different ranks (dims) cannot be added" in _one_error(capsys)
    not_a_model = tmp_path / "folder"
    not_a_model.mkdir()
    assert extract_lora_from_models.main(["--model_org", str(not_a_model), "--model_tuned", str(not_a_model),
                                          "--save_to", out]) == 2
    assert "not a diffusers model" in _one_error(capsys)
    assert flux_merge_lora.main(["--flux_model", str(not_a_model), "--models", flux_setup["lora"], "--ratios", "1",
                                 "--save_to", out]) == 2
    assert "not a FLUX.1 diffusers model" in _one_error(capsys)
    assert resize_lora.main(["--model", str(sdxl_lora), "--save_to", str(resized)]) == 2
    assert "already exists" in _one_error(capsys)
    assert resize_lora.main(["--model", str(sdxl_lora), "--save_to", out, "--dynamic_method", "sv_fro"]) == 2
    assert "needs --dynamic_param" in _one_error(capsys)
    assert not (tmp_path / "out.safetensors").exists()


def test_exit_status_in_a_real_process(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "sd-scripts" / "networks" / "svd_merge_lora.py"),
                           "--models", str(tmp_path / "a.safetensors"), "--ratios", "1", "0.5",
                           "--save_to", str(tmp_path / "o.safetensors")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("error: --models and --ratios: 1 models but 2 ratios; give one "
                                                    "ratio per model")


@pytest.mark.parametrize("tool", TOOLS, ids=[t.__name__.split(".")[-1] for t in TOOLS])
def test_dump_options(tool, capsys):
    with pytest.raises(SystemExit) as e:
        tool.main(["--dump_options"])
    assert e.value.code == 0
    entries = json.loads(capsys.readouterr().out)
    names = {x["name"] for x in entries}
    assert {"dump_options", "help"}.isdisjoint(names) and entries
    parser = tool.setup_parser()
    assert names == {a.dest for a in parser._actions if a.dest not in ("help", "dump_options")}


def test_benchmark_commands_are_valid_tool_command_lines(tmp_path, capsys):
    """tools/bench_lora_tools.py --dry_run: the command lines it would time (ours, and upstream's through its
    --upstream_launch) parse with the tools' own parsers (the same options upstream's take, plus --overwrite for
    ours), the WD14 tagger's included."""
    import importlib.util
    import shlex

    def load(name, path):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    bench = load("bench_lora_tools", REPO / "tools" / "bench_lora_tools.py")
    assert bench.main(["--work_dir", str(tmp_path), "--dry_run", "--upstream", "/opt/sd-scripts"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    names = {line.split("] ", 1)[1].split(":", 1)[0] for line in lines}
    assert names == {"sdxl_resize", "sdxl_resize_sv_fro", "sdxl_merge", "sdxl_merge_loras", "sdxl_extract",
                     "sd_merge", "sdxl_merge_profile", "flux_extract", "wd14_8", "wd14_88"}
    assert len(lines) == 2 * len(names) - 1  # the profiled merge is ours only
    parsers = {t.__name__.split(".")[-1]: t.setup_parser for t in TOOLS}
    parsers["tag_images_by_wd14_tagger"] = load(
        "wd14", REPO / "sd-scripts" / "finetune" / "tag_images_by_wd14_tagger.py").setup_parser
    for line in lines:
        who, rest = line.split("] ", 1)
        argv = shlex.split(rest.split(": ", 1)[1])
        if who == "[upstream":
            assert argv[1].endswith("tools/bench_lora_tools.py") and argv[2] == "--upstream_launch"
            argv = [argv[0], *argv[3:]]
            assert argv[1].startswith("/opt/sd-scripts/")
        else:
            if argv[1:3] == ["-m", "cProfile"]:  # sdxl_merge_profile: python -m cProfile -o FILE script ...
                assert argv[3] == "-o" and argv[4].endswith(".prof")
                argv = [argv[0], *argv[5:]]
            assert argv[1].startswith(str(REPO))
        parsers[argv[1].rsplit("/", 1)[1][:-3]]().parse_args(argv[2:])

def test_sd1_merge_from_a_diffusers_folder_and_extract(tiny_sd1_single_file, tiny_sd1_diffusers, tmp_path):
    """SD1.x: the model read from its diffusers folder, the LoRA (1x1-conv proj_in/out, 3x3 convs) merged and
    written as an LDM single file, then extracted back from the two single files."""
    from library.model_util import load_sd_components
    from networks import lora

    comps = load_sd_components(str(tiny_sd1_single_file), "sd1", tokenizers=False)
    network = lora.create_network(1.0, 4, 2, None, comps.text_encoders[0], comps.unet, conv_dim=4, conv_alpha=4)
    lora_path = tmp_path / "sd1_lora.safetensors"
    lora_tools.save_lora(str(lora_path), _spectrum_lora(network, seed=5), {"ss_v2": "False"}, overwrite=False)
    merged = tmp_path / "merged.safetensors"
    assert merge_lora.main(["--sd_model", str(tiny_sd1_diffusers), "--models", str(lora_path), "--ratios", "0.5",
                            "--save_to", str(merged), "--save_precision", "float"]) == 0
    assert _metadata(merged)["modelspec.architecture"] == "stable-diffusion-v1"
    extracted = tmp_path / "extracted.safetensors"
    assert extract_lora_from_models.main(["--model_org", str(tiny_sd1_single_file), "--model_tuned", str(merged),
                                          "--save_to", str(extracted), "--dim", "4", "--conv_dim", "4",
                                          "--clamp_quantile", "1", "--device", "cpu"]) == 0
    original, back = _effective(load_file(str(lora_path))), _effective(load_file(str(extracted)))
    assert set(back) == set(original)
    assert any(w.dim() == 4 and w.shape[-1] == 1 for w in original.values())  # SD1's 1x1-conv proj_in/out
    total = math.sqrt(sum(float((back[n].reshape(w.shape) - 0.5 * w).norm() ** 2) for n, w in original.items())
                      / sum(float((0.5 * w).norm() ** 2) for w in original.values()))
    assert total < 0.05, total
    md = _metadata(extracted)
    assert md["ss_base_model_version"] == "sd_v1" and md["ss_v2"] == "False"


def test_sdxl_merge_with_layer_block_weights_and_oft(sdxl_lora, tiny_sdxl_single_file, tmp_path):
    from library.model_util import load_sd_components
    from networks import oft

    # --lbws: 12 values (SDXL's preset: BASE, IN04, IN05, IN07, IN08, MID, OUT00-OUT05); BASE (text encoders)
    # and IN04 at 0, the rest at 1; layers outside the preset keep weight 1
    lbw = "[0,0,1,1,1,1,1,1,1,1,1,1]"
    merged = tmp_path / "lbw.safetensors"
    assert sdxl_merge_lora.main(["--sd_model", str(tiny_sdxl_single_file), "--models", str(sdxl_lora),
                                 "--ratios", "1", "--lbws", lbw, "--save_to", str(merged)]) == 0
    base = lora_tools.load_sd_model(str(tiny_sdxl_single_file), "sdxl", torch.float32)
    ours = lora_tools.load_sd_model(str(merged), "sdxl", torch.float32)
    layers_b = lora_tools.sd_layer_map(base.text_encoders, base.unet)
    layers_m = lora_tools.sd_layer_map(ours.text_encoders, ours.unet)
    effective = _effective(load_file(str(sdxl_lora)))
    kinds = set()
    for name, w in effective.items():
        moved = (layers_m[name].weight - layers_b[name].weight).detach().double()
        off = name.startswith("lora_te") or name.startswith("lora_unet_input_blocks_4_")
        kinds.add(off)
        assert (float(moved.abs().max()) < 1e-6) if off else _rel(moved, w.reshape(moved.shape)) < 1e-4, name
    assert kinds == {True, False}

    comps = load_sd_components(str(tiny_sdxl_single_file), "sdxl", tokenizers=False)
    network = oft.create_network(1.0, 4, 1e-3, None, comps.text_encoders, comps.unet)
    g = torch.Generator().manual_seed(7)
    sd = {}
    for module in network.unet_ofts:
        for k, v in module.state_dict().items():
            sd[f"{module.oft_name}.{k}"] = torch.randn(v.shape, generator=g) * 0.01 if k == "oft_blocks" else v
    oft_path = tmp_path / "oft.safetensors"
    lora_tools.save_lora(str(oft_path), sd, {"ss_network_module": "networks.oft"}, overwrite=False)
    oft_merged = tmp_path / "oft_merged.safetensors"
    assert sdxl_merge_lora.main(["--sd_model", str(tiny_sdxl_single_file), "--models", str(oft_path),
                                 "--ratios", "1", "--save_to", str(oft_merged)]) == 0
    ours = lora_tools.load_sd_model(str(oft_merged), "sdxl", torch.float32)
    merged_weights = dict(ours.unet.named_parameters())
    paths = {id(m): p for p, m in comps.unet.named_modules()}
    for module in network.unet_ofts[:5]:
        module.load_state_dict({k.split(".", 1)[1]: v for k, v in sd.items() if k.startswith(module.oft_name + ".")})
        expected = module.rotated_weight(module.org_module.weight.detach())
        got = merged_weights[paths[id(module.org_module)] + ".weight"]
        assert torch.allclose(got, expected, atol=1e-5) and not torch.allclose(got, module.org_module.weight)


def test_benchmark_upstream_launch_runs_a_script_as_python_would(tmp_path):
    """--upstream_launch: the script runs as `python script args` (its folder first on sys.path, its argv), and
    `from transformers import CLIPFeatureExtractor` (upstream's lpw pipeline import, gone in transformers 5) works."""
    (tmp_path / "beside.py").write_text("VALUE = 'beside'\n")
    (tmp_path / "tool.py").write_text(
        "import sys\nfrom transformers import CLIPFeatureExtractor\nimport beside\n"
        "if __name__ == '__main__':\n    print(beside.VALUE, sys.argv[1:], CLIPFeatureExtractor.__name__)\n")
    r = subprocess.run([sys.executable, str(REPO / "tools" / "bench_lora_tools.py"), "--upstream_launch",
                        str(tmp_path / "tool.py"), "--x", "1"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "beside ['--x', '1'] CLIPFeatureExtractor"


def test_benchmark_output_checks(tmp_path):
    """The agreement checks the benchmark prints: a LoRA against itself and against a rank-changed copy."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_lora_tools", REPO / "tools" / "bench_lora_tools.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    g = torch.Generator().manual_seed(0)
    sd = {"lora_unet_a.lora_down.weight": torch.randn(4, 8, generator=g),
          "lora_unet_a.lora_up.weight": torch.randn(6, 4, generator=g), "lora_unet_a.alpha": torch.tensor(2.0)}
    other = dict(sd, **{"lora_unet_a.lora_up.weight": sd["lora_unet_a.lora_up.weight"] * 1.01})
    paths = [str(tmp_path / f"{n}.safetensors") for n in ("a", "b")]
    lora_tools.save_lora(paths[0], sd, {}, overwrite=False)
    lora_tools.save_lora(paths[1], other, {}, overwrite=False)
    same = bench.compare_loras(paths[0], paths[0])
    assert same == {"modules": [1, 1], "common": 1, "ranks_equal": 1, "max_rel_diff": 0.0}
    assert bench.compare_loras(paths[0], paths[1])["max_rel_diff"] == pytest.approx(0.01 / 1.01, rel=1e-3)
    assert bench.compare_models(paths[0], paths[1])["worst_key"] == "lora_unet_a.lora_up.weight"
    # an extracted LoRA with one singular pair of the other sign, clamped at its own (lower) threshold: the raw
    # effective weights differ, the sign-aligned comparison sees the same decomposition
    flip = torch.tensor([1.0, -1.0, 1.0, 1.0])
    up, down = sd["lora_unet_a.lora_up.weight"], sd["lora_unet_a.lora_down.weight"]
    h = 0.9 * float(torch.cat([up.flatten(), down.flatten()]).abs().max())
    flipped = dict(sd, **{"lora_unet_a.lora_up.weight": (up * flip).clamp(-h, h),
                          "lora_unet_a.lora_down.weight": (down * flip[:, None]).clamp(-h, h)})
    lora_tools.save_lora(paths[1], flipped, {}, overwrite=True)
    check = bench.compare_loras(paths[1], paths[0], svd_signs=True)
    assert check["max_rel_diff"] > 0.01 and check["max_rel_diff_svd_signs_aligned"] < 1e-6
    assert bench.compare_loras(paths[0], paths[0], svd_signs=True)["max_rel_diff_svd_signs_aligned"] == 0.0
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    for d, text in (("x", "a, b"), ("y", "a, c")):
        (tmp_path / d / "1.txt").write_text(text)
        (tmp_path / d / "2.txt").write_text("same")
    assert bench.compare_captions(tmp_path / "x", tmp_path / "y") == {"captions": [2, 2], "identical": 1}


def test_benchmark_summary_rows():
    """The summary table the benchmark ends with: seconds per side, a stopped command's progress and estimate, the
    output check, and WD14 as images/s."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_lora_tools", REPO / "tools" / "bench_lora_tools.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = [{"who": "upstream", "bench": "flux_extract", "seconds": 75.1, "rc": "timeout", "progress": "30/304",
                "estimated_total_s": 761.0},
               {"who": "ours", "bench": "flux_extract", "seconds": 40.2, "rc": 0},
               {"who": "ours", "bench": "wd14_8", "seconds": 9.0, "rc": 0}]
    checks = {"flux_extract": {"modules": [304, 304], "common": 304, "ranks_equal": 304, "max_rel_diff": 2e-6},
              "wd14_images_per_s_ours": 12.5, "wd14_captions": {"captions": [88, 88], "identical": 88}}
    rows = bench.summary(results, checks)
    assert rows[2] == ("| flux_extract | 40.2 s | stopped at 75.1 s (30/304, est. 761.0 s) | ranks equal 304/304, "
                       "max rel. diff 2.0e-06 |")
    assert rows[3] == "| wd14 images/s | 12.5 | - | identical captions 88/88 |" and len(rows) == 4
