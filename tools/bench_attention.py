"""Attention sub-blocks on one GPU, forward and backward, beside each other: llama-1b's grouped-query
attention and DeepSeek's Multi-head Latent Attention (V2-Lite's shape; V3's with the 16 heads one
GPU holds at tp=8), at the same batch and sequence, each as the model runs it (projections, RoPE,
causal attention on the fused kernels, output projection; compiled with --compile):

    python -m tools.bench --attention all --compile

One JSON line per setup: milliseconds per forward + backward, tokens/s, and model TFLOP/s by the
MFU convention (every matmul parameter 6 times per token, attention 6 S x the summed query/key and
value head dims, causal or not). MLA's values have head dim 128 beside 192 for queries and keys:
`value_path` says whether cuDNN took them as they are, or the values were padded; the `-padded`
setup times the padding on purpose, to compare the two where cuDNN takes both. For GQA it says how
the K/V heads reached the kernel (as they are, or expanded to the query heads) and the kernel SDPA
chose for them; `gqa-llama-1b-expanded` expands them on purpose, beside the layout dtrain chooses.
"""

from __future__ import annotations

import datetime
import json
import math
import time

import attrs
import torch
from torch.nn.attention import sdpa_kernel

from models import llama, mla, spec
from models.config import DeepSeekConfig
from models.context import LocalContext
from models.layers import attention_block
from models.presets import get_model_config
from parallel.context import CUDA_ATTENTION_PRIORITY
from parallel.fused_attention import cudnn_takes_head_dims, fused_causal_attention, gqa_layout
from tools.commit import commit_hash

# name -> (preset, changes to it, values padded on purpose, K/V expanded to the query heads on
# purpose: True, or None for the layout dtrain chooses)
SETUPS = {
    "gqa-llama-1b": ("llama-1b", {}, False, None),
    "gqa-llama-1b-expanded": ("llama-1b", {}, False, True),
    "mla-deepseek-v2-lite": ("deepseek-v2-lite", {}, False, None),
    "mla-deepseek-v2-lite-padded": ("deepseek-v2-lite", {}, True, None),
    "mla-deepseek-v3-tp8": ("deepseek-v3", {"num_heads": 16, "num_kv_heads": 16}, False, None),
}


def cuda_ms_per_call(step, iterations: int, warmup: int = 3) -> float:
    """GPU milliseconds per call of `step`, after `warmup` calls (compilation, allocator, autotuning)."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iterations):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iterations


class _Context(LocalContext):
    """One GPU: the fused kernels, with MLA's values padded and GQA's K/V expanded on purpose where
    `pad` and `expand` say so."""

    def __init__(self, pad: bool, expand: bool | None = None):
        self.pad, self.expand = pad, expand

    def attention(self, q, k, v, mask=None, *, scale=None):
        return fused_causal_attention(q, k, v, mask, scale, pad_values=True if self.pad else None,
                                      expand_kv=self.expand)


def kv_path(cfg, expand: bool | None, dtype: torch.dtype) -> str:
    """How GQA's K/V reached the kernel, and which kernel SDPA picks for the layout dtrain chose."""
    from torch.nn.attention import SDPBackend

    layout = "expanded (forced)" if expand else gqa_layout(torch.cuda.current_device(), dtype, cfg.num_heads,
                                                           cfg.num_kv_heads, cfg.head_dim, cfg.head_dim, True)
    kv_heads = cfg.num_heads if layout.startswith("expanded") else cfg.num_kv_heads

    def tensor(heads):
        return torch.empty(1, heads, 256, cfg.head_dim, device="cuda", dtype=dtype, requires_grad=True)

    with sdpa_kernel(CUDA_ATTENTION_PRIORITY, set_priority=True):
        choice = torch._fused_sdp_choice(tensor(cfg.num_heads), tensor(kv_heads), tensor(kv_heads), is_causal=True,
                                         enable_gqa=kv_heads != cfg.num_heads)
    names = {int(value): name for name, value in SDPBackend.__members__.items()}
    return f"{layout}, SDPA {names.get(int(choice), choice)}"


def _attention_params(cfg) -> dict[str, spec.ParamSpec]:
    std, out_std = llama.init_stds(cfg)
    return mla.attention_params(cfg, std, out_std) if isinstance(cfg, DeepSeekConfig) else llama.attention_params(cfg, std, out_std)


def run_setup(name: str, batch: int, seq_len: int, iterations: int, compile_: bool,
              device: torch.device = torch.device("cuda")) -> dict:
    """One setup's row. On a CPU `device` (a smoke test of the code path, not a measurement) in
    fp32 on SDPA's math kernel, timed by the wall clock."""
    preset, changes, pad, expand = SETUPS[name]
    cfg = attrs.evolve(get_model_config(preset), **changes)
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    specs = _attention_params(cfg)
    params = {path: spec.init_value(s, 0, path, device, dtype).requires_grad_() for path, s in spec.flatten(specs)}
    x = torch.randn(batch, seq_len, cfg.dim, device=device, dtype=dtype, requires_grad=True)
    positions = torch.arange(seq_len, device=device)
    ctx = _Context(pad, expand)
    if isinstance(cfg, DeepSeekConfig):
        rope = mla.rope(cfg, positions)
        width = cfg.num_heads * (cfg.qk_head_dim + cfg.v_head_dim)

        def forward(p, x):
            return mla.attention(p, x, rope, cfg, ctx)
    else:
        rope = llama.make_aux(cfg, positions).rope
        width = 2 * cfg.num_heads * cfg.head_dim

        def forward(p, x):
            return attention_block(p, x, rope, cfg.num_heads, cfg.num_kv_heads, ctx)
    step = torch.compile(forward) if compile_ else forward
    grad = torch.randn(batch, seq_len, cfg.dim, device=device, dtype=dtype)

    def once():
        for t in (*params.values(), x):
            t.grad = None
        step(params, x).backward(grad)

    if on_gpu:
        with sdpa_kernel(CUDA_ATTENTION_PRIORITY, set_priority=True):
            ms = cuda_ms_per_call(once, iterations)
    else:
        once()
        started = time.perf_counter()
        for _ in range(iterations):
            once()
        ms = (time.perf_counter() - started) * 1e3 / iterations
    tokens = batch * seq_len
    matmul = sum(math.prod(s.shape) for s in specs.values() if len(s.shape) >= 2)
    model_flops = tokens * (6.0 * matmul + 6.0 * seq_len * width)
    value_path = None
    if isinstance(cfg, DeepSeekConfig) and on_gpu:
        native = cudnn_takes_head_dims(torch.cuda.current_device(), dtype, cfg.qk_head_dim, cfg.v_head_dim, True)
        value_path = "padded" if pad or not native else "cuDNN as they are"
    elif isinstance(cfg, DeepSeekConfig):
        value_path = "math kernel (CPU)"
    elif on_gpu and cfg.num_kv_heads != cfg.num_heads:
        value_path = kv_path(cfg, expand, dtype)
    return {
        "kind": "attention", "setup": name, "preset": preset, "heads": cfg.num_heads, "batch": batch,
        "seq_len": seq_len, "compile": compile_, "ms_fwd_bwd": round(ms, 3),
        "tokens_per_sec": round(tokens / ms * 1e3), "model_tflops": round(model_flops / ms / 1e9, 1),
        "value_path": value_path, "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if on_gpu else "cpu", "commit": commit_hash(),
        "date": datetime.date.today().isoformat(),
    }


def run(names: list[str], batch: int, seq_len: int, iterations: int, compile_: bool) -> list[dict]:
    if not torch.cuda.is_available():
        raise SystemExit("error: the attention benchmark needs a CUDA GPU")
    rows = []
    for name in names:
        row = run_setup(name, batch, seq_len, iterations, compile_)
        print(json.dumps(row), flush=True)
        rows.append(row)
    for row in rows:
        print(f"{row['setup']:<30} {row['ms_fwd_bwd']:8.2f} ms  {row['tokens_per_sec']:>10,} tok/s  "
              f"{row['model_tflops']:6.1f} TFLOP/s  {row['value_path'] or ''}")
    return rows
