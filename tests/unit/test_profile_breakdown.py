"""The profile breakdown: kernel names as H100/H200 profiles print them, and the attribution of
kernels to the ranges their ops (or, in backward, their forward ops) ran in."""

from __future__ import annotations

import pytest
from torch.autograd import DeviceType

from dtrain.trainer import CLIP_RANGE
from parallel.modules import LOSS_RANGE
from dtrain.diagnose.breakdown import breakdown, classify, profile_activities, trace_activities


# As torch.profiler (CUPTI) names them on Hopper, from cuBLAS(Lt), CUTLASS, cuDNN, torch's flash and
# memory-efficient kernels, inductor, NCCL and ATen.
KERNELS = {
    "gemm": [
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off"
        "_kernel__5x_cublas",
        "nvjet_tst_192x128_64x4_1x2_h_bz_coopA_NTT",
        "nvjet_tst_64x24_64x16_4x1_v_bz_splitK_TNT",
        # torch._scaled_mm, tensorwise FP8
        "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_cgasize1x2x1_stage4_gmmastage2"
        "_warpgroupsize1x1x1_tensor64x128x32",
        "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8>"
        "(cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8::Params)",
        "ampere_bf16_s16816gemm_bf16_256x128_ldg8_f2f_stages_32x3_nn",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, "
        "false>(cublasLt::cublasSplitKParams<float>, float const*, __nv_bfloat16 const*, __nv_bfloat16*, float "
        "const*, float const*, __nv_bfloat16 const*, float const*, __nv_bfloat16*, void*, long, float*, int*)",
        # torch._grouped_mm (the routed experts) on sm90
        "void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::"
        "GemmUniversal<cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >, cutlass::gemm::collective::"
        "CollectiveMma<...> > > >(...)",
        "triton_tem_fused_mm_4",
    ],
    "attention": [
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_1x1x1_kernel0_0",
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
        "cutlass::bfloat16_t, Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, true, false, "
        "false, true, true, false, false>(pytorch_flash::Flash_fwd_params)",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128, 8, "
        "2, 4, 2, false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 8, cutlass::bfloat16_t> >, "
        "true, false, false, false, false, false, false>(pytorch_flash::Flash_bwd_params)",
        "fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, "
        "cutlass::arch::Sm80, true, 64, 128, 128, true, true>::Params)",
        "fmha_cutlassB_bf16_aligned_128x128_k128_sm80",
        "triton_tem_fused_flex_attention_0",
        "triton_tem_fused_flex_attention_backward_mul_1",
    ],
    "loss": [
        "triton_red_fused__log_softmax__to_copy_12",
        "triton_red_fused__log_softmax_backward_data_nll_loss_backward_nll_loss_forward_1",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
        "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)",
        "void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>"
        "(float*, float*, float const*, long const*, float const*, bool, long, long, long, long)",
    ],
    "optimizer": [
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
        "FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
        "(at::native::ADAM_MODE)1, false>, double const*, double, double, double, double, bool, double const*, "
        "double const*>(...)",
    ],
    "elementwise": [
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1",
        "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_2",
        "triton_poi_fused_mul_silu_3",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
        "at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, at::detail::Array<char*, 3>)",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
        "float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
        "float>, unsigned int, float, 4, 4>)",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::"
        "OpaqueType<2u>, unsigned int, 2, 128, 1>(...)",
        # Transformer Engine's FP8 casts (as torchao's are inductor's element-wise kernels)
        "cast_transpose_optimized_kernel(__nv_bfloat16 const*, float const*, __nv_fp8_e5m2*, __nv_fp8_e5m2*, "
        "float const*, float*, float*, unsigned long, unsigned long)",
        "void transformer_engine::unary_kernel<16, true, float, transformer_engine::Empty, "
        "&transformer_engine::dispatch::fp8::detail::identity, __nv_bfloat16, __nv_fp8_e4m3>(...)",
    ],
    "communication": [
        "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        "ncclDevKernel_AllReduce_Sum_f32_TREE_LL(ncclDevKernelArgsStorage<4096ul>)",
        "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclWorkElem)",
        "Memcpy PtoP (Device -> Device)",
    ],
    "other": [
        "Memcpy HtoD (Pinned -> Device)",
        "Memcpy DtoH (Device -> Pinned)",
        "Memset (Device)",
    ],
    # Gathers by index outside any range: an MoE block's permutation, and a dense model's embedding lookup.
    "routing": [
        "void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, "
        "true>(...)",
    ],
}


# The CPU ops a CPU run classifies.
CPU_OPS = {
    "gemm": ["aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::_grouped_mm"],
    "attention": ["aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu_backward"],
    "loss": ["aten::_log_softmax", "aten::nll_loss_backward", "aten::cross_entropy_loss"],
    "optimizer": ["aten::_fused_adamw_"],
    "communication": ["c10d::allreduce_", "gloo:all_reduce", "c10d::reduce_scatter_tensor_coalesced_"],
    "elementwise": ["aten::mul", "aten::add_", "aten::rsqrt", "aten::silu"],
    "other": ["aten::view", "aten::empty", "detach"],
}


@pytest.mark.parametrize("names", [KERNELS, CPU_OPS], ids=["gpu-kernels", "cpu-ops"])
def test_names_alone_give_the_category(names):
    wrong = {name: classify(name) for expected, listed in names.items() for name in listed
             if classify(name) != expected}
    assert not wrong, wrong


def test_a_range_claims_what_no_name_tells():
    elementwise = "triton_poi_fused_add_mul_0"
    assert classify(elementwise, "loss") == "loss" and classify(elementwise, "fsdp") == "fsdp"
    # The head's GEMM and the loss's all-reduce keep their names' categories inside the loss's range.
    assert classify(KERNELS["gemm"][1], "loss") == "gemm"
    assert classify(KERNELS["communication"][0], "loss") == "communication"
    # A copy inside symmetric memory's fused all-gather matmul is communication; elsewhere it is not.
    assert classify("Memcpy DtoD (Device -> Device)", "communication") == "communication"
    assert classify("Memcpy DtoD (Device -> Device)") == "other"


class Event:
    """The part of torch's _KinetoEvent that the breakdown reads (times in microseconds here)."""

    def __init__(self, name, start, end, *, thread=1, id=0, linked=0, sequence=-1, forward_thread=0,
                 device=DeviceType.CPU, annotation=False):
        self._values = dict(name=name, start_ns=start * 1000, end_ns=end * 1000, start_thread_id=thread,
                            end_thread_id=thread, correlation_id=id, linked_correlation_id=linked, sequence_nr=sequence,
                            fwd_thread_id=forward_thread, device_type=device, is_async=False,
                            is_user_annotation=annotation)

    def __getattr__(self, key):
        return lambda: self._values[key]


def _kernel(name, start, end, launched_by):
    return Event(name, start, end, linked=launched_by, device=DeviceType.CUDA, thread=7)


def test_kernels_take_the_range_of_their_op_and_backward_kernels_that_of_the_forward_op():
    forward, backward = 1, 2
    events = [
        # Forward thread: a block's matmul and add, then the head and loss in their range.
        Event("aten::mm", 0, 10, id=1, sequence=3),
        Event("aten::add", 10, 20, id=2, sequence=4),
        Event(LOSS_RANGE, 30, 60, id=3),
        Event("CompiledFunction", 31, 59, id=4, sequence=7),
        Event(CLIP_RANGE, 200, 220, id=5),
        Event("aten::_foreach_norm", 201, 219, id=6),
        Event("FSDP::all_gather_copy_out (blocks.0)", 0, 5, id=14, thread=forward),
        Event("aten::split_with_sizes_copy", 1, 4, id=15),
        # The CUDA runtime's launch calls are CPU events linked to their op: not ops themselves.
        Event("cudaLaunchKernel", 32, 33, id=900, linked=4),
        # Backward thread: the loss's compiled backward and the add's, made by forward ops 7 and 4.
        Event("autograd::engine::evaluate_function: CompiledFunctionBackward", 100, 150, thread=backward, id=8,
              sequence=7, forward_thread=forward),
        Event("CompiledFunctionBackward", 101, 149, thread=backward, id=9, sequence=7, forward_thread=forward),
        Event("autograd::engine::evaluate_function: AddBackward0", 160, 170, thread=backward, id=10, sequence=4,
              forward_thread=forward),
        Event("aten::mul", 161, 169, thread=backward, id=11),
        Event("c10d::allreduce_", 225, 230, id=12),
        # Compiled code records each triton launch as a CPU range named after its kernel.
        Event("triton_poi_fused_add_0", 10, 11, id=16, annotation=True),
        # The GPU's copy of a range, and a synchronisation: neither is a kernel.
        Event(LOSS_RANGE, 40, 60, device=DeviceType.CUDA, thread=7, annotation=True),
        Event("Stream Wait Event", 0, 300, device=DeviceType.CUDA, thread=7),
    ]
    kernels = [
        _kernel(KERNELS["gemm"][0], 40, 50, launched_by=1),
        _kernel("triton_poi_fused_add_0", 50, 52, launched_by=2),
        _kernel(KERNELS["gemm"][1], 60, 70, launched_by=4),  # the head's GEMM
        _kernel("triton_red_fused_add_mul_1", 70, 75, launched_by=4),  # the loss's element-wise work
        _kernel("triton_red_fused_mul_sum_2", 160, 165, launched_by=9),  # ... and its backward
        _kernel("triton_poi_fused_mul_3", 170, 172, launched_by=11),  # the add's backward
        _kernel("void at::native::lpnorm_cleanup<float, (at::native::NormType)1, float, float>(...)", 230, 231,
                launched_by=6),
        _kernel("void at::native::elementwise_kernel<128, 4, ...direct_copy_kernel_cuda...>(...)", 10, 12,
                launched_by=15),
        _kernel(KERNELS["communication"][2], 231, 240, launched_by=12),
        _kernel("Memcpy HtoD (Pinned -> Device)", 0, 1, launched_by=999),  # its op is not in the profile
    ]
    activities = profile_activities(events + kernels)
    assert [(a.start, a.category) for a in activities] == [
        (40, "gemm"), (50, "elementwise"), (60, "gemm"), (70, "loss"), (160, "loss"), (170, "elementwise"),
        (230, "optimizer"), (10, "fsdp"), (231, "communication"), (0, "other")]
    result = breakdown(activities, steps=1)
    assert result.wall_us == 240 and result.exclusive_us["loss"] == 10 and result.exclusive_us["gemm"] == 20


def test_a_cpu_run_counts_named_ops_whole_and_other_ops_where_they_call_none():
    # aten::linear (a GEMM) calls aten::t and aten::addmm; the loss's range holds a mul and the
    # log-softmax, which calls an empty: each instant is counted once.
    events = [
        Event("aten::linear", 0, 100, id=1, sequence=0),
        Event("aten::t", 1, 2, id=2),
        Event("aten::addmm", 3, 99, id=3, sequence=0),
        Event(LOSS_RANGE, 100, 200, id=4),
        Event("aten::mul", 101, 120, id=5, sequence=1),
        Event("aten::_log_softmax", 120, 190, id=6, sequence=2),
        Event("aten::empty", 121, 122, id=7),
        Event("aten::view", 195, 196, id=8),
    ]
    activities = profile_activities(events)
    assert [(a.name, a.category) for a in activities] == [
        ("aten::linear", "gemm"), ("aten::mul", "loss"), ("aten::_log_softmax", "loss"), ("aten::view", "other")]
    result = breakdown(activities, steps=1)
    assert result.exclusive_us["gemm"] == 100 and result.exclusive_us["loss"] == 89 and result.idle_us == 6


def _profiled_step(device: str, trace_path):
    """A matmul, a loss range and its backward under the profiler: (the live profile's activities,
    those of the trace it exported)."""
    import json

    import torch

    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                          if device == "cuda" else [])
    x = torch.randn(256, 256, device=device, requires_grad=True)
    with torch.profiler.profile(activities=activities) as prof:
        y = x @ x
        with torch.profiler.record_function(LOSS_RANGE):
            loss = (y.sin() * 3).sum()
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(trace_path))
    return (profile_activities(prof.profiler.kineto_results.events()),
            trace_activities(json.loads(trace_path.read_text())))


def test_an_exported_trace_gives_what_the_live_profile_gives(tmp_path):
    live, traced = _profiled_step("cpu", tmp_path / "trace.json")
    assert {a.category for a in live} >= {"gemm", "loss"}
    # The same ops and categories, and their times within a microsecond (the trace has its own clock origin).
    assert [(a.name, a.category) for a in traced] == [(a.name, a.category) for a in live]
    for a, b in zip(live, traced):
        assert b.start - traced[0].start == pytest.approx(a.start - live[0].start, abs=1.0)
        assert b.end - b.start == pytest.approx(a.end - a.start, abs=1.0)


@pytest.mark.gpu
def test_an_exported_gpu_trace_gives_what_the_live_profile_gives(tmp_path):
    _profiled_step("cuda", tmp_path / "warm-up.json")  # cuBLAS handles, workspaces
    live, traced = _profiled_step("cuda", tmp_path / "trace.json")
    assert {a.category for a in live} >= {"gemm", "loss"}
    assert sorted((a.name, a.category) for a in traced) == sorted((a.name, a.category) for a in live)


@pytest.mark.gpu
def test_on_a_gpu_backward_kernels_follow_their_forward_ops_range():
    """The profiler's real links on CUDA: kernel to launching op, backward node to forward op (on
    autograd's device thread), and the GPU's copies of ranges left out."""
    import torch

    x = torch.randn(2048, 2048, device="cuda", requires_grad=True)
    w = torch.randn(2048, 2048, device="cuda", requires_grad=True)

    def profiled(backward: bool) -> list:
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            y = x @ w
            with torch.profiler.record_function(LOSS_RANGE):
                loss = (y.sin() * 3).sum()
            if backward:
                loss.backward()
            torch.cuda.synchronize()
        return profile_activities(prof.profiler.kineto_results.events())

    profiled(True)  # warm-up: cuBLAS handles, workspaces
    forward_only, both = profiled(False), profiled(True)
    assert not [a.name for a in both if a.name == LOSS_RANGE or a.name.startswith("dtrain::")]
    loss_forward = [a for a in forward_only if a.category == "loss"]
    loss_both = [a for a in both if a.category == "loss"]
    assert loss_forward and len(loss_both) > len(loss_forward), [(a.name, a.category) for a in both]
    # x @ w forward and its two backward matmuls.
    assert len([a for a in both if a.category == "gemm"]) >= 3, [(a.name, a.category) for a in both]
