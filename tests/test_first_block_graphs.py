"""Issue 25 (first step): every compiled family runs one dynamo graph per block kind. The first block of a kind got
its inputs in another form than the later blocks (no requires_grad: they come from frozen embedders; a sliced text
tensor), one more graph to trace, compile, load and guard; regional.LIKE_LATER_BLOCKS hands it inputs like the
later ones'. Each case trains a tiny model of the family with the shipped LoRA module through its trainer, compiled
(eager backend: dynamo's graphs without inductor) and not, and checks the graph count and that both save the same
LoRA. FLUX.1: tests/test_compile_utils.py::test_flux_blocks_of_a_kind_share_one_graph.
Also: where the blocks' token count follows each batch's longest caption (Chroma, Lumina 2, HunyuanImage), one
bucket shape compiles with torch's automatic dynamic, not a static graph per caption length."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch._dynamo.utils import counters

from test_anima import LORA as ANIMA_LORA, model_argv as anima_model, train_argv as anima_train
from test_chroma import LORA as CHROMA_LORA, chroma_data, single_file_argv as chroma_model, train_argv as chroma_train
from test_hunyuan_image import LORA as HY_LORA, hy_data, model_argv as hy_model, train_argv as hy_train
from test_lumina import (LORA as LUMINA_LORA, lumina_data, single_file_argv as lumina_model,
                         train_argv as lumina_train)
from test_sd3 import LORA as SD3_LORA, sd3_data, train_argv as sd3_train

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
CACHED = ["--cache_text_encoder_outputs", "--cache_latents"]


def _with_layers(module, maker, **layers):
    """Call module.maker with its tiny_transformer building more blocks than the family's tests use (the first
    block of a kind needs a later one to share its graph with)."""
    orig = module.tiny_transformer
    module.tiny_transformer = lambda *a, **kw: orig(*a, **{**kw, **layers})
    try:
        return maker()
    finally:
        module.tiny_transformer = orig


@pytest.fixture(scope="module")
def chroma_set(tmp_path_factory):
    from library import chroma_models

    return chroma_models.make_tiny_chroma(tmp_path_factory.mktemp("chroma"), prefix=True, num_double=2, num_single=3)


@pytest.fixture(scope="module")
def sd3_large_set(tmp_path_factory):
    """SD3.5-large-like (no attn2): 3 joint blocks alike and the last one, whose context block is "pre only"."""
    from library import sd3_models

    return _with_layers(sd3_models, lambda: sd3_models.make_tiny_sd3(tmp_path_factory.mktemp("sd3"), large=True),
                        num_layers=4)


@pytest.fixture(scope="module")
def lumina_set(tmp_path_factory):
    """2 noise-refiner, 2 context-refiner blocks (as Lumina-Image 2.0) and 3 layers."""
    from library import lumina_models

    return _with_layers(lumina_models, lambda: lumina_models.make_tiny_lumina(tmp_path_factory.mktemp("lumina"),
                                                                            num_layers=3), num_refiner_layers=2)


@pytest.fixture(scope="module")
def hy_set(tmp_path_factory):
    from library import hunyuan_image_models

    return hunyuan_image_models.make_tiny_hunyuan_image(tmp_path_factory.mktemp("hy"))  # 2 double, 2 single


@pytest.fixture(scope="module")
def anima_set3(tmp_path_factory):
    from library import anima_models

    return anima_models.make_tiny_anima(tmp_path_factory.mktemp("anima"), blocks=3)


def _graphs_and_lora(main, argv, tmp_path):
    """(dynamo graphs of the compiled run, its LoRA, the uncompiled run's LoRA)."""
    torch._dynamo.reset()
    counters.clear()
    try:
        compiled = main([*argv(tmp_path / "compiled"), "--compile", "--compile_backend", "eager"])
        graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    eager = main(argv(tmp_path / "eager"))
    return graphs, load_file(compiled), load_file(eager)


def _case(family, sets, data, tmp_path):
    import anima_train_network
    import flux_train_network
    import hunyuan_image_train_network
    import lumina_train_network
    import sd3_train_network

    if family == "chroma":
        return flux_train_network.main, lambda out: [*chroma_model(sets), *CHROMA_LORA, *chroma_train(
            data, out, "c", ["--network_train_unet_only", "--gradient_checkpointing", *CACHED])]
    if family == "sd3-large":
        return sd3_train_network.main, lambda out: [
            "--pretrained_model_name_or_path", sets["transformer"], "--tokenizer_cache_dir", sets["tokenizer_cache_dir"],
            *SD3_LORA, *sd3_train(data, out, "s", ["--network_train_unet_only", *CACHED])]
    if family == "lumina":
        return lumina_train_network.main, lambda out: [*lumina_model(sets), *LUMINA_LORA, *lumina_train(
            data, out, "l", ["--network_train_unet_only", "--gradient_checkpointing", *CACHED])]
    if family == "hunyuan":
        return hunyuan_image_train_network.main, lambda out: [*hy_model(sets), *HY_LORA, *hy_train(
            data, out, "h", ["--max_train_steps", "1", *CACHED])]
    return anima_train_network.main, lambda out: [*anima_model(sets), *ANIMA_LORA, *anima_train(
        data, out, "a", ["--network_train_unet_only", "--gradient_checkpointing", *CACHED])]


# (family, the model's fixture, the data's fixture, graphs: one a block kind; before the change in brackets)
CASES = [
    ("chroma", "chroma_set", "chroma_data", 2),  # double, single [3]
    ("sd3-large", "sd3_large_set", "sd3_data", 2),  # the joint blocks, the last ("pre only") one [3]
    # the context refiner (padded captions, no modulation): static; the noise refiner's image tokens, then the
    # layers' image + caption tokens: torch's automatic dynamic makes the token count symbolic [5: each refiner's first
    # block a graph of its own, the layers a static one]
    ("lumina", "lumina_set", "lumina_data", 2),
    ("hunyuan", "hy_set", "hy_data", 2),  # double, single [3]
    ("anima", "anima_set3", "anima_data", 1),  # [2]
]


@pytest.mark.parametrize("family, model_fixture, data_fixture, expected", CASES, ids=[c[0] for c in CASES])
def test_blocks_of_a_kind_share_one_graph(family, model_fixture, data_fixture, expected, request, tmp_path):
    main, argv = _case(family, request.getfixturevalue(model_fixture), request.getfixturevalue(data_fixture),
                       tmp_path)
    graphs, compiled, eager = _graphs_and_lora(main, argv, tmp_path)
    assert graphs == expected
    assert compiled.keys() == eager.keys() and any(k.endswith("lora_up.weight") for k in eager)
    assert any(v.abs().sum() > 0 for k, v in compiled.items() if k.endswith("lora_up.weight"))  # it trained
    for k in eager:
        torch.testing.assert_close(compiled[k], eager[k], atol=1e-5, rtol=1e-4, msg=k)


CAPTIONS = ["a cat", "a red circle on a blue field", "a small green square with a sign saying hello there friend",
            "dog", "a long caption about a large orange triangle drawn on old paper under soft light on a cold day"]


@pytest.fixture()
def varied_captions(tmp_path):
    """Five images whose captions differ in length (as .caption and .txt: each trainer's default extension)."""
    from library.tiny_models import make_captioned_images

    def make(size):
        folder = make_captioned_images(tmp_path / f"varied{size}", n=5, size=(size, size), repeats=1, name="demo")
        for path, caption in zip(sorted(folder.rglob("*.png")), CAPTIONS):
            for ext in (".caption", ".txt"):
                path.with_suffix(ext).write_text(caption)
        return folder
    return make


# (family, graphs over 5 steps of 5 caption lengths, one bucket shape, the GUI's compile default) [before: a static
# graph per kind and caption length]
LENGTH_CASES = [
    ("hunyuan", 4),  # each kind static, then once with the length symbolic [8: one a kind for each of 4 lengths]
    ("lumina", 2),  # context refiner (static: padded captions); noise refiner and layers, one graph [5]
]


@pytest.mark.parametrize("family, expected", LENGTH_CASES, ids=[c[0] for c in LENGTH_CASES])
def test_new_caption_lengths_with_one_bucket_shape_compile_once_more(family, expected, request, tmp_path,
                                                                     varied_captions, caplog):
    import logging

    sets = request.getfixturevalue({"hunyuan": "hy_set", "lumina": "lumina_set"}[family])
    main, argv = _case(family, sets, varied_captions(64 if family == "hunyuan" else 32), tmp_path)
    torch._dynamo.reset()
    counters.clear()
    try:
        with caplog.at_level(logging.INFO, logger="library.compile"):
            main([*argv(tmp_path / "o"), "--max_train_steps", "5", "--compile", "--compile_backend", "eager"])
        assert counters["stats"]["unique_graphs"] == expected
    finally:
        torch._dynamo.reset()
    assert "torch's automatic dynamic shapes (--compile_dynamic auto: one bucket shape, the text length follows " \
           "each batch's captions)" in caplog.text
