"""networks.lora_flux against sd-scripts' FLUX LoRA: the module set of the real FLUX.1-dev / schnell (built on the
meta device) with and without each --network_args selection, compared with sd-scripts' naming rules written
out here; an sd-scripts-made FLUX LoRA (modulation layers included) continuing with --network_weights on the
tiny FLUX, and a 2-step run with the extra network args (T5-XXL, split qkv, input layers, GGPO, LoRA+)."""
from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from networks import lora_flux

pytestmark = pytest.mark.usefixtures("one_thread")

# -- sd-scripts' rules for the FLUX LoRA module set, written against the BFL architecture -------------------

DOUBLE_LINEARS = ("img_mod.lin", "img_attn.qkv", "img_attn.proj", "img_mlp.0", "img_mlp.2",
                  "txt_mod.lin", "txt_attn.qkv", "txt_attn.proj", "txt_mlp.0", "txt_mlp.2")
SINGLE_LINEARS = ("linear1", "linear2", "modulation.lin")
CLIP_LINEARS = ("self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj", "self_attn.out_proj", "mlp.fc1",
                "mlp.fc2")
T5_LINEARS = ("layer.0.SelfAttention.q", "layer.0.SelfAttention.k", "layer.0.SelfAttention.v",
              "layer.0.SelfAttention.o", "layer.1.DenseReluDense.wi_0", "layer.1.DenseReluDense.wi_1",
              "layer.1.DenseReluDense.wo")


def bfl_shapes(h, mlp, n_double, n_single, guidance, t5_dim, clip_dim, in_ch=64):
    """BFL Linear -> (out, in) of FLUX.1 with hidden size h."""
    shapes = {"img_in": (h, in_ch), "txt_in": (h, t5_dim), "time_in.in_layer": (h, 256),
              "time_in.out_layer": (h, h), "vector_in.in_layer": (h, clip_dim), "vector_in.out_layer": (h, h)}
    if guidance:
        shapes.update({"guidance_in.in_layer": (h, 256), "guidance_in.out_layer": (h, h)})
    per_double = {"img_mod.lin": (6 * h, h), "img_attn.qkv": (3 * h, h), "img_attn.proj": (h, h),
                  "img_mlp.0": (mlp, h), "img_mlp.2": (h, mlp)}
    for i in range(n_double):
        for side in ("img", "txt"):
            for k, v in per_double.items():
                shapes[f"double_blocks.{i}.{k.replace('img', side)}"] = v
    for i in range(n_single):
        shapes.update({f"single_blocks.{i}.linear1": (3 * h + mlp, h), f"single_blocks.{i}.linear2": (h, h + mlp),
                       f"single_blocks.{i}.modulation.lin": (3 * h, h)})
    return shapes


def selection(text, total):
    if text == "all":
        return set(range(total))
    if text in ("none", ""):
        return set()
    out = set()
    for part in text.split(","):
        a, _, b = part.partition("-")
        out |= set(range(int(a), int(b or a) + 1))
    return out


def upstream_modules(args, dim, n_double, n_single, guidance, shapes, clip_layers, clip_shapes, t5_layers,
                     t5_shapes):
    """{lora name: (dim, out, in)} as sd-scripts' networks.lora_flux creates them."""
    reg_dims = {}
    for pair in args.get("network_reg_dims", "").split(","):
        if pair:
            k, v = pair.split("=")
            reg_dims[k] = int(v)
    types = [("img_attn_dim", ("img_attn",)), ("txt_attn_dim", ("txt_attn",)), ("img_mlp_dim", ("img_mlp",)),
             ("txt_mlp_dim", ("txt_mlp",)), ("img_mod_dim", ("img_mod",)), ("txt_mod_dim", ("txt_mod",)),
             ("single_dim", ("single_blocks", "linear")), ("single_mod_dim", ("modulation",))]
    dbl = selection(args.get("train_double_block_indices", "all"), n_double)
    sgl = selection(args.get("train_single_block_indices", "all"), n_single)

    def rank(name, is_flux, default=dim):
        for rx, d in reg_dims.items():
            if re.search(rx, name):
                return d
        d = default
        if is_flux:
            for key, ids in types:
                if key in args and all(i in name for i in ids):
                    d = int(args[key])
                    break
            if d and ("double" in name or "single" in name):
                idx = int(name.split("_")[4])
                if ("double" in name and idx not in dbl) or ("single" in name and idx not in sgl):
                    d = 0
        return d

    out = {}

    def add(name, is_flux, shape, default=dim):
        d = rank(name, is_flux, default)
        if d:
            out[name] = (d, *shape)

    for i in range(clip_layers):
        for k in CLIP_LINEARS:
            add(f"lora_te1_text_model_encoder_layers_{i}_{k}".replace(".", "_"), False, clip_shapes[k])
    if args.get("train_t5xxl") == "True":
        for i in range(t5_layers):
            for k in T5_LINEARS:
                add(f"lora_te3_encoder_block_{i}_{k}".replace(".", "_"), False, t5_shapes[k])
    blocks = args.get("train_blocks", "all")
    for bfl, shape in shapes.items():
        name = "lora_unet_" + bfl.replace(".", "_")
        if (bfl.startswith("double_blocks") and blocks != "single") or \
                (bfl.startswith("single_blocks") and blocks != "double"):
            add(name, True, shape)
    if "in_dims" in args:
        in_dims = [int(x) for x in args["in_dims"].strip("[]").split(",")]
        for flt, d in zip(["_img_in", "_time_in", "_vector_in", "_guidance_in", "_txt_in"], in_dims):
            for bfl, shape in shapes.items():
                name = "lora_unet_" + bfl.replace(".", "_")
                if flt in name:
                    add(name, True, shape, default=d)
    return out


def ours(network):
    return {m.lora_name: (m.lora_dim, sum(m.split_dims), m._orgs[0].in_features)
            for m in network.text_encoder_loras + network.unet_loras}


@pytest.fixture(scope="module")
def real_flux_meta():
    """FLUX.1-dev and -schnell transformers, CLIP-L and T5-XXL with the real configs, on the meta device."""
    from diffusers import FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    with torch.device("meta"):
        models = {g: FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                                            attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                                            pooled_projection_dim=768, guidance_embeds=g, axes_dims_rope=[16, 56, 56])
                  for g in (True, False)}
        clip = CLIPTextModel(CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                            num_attention_heads=12, projection_dim=768))
        t5 = T5EncoderModel(T5Config(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24,
                                     num_heads=64, feed_forward_proj="gated-gelu", is_encoder_decoder=False))
    return models, clip, t5


REAL_CASES = [
    {},
    {"train_blocks": "single"},
    {"train_blocks": "double"},
    {"train_double_block_indices": "0-3,10", "train_single_block_indices": "none"},
    {"train_single_block_indices": "5,30-37"},
    {"img_attn_dim": "8", "txt_mod_dim": "0", "single_mod_dim": "2", "single_dim": "6", "img_mlp_dim": "0"},
    {"in_dims": "[4,0,4,2,4]"},
    {"network_reg_dims": "double_blocks_1_.*=16,single_blocks_3[0-9]_linear=0", "img_attn_dim": "2"},
    {"train_t5xxl": "True"},
    {"split_qkv": "True", "train_blocks": "double"},
]


# schnell differs from dev only in the guidance embedder (an input layer): its default set and in_dims
CASES = [(True, a) for a in REAL_CASES] + [(False, {}), (False, {"in_dims": "[4,0,4,2,4]"})]


@pytest.mark.parametrize("guidance, args", CASES,
                         ids=[("dev-" if g else "schnell-") + (",".join(a) or "default") for g, a in CASES])
def test_real_flux_module_set_matches_upstream(real_flux_meta, guidance, args):
    models, clip, t5 = real_flux_meta
    shapes = bfl_shapes(3072, 12288, 19, 38, guidance, 4096, 768)
    clip_shapes = {"self_attn.k_proj": (768, 768), "self_attn.v_proj": (768, 768), "self_attn.q_proj": (768, 768),
                   "self_attn.out_proj": (768, 768), "mlp.fc1": (3072, 768), "mlp.fc2": (768, 3072)}
    t5_shapes = {k: (4096, 4096) for k in T5_LINEARS[:4]}
    t5_shapes.update({T5_LINEARS[4]: (10240, 4096), T5_LINEARS[5]: (10240, 4096), T5_LINEARS[6]: (4096, 10240)})
    want = upstream_modules(args, 4, 19, 38, guidance, shapes, 12, clip_shapes, 24, t5_shapes)
    with torch.device("meta"):
        net = lora_flux.create_network(1.0, 4, 1.0, None, [clip, t5], models[guidance], **args)
    got = ours(net)
    assert got == want
    if not args:
        assert len(got) == 376
        assert sum(1 for n in got if n.endswith(("_mod_lin", "_modulation_lin"))) == 76


@pytest.mark.parametrize("args, match", [
    ({"train_blocks": "some"}, "train_blocks=some: allowed: all, single, double"),
    ({"split_qkv": "maybe"}, "split_qkv=maybe: not a bool"),
    ({"in_dims": "[1,2,3]"}, "five integers"),
    ({"network_reg_lrs": "double(=1e-4"}, "network_reg_lrs"),
    ({"train_double_block_indices": "3-1"}, "train_double_block_indices=3-1"),
    ({"img_attn_dimm": "4"}, "unknown for networks.lora_flux"),
])
def test_bad_flux_network_args(args, match):
    with pytest.raises(lora_flux.NetworkArgsError, match=re.escape(match) if "(" in match else match):
        lora_flux.parse_network_kwargs(args)


# -- tiny FLUX end to end ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def flux_set(tmp_path_factory):
    from library import flux_tiny

    return flux_tiny.make_tiny_flux(tmp_path_factory.mktemp("flux_lora_models"))


@pytest.fixture(scope="module")
def flux_data(tmp_path_factory):
    from library.tiny_models import make_captioned_images

    return make_captioned_images(tmp_path_factory.mktemp("flux_lora_data"), n=1, size=(32, 32), repeats=1,
                                 name="demo")


def _argv(paths, data, out, name, extra=()):
    return ["--pretrained_model_name_or_path", paths["transformer"], "--clip_l", paths["clip_l"],
            "--t5xxl", paths["t5xxl"], "--ae", paths["ae"], "--tokenizer_cache_dir", paths["tokenizer_cache_dir"],
            "--train_data_dir", str(data), "--output_dir", str(out), "--output_name", name,
            "--network_module", "networks.lora_flux", "--network_dim", "4", "--network_alpha", "2",
            "--resolution", "32", "--max_train_steps", "2", "--learning_rate", "1e-3",
            "--t5xxl_max_token_length", "16", "--max_data_loader_n_workers", "0", "--seed", "1", *extra]


def _components(paths):
    from library import flux_models

    return flux_models.load_flux_components(paths["transformer"], paths["clip_l"], paths["t5xxl"], paths["ae"],
                                            dtype=torch.float32, tokenizer_cache_dir=paths["tokenizer_cache_dir"])


def _transformer_out(flux):
    g = torch.Generator().manual_seed(0)
    cfg = flux.config
    x = torch.randn(1, 4, cfg.in_channels, generator=g)
    kw = dict(hidden_states=x, encoder_hidden_states=torch.randn(1, 3, cfg.joint_attention_dim, generator=g),
              pooled_projections=torch.randn(1, cfg.pooled_projection_dim, generator=g),
              timestep=torch.tensor([0.5]), img_ids=torch.zeros(4, 3), txt_ids=torch.zeros(3, 3))
    if cfg.guidance_embeds:
        kw["guidance"] = torch.tensor([3.5])
    with torch.no_grad():
        return flux(**kw).sample


def _upstream_file(path, comps, dim=4, alpha=2.0):
    """A FLUX LoRA file laid out as sd-scripts writes it for this model (modulation layers and CLIP-L
    included), with random weights."""
    cfg = comps.transformer.config
    h = comps.transformer.inner_dim
    mlp = comps.transformer.single_transformer_blocks[0].proj_mlp.out_features
    shapes = bfl_shapes(h, mlp, cfg.num_layers, cfg.num_single_layers, cfg.guidance_embeds,
                        cfg.joint_attention_dim, cfg.pooled_projection_dim)
    te = comps.clip_l.config
    clip_shapes = {k: (te.hidden_size, te.hidden_size) for k in CLIP_LINEARS[:4]}
    clip_shapes.update({"mlp.fc1": (te.intermediate_size, te.hidden_size),
                        "mlp.fc2": (te.hidden_size, te.intermediate_size)})
    mods = upstream_modules({}, dim, cfg.num_layers, cfg.num_single_layers, cfg.guidance_embeds, shapes,
                            te.num_hidden_layers, clip_shapes, 0, {})
    g = torch.Generator().manual_seed(3)
    sd = {}
    for name, (d, o, i) in mods.items():
        sd[f"{name}.lora_down.weight"] = torch.randn(d, i, generator=g) * 0.1
        sd[f"{name}.lora_up.weight"] = torch.randn(o, d, generator=g) * 0.1
        sd[f"{name}.alpha"] = torch.tensor(alpha)
    save_file(sd, str(path), {"ss_network_module": "networks.lora_flux"})
    return sd


def test_upstream_flux_lora_continues(flux_set, flux_data, tmp_path):
    import flux_train_network

    comps = _components(flux_set)
    start = tmp_path / "upstream.safetensors"
    want = _upstream_file(start, comps)
    assert any(k.startswith("lora_unet_double_blocks_0_img_mod_lin.") for k in want)
    out = flux_train_network.main(_argv(flux_set, flux_data, tmp_path / "out", "cont",
                                        ["--network_weights", str(start), "--learning_rate", "1e-12",
                                         "--optimizer_type", "SGDNesterov"]))
    got = load_file(out)
    assert set(got) == set(want)
    for k in want:
        assert torch.allclose(got[k].float(), want[k], atol=1e-6), k
    # the file changes the model's output
    plain = _transformer_out(comps.transformer)
    net, sd = lora_flux.create_network_from_weights(1.0, out, comps.ae, comps.text_encoders, comps.transformer)
    net.apply_to(comps.text_encoders, comps.transformer, True, True)
    net.load_weights(out)
    try:
        assert not torch.allclose(_transformer_out(comps.transformer), plain, atol=1e-5)
    finally:
        net.remove_from()


def test_flux_network_args_train(flux_set, flux_data, tmp_path, caplog):
    """2 steps with T5-XXL LoRA, split qkv, LoRA on the input layers, a smaller rank for the modulation layers,
    GGPO, LoRA+ and --scale_weight_norms; the file is in sd-scripts' layout and continues."""
    import logging

    import flux_train_network

    args = ["train_t5xxl=True", "split_qkv=True", "in_dims=[2,2,2,2,2]", "img_mod_dim=2",
            "ggpo_sigma=0.03", "ggpo_beta=0.01", "loraplus_lr_ratio=4", "verbose=True"]
    with caplog.at_level(logging.INFO):
        out = flux_train_network.main(_argv(flux_set, flux_data, tmp_path / "out", "args",
                                            ["--network_args", *args, "--scale_weight_norms", "10"]))
    assert "LoRA-GGPO: sigma 0.03, beta 0.01" in caplog.text
    sd = load_file(out)
    names = {k.split(".")[0] for k in sd}
    assert any(n.startswith("lora_te3_encoder_block_0_layer_0_SelfAttention_") for n in names)
    assert {"lora_unet_img_in", "lora_unet_txt_in", "lora_unet_time_in_in_layer",
            "lora_unet_guidance_in_out_layer"} <= names
    assert sd["lora_unet_double_blocks_0_img_mod_lin.lora_down.weight"].shape[0] == 2
    # split qkv: fused layout, 3 (4 for linear1) parts of rank 4, block-diagonal up, alpha * parts
    qkv_down, qkv_up = sd["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"], \
        sd["lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight"]
    assert qkv_down.shape[0] == 12 and float(sd["lora_unet_double_blocks_0_img_attn_qkv.alpha"]) == 6.0
    h = qkv_up.shape[0] // 3
    assert torch.count_nonzero(qkv_up[:h, 4:]) == 0 and torch.count_nonzero(qkv_up[h:2 * h, :4]) == 0
    assert sd["lora_unet_single_blocks_0_linear1.lora_down.weight"].shape[0] == 16
    # continues into the same settings
    out2 = flux_train_network.main(_argv(flux_set, flux_data, tmp_path / "out2", "args2",
                                         ["--network_args", *args, "--network_weights", out,
                                          "--learning_rate", "1e-12", "--optimizer_type", "SGDNesterov",
                                          "--seed", "2"]))
    sd2 = load_file(out2)
    assert set(sd2) == set(sd)
    for k in sd:
        assert torch.allclose(sd2[k].float(), sd[k].float(), atol=1e-5), k


# -- one fused BFL layer = one LoRA: dropout drawn once, down computed once (issue 24 bug 4) -------------------

def _fused_qkv(dim=4, **dropouts):
    """A LoRA over three diffusers parts (to_q/to_k/to_v) of one BFL qkv, each part's up rows = the identity,
    so each part's LoRA output is exactly the (dropped-out) down output: equal parts = shared draws."""
    torch.manual_seed(0)
    parts = [torch.nn.Linear(8, dim) for _ in range(3)]
    m = lora_flux.FluxLoRAModule("lora_unet_double_blocks_0_img_attn_qkv", parts, lora_dim=dim, alpha=dim,
                                 **dropouts)
    with torch.no_grad():
        m.lora_up.weight.copy_(torch.eye(dim).repeat(3, 1))
    m.apply_to()
    m.train()
    return m, parts


def test_fused_layer_draws_module_dropout_once_for_all_its_parts():
    m, parts = _fused_qkv(module_dropout=0.5)
    dropped = []
    for _ in range(60):
        x = torch.randn(2, 8)
        dropped.append(tuple(torch.equal(p(x), torch.nn.Linear.forward(p, x)) for p in parts))
    assert set(dropped) == {(True, True, True), (False, False, False)}  # the whole qkv LoRA, or none of it


def test_fused_layer_shares_down_dropout_and_rank_dropout_and_computes_down_once():
    m, parts = _fused_qkv(dropout=0.5, rank_dropout=0.5)
    calls = []
    m.lora_down.register_forward_hook(lambda *a: calls.append(1))
    x = torch.randn(2, 5, 8)
    deltas = [p(x) - torch.nn.Linear.forward(p, x) for p in parts]
    assert len(calls) == 1
    kept = [d != 0 for d in deltas]
    assert torch.equal(kept[0], kept[1]) and torch.equal(kept[1], kept[2])  # one dropout mask, one rank mask
    assert torch.allclose(deltas[0], deltas[1], atol=1e-6) and torch.allclose(deltas[1], deltas[2], atol=1e-6)
    assert kept[0].any() and not kept[0].all()  # something was dropped, something kept
    # a new input is a new draw; the parts of the earlier one are not reused for it
    y = torch.randn(2, 5, 8)
    first = parts[0](y) - torch.nn.Linear.forward(parts[0], y)
    z = torch.randn(2, 5, 8)
    assert not any(torch.allclose(p(z) - torch.nn.Linear.forward(p, z), first) for p in parts)
    assert len(calls) == 3


def test_fused_layer_output_is_the_fused_lora_split_over_the_parts():
    m, parts = _fused_qkv()
    with torch.no_grad():
        m.lora_up.weight.normal_()
    x = torch.randn(3, 8)
    fused = m.lora_up(m.lora_down(x)) * m.multiplier * m.scale
    got = torch.cat([p(x) - torch.nn.Linear.forward(p, x) for p in parts], dim=-1)
    assert torch.allclose(got, fused, atol=1e-6)


def test_fused_layer_without_dropout_compiles_inside_a_checkpoint_with_the_same_output():
    """With no dropout the parts keep no state between their calls, so a checkpointed block compiles whole
    (fullgraph): a side effect in forward made torch.compile run every checkpointed FLUX.1 block eagerly."""
    from torch.utils.checkpoint import checkpoint

    m, parts = _fused_qkv()
    with torch.no_grad():
        m.lora_up.weight.normal_()
    x = torch.randn(2, 5, 8, requires_grad=True)

    def block(x):
        return checkpoint(lambda t: torch.cat([p(t) for p in parts], dim=-1), x, use_reentrant=False)

    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    got = compiled(x)
    got.sum().backward()
    grad = m.lora_up.weight.grad.clone()
    m.lora_up.weight.grad = None
    want = block(x)
    want.sum().backward()
    torch._dynamo.reset()
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.allclose(grad, m.lora_up.weight.grad, atol=1e-6)
    fused = m.lora_up(m.lora_down(x)) * m.multiplier * m.scale
    assert torch.allclose(want - torch.cat([torch.nn.Linear.forward(p, x) for p in parts], dim=-1), fused, atol=1e-6)
