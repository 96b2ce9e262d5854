"""What the machine a run is resolved for is: the facts that decide a kernel, an overlap method or
a refusal, read once (`Machine.detect()`) or stated (the planner's GPUs, tests).

    Machine.detect()              # this process: CUDA or the CPU, its GPU's profile and memory, FP8 GEMMs
    Machine.gpu_profile("h100-sxm")  # a GPU the planner predicts for
    Machine()                     # CPU processes (gloo), as the tests run
"""

from __future__ import annotations

import attrs

# The planner's profile (dtrain/planner/gpus.py) of each GPU whose CUDA name contains the key.
PROFILE_OF_DEVICE = (("A100", "a100-80gb"), ("H100", "h100-sxm"), ("H800", "h800"), ("H200", "h200"),
                     ("B200", "b200"))
DEFAULT_PROFILE = "h200"
# The profiles whose GPUs have no FP8 matmuls (their FP8 recipes run emulated).
WITHOUT_FP8 = ("a100-80gb",)


@attrs.frozen
class Machine:
    device_type: str = "cpu"         # "cuda" (NCCL) or "cpu" (gloo)
    gpu: str = DEFAULT_PROFILE       # the planner's GPU profile: the GPU this machine has, else the default
    fp8_matmuls: bool = False        # FP8 GEMMs (compute capability 8.9 and later)
    symm_mem: bool = False           # torch's fused symmetric-memory matmuls (CUDA builds)
    # One GPU's memory in GB (1e9 bytes), where a choice is sized for it; None: nothing to size for
    # (the CPU, or the planner's GPUs, whose candidates give every choice).
    gpu_memory_gb: float | None = None
    # The machine this process runs on: what its optional packages take (Transformer Engine's
    # recipes on this GPU) is checked too.
    local: bool = False

    @classmethod
    def detect(cls) -> Machine:
        """The machine this process runs on."""
        import torch

        from parallel.tensor_parallel import symm_mem_available

        if not torch.cuda.is_available():
            return cls(local=True)
        device = torch.cuda.current_device()
        properties = torch.cuda.get_device_properties(device)
        return cls(device_type="cuda",
                   gpu=next((name for key, name in PROFILE_OF_DEVICE if key in properties.name), DEFAULT_PROFILE),
                   fp8_matmuls=(properties.major, properties.minor) >= (8, 9), symm_mem=symm_mem_available(),
                   gpu_memory_gb=properties.total_memory / 1e9, local=True)

    @classmethod
    def gpu_profile(cls, profile: str) -> Machine:
        """A machine of GPUs of the planner's `profile`, with a torch that has every CUDA feature."""
        return cls(device_type="cuda", gpu=profile, fp8_matmuls=profile not in WITHOUT_FP8, symm_mem=True)

    def to_dict(self) -> dict:
        return attrs.asdict(self)
