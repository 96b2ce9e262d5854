"""Multi-token prediction (DeepSeek-V3) as one layer of pure functions beside the head: both read
the last block's output.

For depth k = 1 .. D, with h_0 the main model's last hidden state after the head's final norm:

    h_k = RMSNorm_k(Block_k(W_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h_{k-1})]))
    loss_k = sum_i CE(h_k W_out, t_{i+k+1})

sharing the embedding and the output projection with the main model (the layout of DeepSeek's
checkpoints and of transformers' MTP layers). Position i sees the embedding of token i+k, and
attention is causal, so module k predicts t_{i+k+1} from tokens up to t_{i+k} only.

The layer returns a term to add to the head's loss: zero in value, so that the loss stays the
next-token loss that is logged, with the gradient of mtp_loss_weight / D times the summed MTP
losses, whose values go to an `MTPStats` on the shared `aux`. (A plain sum, not a loss attached
to the hidden state as the router losses are: the head's weights, which MTP shares, must not sit
downstream of the MTP graph, or zero-bubble pipeline schedules, which take weight gradients
apart, walk it twice.) The tokens k ahead and their labels come in `aux.mtp_targets`, made from
whole sequences (`future_targets`) before a sequence is split over context-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from models import spec
from models.context import ModelContext
from models.layers import rms_norm

RESIDUAL = ("batch", "seq", "embed")
# What the layer reads of the layers it shares weights with.
TIED = {"embedding": "embed.weight", "output": "head.output", "final_norm": "head.norm"}


def future_targets(labels: torch.Tensor, depth: int) -> torch.Tensor:
    """[batch, seq, depth, 2] long from labels [batch, seq] of whole sequences (labels[:, i] is
    token i+1): [..., k-1, 0] is token i+k, the input of depth k, and [..., k-1, 1] token i+k+1, its
    label (-100 past the end of the sequence, where the input is then token 0)."""
    seq = labels.shape[1]
    padded = F.pad(labels, (0, depth), value=-100)
    inputs = torch.stack([padded[:, k:k + seq] for k in range(depth)], dim=-1).clamp_min(0)
    targets = torch.stack([padded[:, k + 1:k + 1 + seq] for k in range(depth)], dim=-1)
    return torch.stack([inputs, targets], dim=-1)


def packed_targets(labels: torch.Tensor, depth: int) -> torch.Tensor:
    """[batch, seq, 1 + 2 depth]: the labels, then `future_targets` flattened, as one tensor (what a
    pipeline schedule splits into micro-batches). `unpack_targets` undoes it."""
    return torch.cat([labels.unsqueeze(-1), future_targets(labels, depth).flatten(-2)], dim=-1)


def unpack_targets(packed: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels [batch, seq], future targets [batch, seq, depth, 2]) of a `packed_targets` tensor."""
    return packed[..., 0], packed[..., 1:].unflatten(-1, (depth, 2))


def mtp_params(cfg, block_params: Callable[[int], dict[str, Any]]) -> dict[str, Any]:
    """One module per depth; `block_params(index)` gives the specs of a transformer block at layer
    `index` (depth k's block is layer num_layers + k, as DeepSeek's checkpoints number it)."""
    d = cfg.dim
    return {str(k): {
        "enorm": spec.ones((d,), ("embed",)),
        "hnorm": spec.ones((d,), ("embed",)),
        "eh_proj": spec.normal((d, 2 * d), ("embed", "embed"), cfg.init_std),
        "block": block_params(cfg.num_layers + k),
        "norm": spec.ones((d,), ("embed",)),
    } for k in range(cfg.mtp_depth)}


def tied_sources(cfg) -> dict[str, str]:
    return {**TIED, "output": "embed.weight"} if cfg.tie_embeddings else dict(TIED)


def mtp_forward(p: dict, x: torch.Tensor, aux: Any, ctx: ModelContext, *, cfg,
                block_forward: Callable[..., torch.Tensor]) -> torch.Tensor:
    """The MTP term of the loss (the module docstring) from x [batch, seq, embed], the last block's
    output. `block_forward(p, x, aux, ctx, index=...)` runs one block."""
    targets = aux.mtp_targets
    h = rms_norm(x, p["final_norm"], cfg.norm_eps)
    total = None
    for k in range(cfg.mtp_depth):
        module = p[str(k)]
        tokens = ctx.constrain(targets[..., k, 0], ("batch", "seq"), "input")
        embedded = ctx.constrain(ctx.embedding(tokens, p["embedding"]), RESIDUAL, "residual")
        joined = torch.cat([rms_norm(embedded, module["enorm"], cfg.norm_eps),
                            rms_norm(h, module["hnorm"], cfg.norm_eps)], dim=-1)
        joined = ctx.constrain(joined, RESIDUAL, "block_input")
        h = ctx.constrain(ctx.linear(joined, module["eh_proj"]), RESIDUAL, "residual")
        h = block_forward(module["block"], h, aux, ctx, index=cfg.num_layers + k)
        h = ctx.constrain(rms_norm(h, module["norm"], cfg.norm_eps), RESIDUAL, "block_input")
        labels = targets[..., k, 1]
        loss = ctx.output_cross_entropy_sum(h, p["output"], labels)
        stats = getattr(aux, "mtp_stats", None)
        if stats is not None:
            _record(stats, k, loss, (labels != -100).sum())
        total = loss if total is None else total + loss
    weighted = cfg.mtp_loss_weight / cfg.mtp_depth * total
    return weighted - weighted.detach()


class MTPStats:
    """Each depth's summed loss and label count over the micro-batches of a step (detached).
    Hang one on `aux` as `mtp_stats`; a trainer sums `tensors()` over the ranks holding other
    tokens in place before reading them, and `take()`s them after each step."""

    def __init__(self) -> None:
        self.totals: dict[int, torch.Tensor] = {}  # depth index -> [loss sum, labels]

    def record(self, depth: int, loss_sum: torch.Tensor, count: torch.Tensor) -> None:
        value = torch.stack([loss_sum.detach().float(), count.float()])
        if depth in self.totals:
            self.totals[depth] += value
        else:
            self.totals[depth] = value

    def tensors(self) -> list[torch.Tensor]:
        return list(self.totals.values())

    def reset(self) -> None:
        self.totals.clear()

    def fresh(self) -> MTPStats:
        return MTPStats()

    def absorb(self, other: MTPStats) -> None:
        for depth, value in other.totals.items():
            self.totals[depth] = self.totals[depth] + value if depth in self.totals else value

    def take(self) -> MTPStats:
        taken = MTPStats()
        taken.totals, self.totals = self.totals, {}
        return taken


@torch.compiler.disable
def _record(stats: MTPStats, depth: int, loss_sum: torch.Tensor, count: torch.Tensor) -> None:
    """Outside compiled graphs, and not again when activation recompute re-runs the forward
    (as the router statistics, models/moe.py)."""
    if torch._C._current_graph_task_id() == -1:
        stats.record(depth, loss_sum, count)
