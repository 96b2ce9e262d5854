"""The plain PyTorch baseline that `python -m tools.bench --baseline` times beside each dtrain run,
in the same process and at the same shape, batch and precision: a Llama written the way a user of
plain PyTorch would write it, with none of dtrain's layers.

    row = run_baseline(model_cfg, seq_len=4096, micro_batch=8, global_batch=32, steps=14, warmup=4)

nn.Modules with a fused QKV projection, nn.RMSNorm, rotate-half RoPE, SDPA (causal, enable_gqa,
cuDNN first as dtrain asks) and SwiGLU; fp32 parameters under bf16 autocast; each block and the
head with its cross-entropy compiled on their own; gradient accumulation over the micro-batches of
a step, foreach gradient clipping at 1.0 and fused AdamW; with `fp8`, torchao's float8 training
on the blocks' linears (and the output projection with `fp8_head`). Random tokens, drawn before
the timed steps. Throughput is the median step's, as tools.bench reports dtrain's.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from models import flops
from models.config import LlamaConfig
from models.layers import rope_frequencies, rope_table

# The SDPA kernels in dtrain's order (parallel/context.py): cuDNN is the fastest on Hopper.
ATTENTION_PRIORITY = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        width = cfg.num_heads * cfg.head_dim
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.qkv = nn.Linear(cfg.dim, width + 2 * cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(width, cfg.dim, bias=False)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.w_gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        q = _rotate(q.view(batch, seq, self.heads, self.head_dim), cos, sin)
        k = _rotate(k.view(batch, seq, self.kv_heads, self.head_dim), cos, sin)
        v = v.view(batch, seq, self.kv_heads, self.head_dim)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                             enable_gqa=self.kv_heads != self.heads)
        x = x + self.wo(out.transpose(1, 2).reshape(batch, seq, -1))
        h = self.ffn_norm(x)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.embed.weight
        for name, param in self.named_parameters():
            if param.ndim == 2:
                nn.init.normal_(param, std=cfg.init_std)
        self.head_loss = self._head_loss

    def _head_loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    def compile_parts(self) -> None:
        for block in self.blocks:
            block.compile()
        self.head_loss = torch.compile(self._head_loss)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head_loss(x, labels)


def _convert_to_float8(model: Llama, recipe: str, head: bool, emulate: bool) -> None:
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, fqn: fqn != "output" or head)


def unsupported(cfg, document_mask: bool = False) -> str | None:
    """Why the baseline cannot run this model as dtrain does, or None: it is a plain Llama."""
    if type(cfg) is not LlamaConfig:
        return f"{type(cfg).__name__} models"
    extras = [name for name in ("qk_norm", "attention_bias", "attention_sinks", "sliding_window", "layer_pattern",
                                "attention_chunk") if getattr(cfg, name)]
    extras += ["--document-mask"] if document_mask else []
    return ", ".join(extras) if extras else None


def run_baseline(cfg: LlamaConfig, *, seq_len: int, micro_batch: int, global_batch: int, steps: int, warmup: int,
                 compile_: bool = True, precision: str = "bf16", fp8: str | None = None, fp8_head: bool = False,
                 device: torch.device | None = None, seed: int = 0) -> dict:
    """Trains the baseline for `steps` optimizer steps of `global_batch` samples; returns its
    tokens/s (median over the steps after `warmup`), MFU, peak memory and last loss. `fp8`: a
    torchao recipe (emulated off Hopper-class GPUs)."""
    device = device or torch.device("cuda")
    on_gpu = device.type == "cuda"
    # What an earlier run in this process still holds (nothing, where it gave its memory back).
    held_gb = torch.cuda.memory_allocated(device) / 1e9 if on_gpu else 0.0
    torch.manual_seed(seed)
    with torch.device(device):
        model = Llama(cfg)
    if fp8 is not None:
        native = on_gpu and torch.cuda.get_device_capability(device) >= (8, 9)
        _convert_to_float8(model, fp8, fp8_head, emulate=not native)
    if compile_:
        model.compile_parts()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    compute_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    inv_freq = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
    # [seq, 1, head_dim]: broadcast over the heads of [batch, seq, heads, head_dim].
    cos, sin = (t[:, None, :].to(compute_dtype) for t in rope_table(torch.arange(seq_len, device=device), inv_freq))
    micro_batches = global_batch // micro_batch
    generator = torch.Generator(device=device).manual_seed(seed)
    data = torch.randint(0, cfg.vocab_size, (micro_batches, micro_batch, seq_len + 1), device=device,
                         generator=generator)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16"
                else contextlib.nullcontext())
    kernels = sdpa_kernel(ATTENTION_PRIORITY, set_priority=True) if on_gpu else contextlib.nullcontext()
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    times, loss = [], None
    with kernels:
        for _ in range(steps):
            started = time.perf_counter()
            for sample in data:
                with autocast:
                    loss = model(sample[:, :-1], sample[:, 1:], cos, sin)
                (loss / micro_batches).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if on_gpu:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - started)
    step_s = statistics.median(times[warmup:] or times)
    tokens_per_sec = global_batch * seq_len / step_s
    from dtrain.metrics import peak_flops, peak_memory_gb

    peak = peak_flops(device)
    return {
        "tokens_per_sec_per_gpu": round(tokens_per_sec, 1), "median_step_s": round(step_s, 4),
        "mfu_pct": round(100 * flops.flops_per_token(cfg, seq_len) * tokens_per_sec / peak, 2) if peak else None,
        "peak_mem_gb": round(peak_memory_gb(device), 2), "final_loss": round(float(loss.detach()), 4),
        "fp8": fp8, "fp8_head": fp8_head, "compile": compile_, "held_before_gb": round(held_gb, 2),
    }
