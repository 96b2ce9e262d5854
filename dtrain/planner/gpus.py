"""GPU profiles: what the planner predicts for on each kind of GPU.

    from dtrain.planner.gpus import profile
    hw = profile("h100-sxm")                      # a Hardware: memory, peaks, rates, links
    hw = profile("b200", memory_gb=180, inter_node_gb_s=50)

The H200's rates are measured (hardware.py). No other GPU has been measured yet, so each of
their rates is the H200's scaled by the ratio of the two GPUs' datasheet figures that bounds it
(SCALED_BY): GEMMs and attention by the dense BF16 peak, FP8 GEMMs by the dense FP8 peak,
copies and element-wise kernels by HBM bandwidth, collectives inside a node by NVLink bandwidth,
host copies by PCIe. Fixed costs per call (launches, latencies) are kept as measured. A GPU
without FP8 matmuls (A100) runs FP8 recipes at its BF16 rate, their casts emulated. A measured
profile replaces the scaled one row by row.
"""

from __future__ import annotations

import attrs

from dtrain.layout.machine import DEFAULT_PROFILE, Machine
from dtrain.planner.hardware import H200, Hardware


@attrs.frozen
class Datasheet:
    """A GPU's published figures (dense, no sparsity) and its usual cluster."""

    label: str
    memory_gb: float
    bf16_tflops: float        # the MFU denominator
    fp8_tflops: float         # 0: no FP8 matmuls
    hbm_tb_s: float
    nvlink_gb_s: float        # both directions, all links of one GPU
    network_gb_s: float       # per GPU between nodes, the usual cluster's
    pcie_gb_s: float          # host <-> GPU, one direction
    # The share of the dense peaks its clocks sustain, where a power limit holds them below the
    # datasheet part's (1: as the datasheet).
    sustained: float = 1.0


DATASHEETS = {
    "a100-80gb": Datasheet("A100 SXM 80GB", 80.0, 312.0, 0.0, 2.039, 600.0, 25.0, 32.0),
    "h100-sxm": Datasheet("H100 SXM", 80.0, 989.0, 1979.0, 3.35, 900.0, 50.0, 64.0),
    "h800": Datasheet("H800 SXM", 80.0, 989.0, 1979.0, 3.35, 400.0, 50.0, 64.0),
    "h200": Datasheet("H200 SXM", 141.0, 989.0, 1979.0, 4.8, 900.0, 50.0, 64.0),
    # Meta's Grand Teton H100 (TorchTitan's published runs): HBM2e at 2.4 TB/s and a 500 W limit,
    # whose peak TorchTitan places between the SXM part's and the NVL part's (835 TFLOP/s dense
    # BF16): the midpoint, 912 of the SXM's 989, until a measurement says.
    "h100-hbm2e": Datasheet("H100 HBM2e 96GB 500W", 96.0, 989.0, 1979.0, 2.4, 900.0, 50.0, 64.0, sustained=0.92),
    "b200": Datasheet("B200 (HGX)", 180.0, 2250.0, 4500.0, 8.0, 1800.0, 50.0, 64.0),
}
MEASURED = "h200"
DEFAULT = DEFAULT_PROFILE

# Each measured rate and the datasheet figure whose ratio carries it to another GPU.
SCALED_BY = {
    "gemm_tflops": "bf16_tflops",
    "attention_tflops": "bf16_tflops",
    "fp8_gemm_tflops": "fp8_tflops",
    "hbm_tb_s": "hbm_tb_s",
    "nvlink_gb_s": "nvlink_gb_s",
    "host_gb_s": "pcie_gb_s",
}


def profile(name: str, memory_gb: float | None = None, inter_node_gb_s: float | None = None, **settings) -> Hardware:
    """The Hardware of GPU `name` (a key of DATASHEETS); `memory_gb` and `inter_node_gb_s` override
    the datasheet's memory and the usual network, `settings` any other Hardware field."""
    if name not in DATASHEETS:
        from models.errors import UserError

        raise UserError(f"unknown --gpu {name!r}; choose one of {', '.join(DATASHEETS)}")
    sheet, measured = DATASHEETS[name], DATASHEETS[MEASURED]
    rates = {}
    for rate, figure in SCALED_BY.items():
        theirs, ours = getattr(sheet, figure), getattr(measured, figure)
        if figure in ("bf16_tflops", "fp8_tflops"):
            theirs, ours = theirs * sheet.sustained, ours * measured.sustained
        if figure == "fp8_tflops" and not theirs:
            # No FP8 matmuls: the recipes' matmuls run in BF16.
            rates[rate] = getattr(H200, "gemm_tflops") * sheet.bf16_tflops / measured.bf16_tflops
        else:
            rates[rate] = getattr(H200, rate) * theirs / ours
    # A grouped GEMM reads each expert's weights once per call: the rows at which that costs as
    # much as its FLOPs grow with the FLOP rate over the bandwidth.
    rates["grouped_gemm_half_rows"] = H200.grouped_gemm_half_rows * (rates["gemm_tflops"] / H200.gemm_tflops) / (
        rates["hbm_tb_s"] / H200.hbm_tb_s)
    rates["fp8_grouped_gemm_half_rows"] = H200.fp8_grouped_gemm_half_rows * (
        rates["fp8_gemm_tflops"] / H200.fp8_gemm_tflops) / (rates["hbm_tb_s"] / H200.hbm_tb_s)
    hardware = attrs.evolve(H200, name=name, gpu_memory_gb=sheet.memory_gb, peak_tflops=sheet.bf16_tflops,
                            fp8_peak_tflops=sheet.fp8_tflops, inter_node_gb_s=sheet.network_gb_s, **rates)
    overrides = {"gpu_memory_gb": memory_gb, "inter_node_gb_s": inter_node_gb_s, **settings}
    return attrs.evolve(hardware, **{key: value for key, value in overrides.items() if value is not None})


def detect() -> str:
    """The profile of the GPU this process sees, else the default."""
    return Machine.detect().gpu


def ratios(name: str) -> dict[str, float]:
    """Each measured rate's factor from the H200 to GPU `name` (SCALED_BY's datasheet ratios, FP8
    at the BF16 ratio where the GPU has no FP8 matmuls)."""
    hw = profile(name)
    return {rate: getattr(hw, rate) / getattr(H200, rate) for rate in SCALED_BY}


def profiles_table() -> str:
    """Each profile's datasheet figures, the ratios that carry the H200's measured rates to it, and
    the rates the planner predicts with (markdown)."""
    lines = ["| --gpu | GPU | memory | BF16 / FP8 dense peak | HBM | NVLink | network per GPU | x H200: GEMMs and "
             "attention / FP8 GEMMs / copies / NVLink / host | BF16 GEMM | FP8 GEMM | attention | copy | NCCL bus in "
             "a node | host copies |", "|" + "---|" * 14]
    for name, sheet in DATASHEETS.items():
        hw = profile(name)
        fp8 = f"{sheet.fp8_tflops:,.0f}" if sheet.fp8_tflops else "none"
        factors = ratios(name)
        scale = " / ".join(f"{factors[rate]:.2f}" for rate in ("gemm_tflops", "fp8_gemm_tflops", "hbm_tb_s",
                                                                "nvlink_gb_s", "host_gb_s"))
        held = f" (sustained {sheet.sustained:.2f})" if sheet.sustained != 1 else ""
        lines.append(f"| {name} | {sheet.label} | {sheet.memory_gb:g} GB | {sheet.bf16_tflops:,.0f} / {fp8} TFLOP/s"
                     f"{held} | {sheet.hbm_tb_s:g} TB/s | {sheet.nvlink_gb_s:,.0f} GB/s | {sheet.network_gb_s:g} GB/s | "
                     f"{'measured' if name == MEASURED else scale} | {hw.gemm_tflops:,.0f} | {hw.fp8_gemm_tflops:,.0f} | "
                     f"{hw.attention_tflops:,.0f} | {hw.hbm_tb_s:.2f} TB/s | {hw.nvlink_gb_s:,.0f} GB/s | "
                     f"{hw.host_gb_s:g} GB/s |")
    scaled = ", ".join(f"{rate} by {figure}" for rate, figure in SCALED_BY.items())
    lines += ["", f"The {MEASURED} rates are measured (attention's fitted on whole steps); the others are the "
                  f"{MEASURED}'s scaled by the datasheet ratio of: {scaled}; a GPU without FP8 matmuls runs FP8 "
                  f"recipes at its BF16 rate, and a power-limited one scales its peaks by the share its clocks "
                  f"sustain. Fixed costs per call (launches, latencies) are kept as measured."]
    return "\n".join(lines)
