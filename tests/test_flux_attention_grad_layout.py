"""library.families.flux.one_attention_grad_layout: every attention backward of a FLUX.1 transformer gets its
output's gradient in one layout. torch 2.11's cuDNN attention caches its backward plan by the q/k/v layout alone
while the plan holds the gradient's layout too, so the single blocks' sliced gradient (attention output
concatenated with the MLP branch) made the double blocks' backward read out of bounds (tools/probe_cudnn_sdpa.py
--grad_layouts shows it on a GPU). Here, on the CPU: the layouts before and after, the same numbers, and a compiled
checkpointed block with the hook in it."""
import pytest
import torch

from library import flux_tiny, flux_train_utils
from library.families import flux

WIDTH = 256  # two 128-wide heads


def _model():
    model = flux_tiny.tiny_transformer(width=WIDTH, num_double=2, num_single=2)
    return model.requires_grad_(False)


def _inputs(res=64):
    g = torch.Generator().manual_seed(0)
    h = res // 8
    noisy = torch.randn(1, 16, h, h, generator=g)
    te = {"t5_out": torch.randn(1, 8, 32, generator=g), "pooled": torch.randn(1, 64, generator=g)}
    return noisy, te, torch.randn(1, 16, h, h, generator=g)


def _step(model, noisy, te, grad_out):
    x = noisy.clone().requires_grad_()
    out = flux_train_utils.flux_forward(model, x, torch.tensor([0.5]), te, 3.5, torch.float32)
    out.backward(grad_out)
    return out.detach(), x.grad


def _attention_grad_strides(monkeypatch) -> list:
    """The strides of the gradient each scaled_dot_product_attention output receives, in backward order."""
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        out.register_hook(lambda g: seen.append(tuple(g.stride())))
        return out

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return seen


def test_single_and_double_blocks_hand_attention_one_gradient_layout_with_the_same_numbers(monkeypatch):
    model = _model()
    noisy, te, grad_out = _inputs()
    seen = _attention_grad_strides(monkeypatch)
    before = _step(model, noisy, te, grad_out)
    # the cause: two single blocks then two double blocks, the single blocks' gradient rows 5 widths apart
    assert len(seen) == 4 and len(set(seen)) == 2
    assert seen[0][2] == 5 * WIDTH and seen[3][2] == WIDTH  # (B, H, L, D) strides: L is dim 2

    assert flux.one_attention_grad_layout(model) == 2  # the single blocks
    assert flux.one_attention_grad_layout(model) == 0  # once only
    seen.clear()
    after = _step(model, noisy, te, grad_out)
    assert len(seen) == 4 and len(set(seen)) == 1 and seen[0][2] == WIDTH
    assert torch.equal(after[0], before[0])
    assert torch.allclose(after[1], before[1], rtol=1e-5, atol=1e-7)


def test_chromas_single_blocks_get_the_same_layout(monkeypatch, tmp_path):
    """Chroma (--model_type chroma) shares FLUX.1's attention backend setup, and its single blocks concatenate the
    attention output with the MLP branch the same way."""
    from safetensors.torch import save_file

    from library import chroma_models
    from library.families import chroma

    built = chroma_models.tiny_chroma_transformer(width=WIDTH, num_double=1, num_single=2)
    save_file(chroma_models.diffusers_to_single_file(built.state_dict()), tmp_path / "chroma.safetensors")
    model = chroma_models.load_chroma_transformer(str(tmp_path / "chroma.safetensors"), torch.float32)
    model.requires_grad_(False)
    noisy, _, grad_out = _inputs()
    te = {"t5_out": torch.randn(1, 8, 32), "t5_attn_mask": torch.ones(1, 8, dtype=torch.long)}
    seen = _attention_grad_strides(monkeypatch)

    def step():
        x = noisy.clone().requires_grad_()
        chroma.chroma_forward(model, x, torch.tensor([0.5]), te, 0.0, torch.float32).backward(grad_out)
        return x.grad

    before = step()
    assert len(set(seen)) == 2
    assert flux.one_attention_grad_layout(model) == 2
    seen.clear()
    assert torch.allclose(step(), before, rtol=1e-5, atol=1e-7)
    assert len(seen) == 3 and len(set(seen)) == 1


@pytest.mark.slow
def test_the_hook_compiles_inside_the_checkpointed_blocks_without_a_graph_break():
    """The trainers' regional compile with gradient checkpointing inside the blocks (aot_eager on the CPU): the
    hooked single blocks compile whole and give eager's gradient."""
    from types import SimpleNamespace

    from torch._dynamo.utils import counters

    from library.compile import regional

    model = _model()
    noisy, te, grad_out = _inputs()
    want = _step(model, noisy, te, grad_out)
    flux.one_attention_grad_layout(model)
    torch._dynamo.reset()
    counters.clear()
    cargs = SimpleNamespace(compile=True, compile_backend="aot_eager", compile_mode="default", compile_dynamic="false",
                            compile_fullgraph=False, compile_checkpoint_keep="projections", cuda_graph_step="off")
    try:
        assert regional.compile_model_blocks(model, cargs, model_name="FLUX test", gradient_checkpointing=True) == 4
        got = _step(model, noisy, te, grad_out)
        assert not counters["graph_break"], dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()
    assert torch.allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert torch.allclose(got[1], want[1], rtol=1e-4, atol=1e-6)


def test_a_compiled_run_caches_the_hooked_blocks_autograd_graphs(monkeypatch, tmp_path):
    """The hook's autograd.Function makes torch bypass its AOTAutograd cache (a FLUX.1 warm restart traced the
    single blocks again); setup_compile_environment lets the cache take such graphs. Checked on dynamo's graph of
    a hooked single block with torch's own cacheability check (no inductor compile here)."""
    import torch._functorch.config as functorch_config
    from torch._functorch._aot_autograd import autograd_cache

    from library.compile import environment, options

    model = _model()
    flux.one_attention_grad_layout(model)
    graphs = []

    def keep_graph(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    block = model.single_transformer_blocks[0]
    x, enc, temb = torch.randn(1, 16, WIDTH, requires_grad=True), torch.randn(1, 8, WIDTH), torch.randn(1, WIDTH)
    torch._dynamo.reset()
    try:
        torch.compile(block, backend=keep_graph, fullgraph=True)(x, enc, temb,
                                                                 image_rotary_emb=model.pos_embed(torch.zeros(24, 3)))
    finally:
        torch._dynamo.reset()

    def cacheable() -> bool:
        try:
            for node in graphs[0].graph.nodes:
                autograd_cache.check_node_safe(node)
        except autograd_cache.BypassAOTAutogradCache:
            return False
        return True

    monkeypatch.setattr(functorch_config, "autograd_cache_allow_custom_autograd_functions", False)
    assert not cacheable()  # torch's default: the hooked graph would be traced again at every start
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "before"))  # setup sets it; monkeypatch restores
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", torch._inductor.config.fx_graph_cache)
    monkeypatch.setattr(functorch_config, "enable_autograd_cache", functorch_config.enable_autograd_cache)
    monkeypatch.setattr(torch._inductor.config, "unsafe_marked_cacheable_functions",
                        torch._inductor.config.unsafe_marked_cacheable_functions)
    parser = options.add_compile_arguments(__import__("argparse").ArgumentParser())
    environment.setup_compile_environment(parser.parse_args(["--compile", "--compile_cache_dir", str(tmp_path)]))
    assert cacheable()
