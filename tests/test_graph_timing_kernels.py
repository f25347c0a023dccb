"""tools/graph_timing.py GRAPH_TIMING_KERNELS: the kind each GPU kernel's time is counted under (names as torch's
profiler reports them on an H100: cuDNN's and flash attention's, cuBLAS's, inductor's triton kernels, fused AdamW)."""
import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "graph_timing.py"


@pytest.mark.parametrize("name, kind", [
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1", "attention"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128>>", "attention"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1", "matmul"),
    ("nvjet_hsh_256x128_64x4_2x1_v_bz_coopB_TNT", "matmul"),
    ("triton_per_fused__to_copy_add_mul_native_layer_norm_0", "triton"),
    ("triton_red_fused__fused_rms_norm__scaled_dot_product_cudnn_attention_backward__to_copy__un", "triton"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "other"),
])
def test_kernel_kinds(name, kind):
    spec = importlib.util.spec_from_file_location("graph_timing", TOOL)
    graph_timing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(graph_timing)
    assert graph_timing.kernel_kind(name) == kind
