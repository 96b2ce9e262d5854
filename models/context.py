"""The one door between the functional core and the parallel backend.

Forward functions call only these methods for anything that depends on how the model is laid
out on devices. `LocalContext` is the single-device meaning of each; the parallel backend
(`parallel.context.ParallelContext`) gives the same methods their sharded meaning.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from models import masking
from models.config import ClampedSwiGLU
from models.linear_cross_entropy import linear_cross_entropy_sum
from models.masking import AttentionMask

# LocalContext's form of a mask: [batch, 1, seq, seq] bool, built with the mask.
DENSE_FORM = "dense"

LOGITS = ("batch", "seq", "vocab")


class ModelContext(Protocol):
    def constrain(self, x: torch.Tensor, axes: tuple[str | None, ...], region: str) -> torch.Tensor:
        """Lays out activation `x` (one logical axis per dim) as the plan wants it in `region`."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight.T with the configured precision backend (weight is [out, in])."""

    def linear_many(self, x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
        """`linear(x, w)` for each of `weights` (same input width), as one matmul where the
        context can."""

    def embedding(self, tokens: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Rows of `weight` [vocab, embed] for each token id."""

    def attention_mask(self, document_ids: torch.Tensor, window: int | None = None,
                       chunk: int | None = None, *, sinks: bool = False) -> AttentionMask | None:
        """The mask of one micro-batch for `attention`: attention within each document of
        `document_ids` [batch, seq] (full rows, on the host; zeros for one document per row),
        within `window` tokens back and within `chunk`-token chunks of absolute positions. Built
        once before the forward, in the forms this context's kernels read (`sinks`: for attention
        with sinks), and shared by every layer of its kind; None where plain causal attention is
        the same."""

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: AttentionMask | None = None, *, scale: float | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention over [batch, seq, heads, head_dim] tensors; k/v may have fewer heads (GQA),
        and v its own head_dim (MLA), which the output has. With `mask` (from `attention_mask`), a
        token attends only to the keys the mask keeps. `scale` multiplies the scores (default
        head_dim ** -0.5). `sinks` [heads] (gpt-oss's attention sinks): one logit per head that
        joins each query's softmax and is dropped, p_j = e^{s_j} / (sum_i e^{s_i} + e^{sink})."""

    def cross_entropy_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed token cross-entropy in fp32; labels of -100 are ignored."""

    def output_cross_entropy_sum(self, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """`cross_entropy_sum` of the logits `linear(h, weight)` (weight [vocab, embed]), laid out
        as ("batch", "seq", "vocab") in the "logits" region; computed a chunk of tokens at a time
        where the context is set to, so that the logits of all tokens never exist at once."""

    def per_token(self, fn, params: dict, x: torch.Tensor) -> torch.Tensor:
        """`fn(params, x)` for a computation that treats each token on its own (MoE routing and
        experts), on the tokens this rank owns; same layout out as `x` came in."""

    def sum_over_token_shards(self, t: torch.Tensor) -> torch.Tensor:
        """Sums a statistic (no gradient) over the ranks holding other tokens of the same samples,
        so that per-sample statistics (the experts' load) are those of one device."""

    def experts(self, x: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                w_down: torch.Tensor, *, biases: ExpertBiases | None = None,
                glu: ClampedSwiGLU | None = None) -> torch.Tensor:
        """SwiGLU experts over rows grouped by expert: x [rows, embed] holds counts[e] rows for
        expert e, contiguous and in expert order (counts [num_experts], int, sums to rows);
        w_gate, w_up [num_experts, mlp, embed], w_down [num_experts, embed, mlp]. Returns
        [rows, embed], row i being its expert's output for x[i], in the same order. `biases`
        (gate and up [num_experts, mlp], down [num_experts, embed]) are added to each expert's
        projections; `glu` replaces SwiGLU's gated unit (gpt-oss's clamped one)."""

    def experts_on_tokens(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                          w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, *,
                          biases: ExpertBiases | None = None, glu: ClampedSwiGLU | None = None) -> torch.Tensor | None:
        """The routed experts on whole tokens, for a context that exchanges tokens rather than
        rows sorted by expert: x [tokens, embed], expert_ids and weights [tokens, top_k] (dropless
        routing). Returns [tokens, embed], each token's weighted sum of its experts' outputs; or
        None, and the caller sorts rows by expert and calls `experts`. `biases`, `glu` as `experts`."""


def _fake_and_eager(t: torch.Tensor) -> bool:
    """Whether `t` is a fake tensor outside torch.compile: a dry run's, which stands for a GPU's
    program (its blocks run eagerly). Dynamo does not trace torch's `is_fake`: called in a compiled
    block it would break the graph, and under selective recompute send the whole checkpointed block
    back to eager; a compiled block's tensors hold real data, so there it is False, unasked."""
    return not torch.compiler.is_compiling() and is_fake(t)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: AttentionMask | None = None, scale: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal SDPA on [batch, seq, heads, head_dim] inputs, GQA by head groups; with `mask` the
    keys are also limited to those it keeps (a dense boolean mask: the reference meaning); with
    `sinks` [heads], the softmax over the scores and each head's sink logit, the sink dropped."""
    dense = None
    if mask is not None:
        dense = mask.forms.get(DENSE_FORM)
        if dense is None:
            positions = torch.arange(q.shape[1], device=q.device)
            dense = masking.allowed(mask.first_key, positions, positions).unsqueeze(1)
    if sinks is not None:
        return _attention_with_sinks(q, k, v, sinks, dense, scale)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    gqa = k.shape[1] != q.shape[1]
    if dense is None and _fake_and_eager(q) and v.shape[-1] < q.shape[-1]:
        # Fake tensors (`--dry-run`) stand for the GPUs' fused kernels, which keep no scores; the
        # CPU's fused kernel wants v as wide as q (MLA's is narrower), else the math path keeps
        # every score: v is padded and the output cut back.
        width = v.shape[-1]
        v = F.pad(v, (0, q.shape[-1] - width))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)[..., :width]
    elif dense is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=gqa, scale=scale)
    return out.transpose(1, 2)


def _attention_with_sinks(q, k, v, sinks, allowed: torch.Tensor | None, scale: float | None) -> torch.Tensor:
    """The math of attention sinks: a column of each head's sink logit beside the scores, the
    softmax over both, the sink's column dropped. `allowed` [batch, 1, q, k] (None: causal)."""
    heads = q.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if k.shape[1] != heads:
        k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    if allowed is None:
        allowed = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink_column = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:3], 1)
    probs = torch.cat([scores, sink_column], dim=-1).softmax(-1)[..., :-1]
    return (probs.to(v.dtype) @ v).transpose(1, 2)


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `grouped_swiglu` can use torch's grouped GEMM kernel for these tensors.

    CUDA only: the CPU kernel is correct (tests/unit/test_moe.py) but CPU runs are small and the
    loop is the simpler path there. Fake tensors (a dry run, which runs a GPU's program without
    data) take the kernel too: the loop reads the row counts, which they do not hold. The CUDA
    kernel wants 16-byte aligned rows, which for every dtype here means embed and mlp widths
    that are multiples of 8.
    """
    return (
        hasattr(F, "grouped_mm")
        and (x.is_cuda or _fake_and_eager(x))
        and x.dtype in (torch.bfloat16, torch.float32)
        and all(w.dtype == x.dtype for w in weights)
        and all(size % 8 == 0 for w in weights for size in w.shape[1:])
    )


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: grouped_mm's backward
    rejects zero-stride gradients (such as that of `out.sum()`) on CPU and CUDA alike."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class ExpertBiases(NamedTuple):
    """Biases of the routed experts' projections: gate and up [num_experts, mlp], down [num_experts, embed]."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


def gated_unit(gate: torch.Tensor, up: torch.Tensor, glu: ClampedSwiGLU | None) -> torch.Tensor:
    """SwiGLU's silu(gate) * up, or the clamped unit `glu` describes."""
    if glu is None:
        return F.silu(gate) * up
    gate, up = gate.clamp(max=glu.limit), up.clamp(-glu.limit, glu.limit)
    return gate * torch.sigmoid(glu.alpha * gate) * (up + 1)


def _bias_of_rows(bias: torch.Tensor, offs: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, width]: each row's expert's bias (bias [num_experts, width], offs the cumulative
    group ends), zeros for rows past the groups; from the offsets on the device, no host sync."""
    expert_of_row = torch.searchsorted(offs, torch.arange(rows, device=offs.device, dtype=offs.dtype), right=True)
    return F.pad(bias, (0, 0, 0, 1))[expert_of_row]


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Each group of rows of x (groups ending at `offs`) times its expert's w [experts, out, in]
    transposed: torch's grouped GEMM, which reads the offsets on the device (no host sync)."""
    return F.grouped_mm(x, w.transpose(-2, -1), offs=offs)


def grouped_swiglu(x: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                   w_down: torch.Tensor, use_grouped_mm: bool | None = None, *, biases: ExpertBiases | None = None,
                   glu: ClampedSwiGLU | None = None, mm=None) -> torch.Tensor:
    """`ModelContext.experts` on local tensors: one grouped GEMM per projection where the kernel
    is supported (`use_grouped_mm=None` decides), else a loop over the experts; with `biases`
    each row gets its expert's, between the GEMMs. `mm(x, w, offs)` is the grouped GEMM (as
    `_grouped_mm`; FP8 experts pass theirs), which implies the grouped path."""
    if mm is not None:
        use_grouped_mm = True
    if use_grouped_mm is None:
        use_grouped_mm = grouped_mm_supported(x, w_gate, w_up, w_down)
    # No rows at all happens under expert parallelism, to a rank whose experts no token chose.
    # grouped_mm's backward can fail then (on CPU it rejects the gradient of an empty output, whose
    # strides are degenerate); the loop gives every weight its zero gradient, which FSDP's
    # reduce-scatter over the ranks that share these experts needs from every rank.
    if use_grouped_mm and x.shape[0] > 0:
        mm = mm or _grouped_mm
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        gate, up = mm(x, w_gate, offs), mm(x, w_up, offs)
        if biases is not None:
            gate = gate + _bias_of_rows(biases.gate, offs, x.shape[0])
            up = up + _bias_of_rows(biases.up, offs, x.shape[0])
        out = mm(gated_unit(gate, up, glu), w_down, offs)
        if biases is not None:
            out = out + _bias_of_rows(biases.down, offs, x.shape[0])
        return _ContiguousGrad.apply(out)
    return _expert_loop_swiglu(x, counts, w_gate, w_up, w_down, biases, glu)


@torch.compiler.disable
def _expert_loop_swiglu(x, counts, w_gate, w_up, w_down, biases=None, glu=None) -> torch.Tensor:
    """One expert at a time, outside compiled graphs: the rows per expert change every step, and a
    graph would be recompiled for each new split until torch's recompile limit. Rows past the
    counts' sum belong to no expert and give zeros."""
    sizes = counts.tolist()
    *per_expert, rest = x.split([*sizes, x.shape[0] - sum(sizes)])
    outputs = []
    for expert, rows in enumerate(per_expert):
        bias = (lambda name: None) if biases is None else (lambda name: getattr(biases, name)[expert])
        hidden = gated_unit(F.linear(rows, w_gate[expert], bias("gate")), F.linear(rows, w_up[expert], bias("up")), glu)
        outputs.append(F.linear(hidden, w_down[expert], bias("down")))
    outputs.append(rest.new_zeros(rest.shape[0], w_down.shape[1]))
    return torch.cat(outputs)


def _is_plain(weight: torch.Tensor) -> bool:
    """A whole tensor with nothing attached: not a DTensor (its placements are per weight) nor a
    subclass such as torchao's float8 tensors (their scales are per weight)."""
    return type(weight) in (torch.Tensor, torch.nn.Parameter)


class _ConcatenatedLinear(torch.autograd.Function):
    """x @ cat(weights).T: one GEMM forward, one for each gradient. It saves the weights rather
    than their concatenation, which would keep a copy of them alive until backward (FSDP frees
    its gathered weights after forward and gathers them again for backward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, *weights)
        return F.linear(x, torch.cat(weights))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, *weights = ctx.saved_tensors
        grad_x = grad @ torch.cat(weights) if ctx.needs_input_grad[0] else None
        grad_weights = [None] * len(weights)
        if any(ctx.needs_input_grad[1:]):
            grad_weight = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
            grad_weights = [g if needed else None for g, needed in
                            zip(grad_weight.split([w.shape[0] for w in weights]), ctx.needs_input_grad[1:])]
        return grad_x, *grad_weights


class LocalContext:
    """Everything on one device: no constraints, plain matmuls, SDPA with its default kernel choice.

    `fuse_projections` makes `linear_many` one matmul over the concatenated weights. It is off by
    default: on H200s with compiled blocks it measured slower (the README's benchmark table).
    `loss_chunk_tokens` > 0 makes `output_cross_entropy_sum` take that many tokens at a time
    (models/linear_cross_entropy.py), each chunk's element-wise part compiled with
    `compile_loss_chunks`."""

    fuse_projections: bool = False
    loss_chunk_tokens: int = 0
    compile_loss_chunks: bool = False

    def constrain(self, x, axes, region):
        return x

    def linear(self, x, weight):
        return F.linear(x, weight)

    def linear_many(self, x, weights):
        if not (self.fuse_projections and all(_is_plain(w) for w in weights)):
            return [self.linear(x, w) for w in weights]
        fused = self._concatenated_linear(x, weights)
        return list(fused.split([w.shape[0] for w in weights], dim=-1))

    def _concatenated_linear(self, x, weights):
        """`linear` of x by the weights stacked as one [sum of outs, in] weight."""
        return _ConcatenatedLinear.apply(x, *weights)

    def embedding(self, tokens, weight):
        return F.embedding(tokens, weight)

    def attention_mask(self, document_ids, window=None, chunk=None, *, sinks=False):
        first = masking.first_keys(document_ids, window, chunk)
        if masking.is_plain_causal(first):
            return None
        positions = torch.arange(first.shape[1])
        return AttentionMask(first, window, {DENSE_FORM: masking.allowed(first, positions, positions).unsqueeze(1)})

    def attention(self, q, k, v, mask=None, *, scale=None, sinks=None):
        if mask is not None and mask.first_key.device != q.device:
            mask = AttentionMask(mask.first_key.to(q.device), mask.window,
                                 {name: form.to(q.device) for name, form in mask.forms.items()})
        return causal_attention(q, k, v, mask, scale, sinks)

    def per_token(self, fn, params, x):
        return fn(params, x)

    def sum_over_token_shards(self, t):
        return t

    def cross_entropy_sum(self, logits, labels):
        return F.cross_entropy(
            logits.flatten(0, -2).float(), labels.flatten(), reduction="sum", ignore_index=-100
        )

    def output_cross_entropy_sum(self, h, weight, labels):
        if self.loss_chunk_tokens:
            return linear_cross_entropy_sum(h, weight, labels, self.loss_chunk_tokens, self.compile_loss_chunks)
        return self.unfused_output_cross_entropy_sum(h, weight, labels)

    def unfused_output_cross_entropy_sum(self, h, weight, labels):
        """The logits of every token at once, then their loss."""
        return self.cross_entropy_sum(self.constrain(self.linear(h, weight), LOGITS, "logits"), labels)

    def experts(self, x, counts, w_gate, w_up, w_down, *, biases=None, glu=None):
        return grouped_swiglu(x, counts, w_gate, w_up, w_down, biases=biases, glu=glu)

    def experts_on_tokens(self, x, expert_ids, weights, w_gate, w_up, w_down, *, biases=None, glu=None):
        return None
