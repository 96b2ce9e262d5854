"""The mixture-of-experts feed-forward as a pure function, and the router statistics around it.

    route -> losses -> permute (sort token slots by expert) -> ctx.experts -> un-permute, combine

`ctx.experts` is the only step that depends on where the experts live: on one device it is a
grouped GEMM, under expert parallelism an all-to-all of the sorted rows to the ranks that hold
their experts and back. Everything before and after it is here and the same on every mesh. A
context that exchanges whole tokens instead (expert parallelism by all-gather, which sends each
token once rather than top_k times) takes the routed tokens through `ctx.experts_on_tokens`,
which then permutes and combines on its own.

Router losses reach the gradient without changing any layer's signature: `AddAuxiliaryLoss`
passes the MoE output through unchanged and, in backward, also seeds the losses' gradient
(DeepSeek's reference code does the same). Their values, and how many tokens each expert got,
go to a `RouterStats` that the caller may hang on the shared `aux` object.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from models import spec
from models.config import MoEConfig
from models.context import ExpertBiases, ModelContext
from models.layers import swiglu_block


class Routing(NamedTuple):
    """Each token's top-k choice. T tokens, E experts, k = top_k."""

    expert_ids: torch.Tensor  # [T, k] long, the chosen experts
    weights: torch.Tensor     # [T, k] fp32, what each chosen expert's output is multiplied by
    scores: torch.Tensor      # [T, E] fp32, softmax or sigmoid of the logits (no selection bias)
    logits: torch.Tensor      # [T, E] fp32


class Dispatch(NamedTuple):
    """Every token slot (token t's j-th choice is slot t * k + j) in the order the experts take them:
    the kept slots sorted by expert id, then (with a capacity) the dropped ones. Static shapes: no
    count is read on the host."""

    slots: torch.Tensor       # [T * k] long, a permutation of the slots: the kept first, by expert
    counts: torch.Tensor      # [E] long, kept slots per expert (their sum: how many lead `slots`)
    num_dropped: torch.Tensor  # [] long, slots over capacity


def route(x_TD: torch.Tensor, router: torch.Tensor, cfg: MoEConfig,
          selection_bias: torch.Tensor | None = None, logit_bias: torch.Tensor | None = None) -> Routing:
    """Scores every expert for every token and keeps the top k (from the token's best groups, with
    group-limited routing).

    The router runs in fp32: small differences in bf16 logits flip the top-k choice. The
    selection bias (auxiliary-loss-free balancing) only changes which experts are chosen; the
    weights are the unbiased scores of the chosen experts (renormalised with route_norm), times
    routed_scaling_factor. `logit_bias` (gpt-oss's trainable router bias) is part of the logits.
    """
    logits = F.linear(x_TD.float(), router.float(), None if logit_bias is None else logit_bias.float())
    scores = logits.softmax(-1) if cfg.score_func == "softmax" else logits.sigmoid()
    if cfg.force_load_balance:
        slot = torch.arange(x_TD.shape[0] * cfg.top_k, device=x_TD.device)
        expert_ids = (slot % cfg.num_experts).view(-1, cfg.top_k)
    else:
        choice = scores if selection_bias is None else scores + selection_bias.float()
        if cfg.num_expert_groups > 1:
            choice = within_top_groups(choice, cfg)
        expert_ids = choice.topk(cfg.top_k, dim=-1).indices
    weights = scores.gather(-1, expert_ids)
    if cfg.route_norm:
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return Routing(expert_ids, weights, scores, logits)


def within_top_groups(choice_TE: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    """The choice scores with every expert outside the token's topk_groups best groups at -inf.
    A group scores the sum of its two best choice scores under sigmoid routing (DeepSeek-V3), its
    best under softmax (DeepSeek-V2); experts are grouped in order, num_experts / groups each."""
    num_tokens, groups = choice_TE.shape[0], cfg.num_expert_groups
    grouped = choice_TE.view(num_tokens, groups, -1)
    if cfg.score_func == "sigmoid":
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
    else:
        group_scores = grouped.amax(-1)
    top_groups = group_scores.topk(cfg.topk_groups, dim=-1).indices
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top_groups, True)
    return grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).view_as(choice_TE)


def load_balancing_loss(routing: Routing, load: torch.Tensor, score_func: str) -> torch.Tensor:
    """Switch/GShard: num_experts * sum_e f_e * P_e, f_e the fraction of slots routed to e, P_e the
    mean router probability of e. Equals 1 when both are uniform; only P carries a gradient."""
    num_experts = routing.scores.shape[1]
    probs = routing.scores
    if score_func == "sigmoid":
        # Sigmoid scores are not a distribution; normalise per token as DeepSeek-V3 does.
        probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-20)
    # `load` may count the slots of the whole sample when its tokens are split over ranks.
    fraction = load.float() / load.sum().clamp_min(1)
    return num_experts * (fraction * probs.mean(0)).sum()


def router_z_loss(routing: Routing) -> torch.Tensor:
    """ST-MoE: mean of logsumexp(logits)^2, which keeps the logits small and the softmax stable."""
    return torch.logsumexp(routing.logits, dim=-1).square().mean()


def expert_capacity(cfg: MoEConfig, num_tokens: int) -> int | None:
    if cfg.capacity_factor is None:
        return None
    return math.ceil(cfg.capacity_factor * num_tokens * cfg.top_k / cfg.num_experts)


def expert_load(routing: Routing, num_experts: int) -> torch.Tensor:
    """[E] long: the slots the router chose for each expert, before any drop."""
    expert_of_slot = routing.expert_ids.flatten()
    # A scatter-add rather than bincount, whose output size depends on the data: torch.compile
    # then keeps the routing in the block's graph.
    return torch.zeros(num_experts, dtype=torch.long, device=expert_of_slot.device).scatter_add_(
        0, expert_of_slot, torch.ones_like(expert_of_slot))


def dispatch(routing: Routing, load: torch.Tensor, capacity: int | None) -> Dispatch:
    """Sorts token slots by expert (`load`: `expert_load` of the routing); with a capacity, each
    expert keeps its highest-scoring slots and the others follow all kept ones."""
    expert_of_slot = routing.expert_ids.flatten()
    if capacity is None:
        slots = torch.argsort(expert_of_slot, stable=True)
        return Dispatch(slots, load, torch.zeros((), dtype=torch.long, device=load.device))
    # Rank slots by score (unnormalised, so comparable across tokens), then stable-sort by
    # expert: within each expert's group the best come first and the tail is what is dropped.
    score_of_slot = routing.scores.gather(-1, routing.expert_ids).flatten()
    by_score = torch.argsort(score_of_slot, descending=True, stable=True)
    by_expert = by_score[torch.argsort(expert_of_slot[by_score], stable=True)]
    expert = expert_of_slot[by_expert]
    rank_in_group = torch.arange(by_expert.numel(), device=by_expert.device) - (torch.cumsum(load, 0) - load)[expert]
    counts = load.clamp(max=capacity)
    dropped = rank_in_group >= capacity
    # Each slot's place: a kept one among its expert's kept slots, a dropped one after all kept
    # ones (in expert order). Computed on the device, so the number kept is never read.
    kept_start = torch.cumsum(counts, 0) - counts
    place = torch.where(dropped, counts.sum() + torch.cumsum(dropped, 0) - 1, kept_start[expert] + rank_in_group)
    slots = torch.empty_like(by_expert).scatter_(0, place, by_expert)
    return Dispatch(slots, counts, load.sum() - counts.sum())


def combine(expert_out_SD: torch.Tensor, weights_TK: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Weights each expert output by its token's routing weight and sums each token's k outputs;
    `expert_out_SD` holds slot `slots[i]`'s output in row i (`slots` a permutation of all T * k
    slots, as `dispatch` gives them; rows of dropped slots must be zero).

    Each slot's row is gathered back to slot order and the k of a token summed in order, rather
    than added with index_add: the sum is in a fixed order, so results do not vary from run to
    run on GPU. Products and sum in fp32, as the weights are.
    """
    num_tokens, top_k = weights_TK.shape
    row_of_slot = torch.empty_like(slots).scatter_(0, slots, torch.arange(slots.numel(), device=slots.device))
    weighted = expert_out_SD[row_of_slot].float() * weights_TK.flatten()[:, None]
    return weighted.view(num_tokens, top_k, -1).sum(1).to(expert_out_SD.dtype)


class AddAuxiliaryLoss(torch.autograd.Function):
    """Returns `x` unchanged; backward also gives `loss` the gradient 1, so that d(loss)/d(params)
    is added to the parameters' gradients as if `loss` had been added to the model's loss."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        return x

    @staticmethod
    def backward(ctx, grad_x: torch.Tensor):
        return grad_x, torch.ones(ctx.loss_shape, dtype=ctx.loss_dtype, device=grad_x.device)


class RouterStats:
    """Router statistics accumulated over the micro-batches of a step, per MoE layer (detached).

    Hang one on the `aux` object as `router_stats`. Values are this process's; a trainer that
    wants global numbers (it should, for the bias update) sums `tensors()` over the data-parallel
    ranks in place before reading them. `reset()` after each step.
    """

    def __init__(self) -> None:
        self.load: dict[int, torch.Tensor] = {}    # layer -> [E] slots chosen per expert
        self.totals: dict[int, torch.Tensor] = {}  # layer -> [slots, dropped, aux sum, z sum, records]

    def record(self, layer: int, load: torch.Tensor, num_dropped: torch.Tensor, aux_loss: torch.Tensor,
               z_loss: torch.Tensor) -> None:
        """`load` as `expert_load` gives it, `num_dropped` as in `Dispatch`."""
        totals = torch.stack([
            load.sum().float(), num_dropped.float(), aux_loss.detach().float(), z_loss.detach().float(),
            torch.ones((), device=aux_loss.device),
        ])
        load = load.detach().float()
        if layer in self.load:
            self.load[layer] += load
            self.totals[layer] += totals
        else:
            self.load[layer], self.totals[layer] = load, totals

    def tensors(self) -> list[torch.Tensor]:
        """Every accumulator, for an in-place sum over ranks (e.g. `dist.all_reduce`)."""
        return [*self.load.values(), *self.totals.values()]

    def reset(self) -> None:
        self.load.clear()
        self.totals.clear()

    def fresh(self) -> RouterStats:
        """An empty sink of the same kind (for statistics that may or may not count, `absorb`)."""
        return RouterStats()

    def absorb(self, other: RouterStats) -> None:
        """Adds another sink's statistics to these."""
        for layer in other.load:
            if layer in self.load:
                self.load[layer] += other.load[layer]
                self.totals[layer] += other.totals[layer]
            else:
                self.load[layer], self.totals[layer] = other.load[layer], other.totals[layer]

    def take(self) -> RouterStats:
        """This step's statistics in a new object, to read later; this one starts the next step empty."""
        taken = RouterStats()
        taken.load, taken.totals = self.load, self.totals
        self.load, self.totals = {}, {}
        return taken


@torch.compiler.disable
def _record_router_stats(stats: RouterStats, layer: int, load: torch.Tensor, num_dropped: torch.Tensor,
                         aux_loss: torch.Tensor, z_loss: torch.Tensor) -> None:
    """Outside compiled graphs: the accumulators are a dict that grows layer by layer, which a
    compiled graph would guard on and recompile for at every layer."""
    # Activation recompute re-runs the forward inside backward: its routing must not count twice.
    if torch._C._current_graph_task_id() == -1:
        stats.record(layer, load, num_dropped, aux_loss, z_loss)


def moe_forward(p: dict, x: torch.Tensor, cfg: MoEConfig, ctx: ModelContext, *, layer: int = 0,
                aux: Any = None) -> torch.Tensor:
    """The MoE feed-forward of [batch, seq, embed] activations, same shape out.

    `aux` may carry `router_stats` (a RouterStats) and `loss_scale`, the factor the caller
    multiplies the model's summed loss by before backward. The router losses are per-token means;
    they are weighted by the number of tokens here so that they join the summed loss like the
    cross-entropy does, and by `loss_scale` so that they are scaled with it.
    """
    x_TD = x.reshape(-1, x.shape[-1])
    num_tokens = x_TD.shape[0]
    routing = route(x_TD, p["router"], cfg, p.get("router_bias"), p.get("router_logit_bias"))
    load = expert_load(routing, cfg.num_experts)
    aux_loss = load_balancing_loss(routing, ctx.sum_over_token_shards(load), cfg.score_func)
    z_loss = router_z_loss(routing)

    experts = p["experts"]
    expert_weights = experts["w_gate"], experts["w_up"], experts["w_down"]
    variant = {"biases": ExpertBiases(experts["b_gate"], experts["b_up"], experts["b_down"]) if "b_gate" in experts
               else None, "glu": cfg.expert_glu}
    capacity = expert_capacity(cfg, num_tokens)
    out_TD = None
    num_dropped = torch.zeros((), dtype=torch.long, device=load.device)
    tokens_in, output_weights = x_TD, routing.weights
    if cfg.scale_expert_inputs:
        # The weight scales what each expert sees, and the outputs are summed unweighted. With one
        # expert a token, the scaled token is that expert's row, whichever way rows travel.
        output_weights = torch.ones_like(routing.weights)
        tokens_in = x_TD * routing.weights.to(x_TD.dtype) if cfg.top_k == 1 else None
    if capacity is None and tokens_in is not None:
        out_TD = ctx.experts_on_tokens(tokens_in, routing.expert_ids, output_weights, *expert_weights, **variant)
    if out_TD is None:  # the rows of each expert, sorted by expert
        dispatched = dispatch(routing, load, capacity)
        rows = x_TD[dispatched.slots // cfg.top_k]
        if cfg.scale_expert_inputs:
            rows = rows * routing.weights.flatten()[dispatched.slots, None].to(rows.dtype)
        if capacity is not None:
            # The dropped slots' rows follow the kept ones: zero in, and zero out whatever the
            # experts leave past the rows they count (neither values nor gradients leak).
            kept = (torch.arange(rows.shape[0], device=rows.device) < dispatched.counts.sum())[:, None]
            rows = torch.where(kept, rows, 0)
        expert_out_SD = ctx.experts(rows, dispatched.counts, *expert_weights, **variant)
        if capacity is not None:
            expert_out_SD = torch.where(kept, expert_out_SD, 0)
        out_TD = combine(expert_out_SD, output_weights, dispatched.slots)
        num_dropped = dispatched.num_dropped
    if "shared" in p:
        out_TD = out_TD + swiglu_block(p["shared"], x_TD, ctx)

    stats = getattr(aux, "router_stats", None)
    if stats is not None:
        _record_router_stats(stats, layer, load, num_dropped, aux_loss, z_loss)
    router_loss = cfg.aux_loss_coef * aux_loss + cfg.z_loss_coef * z_loss
    if router_loss.requires_grad and (cfg.aux_loss_coef or cfg.z_loss_coef):
        weight = num_tokens * getattr(aux, "loss_scale", 1.0)
        out_TD = AddAuxiliaryLoss.apply(out_TD, weight * router_loss)
    return out_TD.view_as(x)


def moe_params(cfg: MoEConfig, std: float, out_std: float) -> dict[str, Any]:
    """Parameter specs of one MoE feed-forward."""
    e, f, d = cfg.num_experts, cfg.expert_ffn_dim, cfg.dim
    params: dict[str, Any] = {
        # Small ([E, embed]) and needed whole by every rank: its own "router" axis, which the
        # plan leaves unsplit (unlike "expert", which expert parallelism splits).
        "router": spec.normal((e, d), ("router", "embed"), std),
        "experts": {
            # "expert_mlp", not "mlp": experts are split whole over ep, not column/row over tp.
            "w_gate": spec.normal((e, f, d), ("expert", "expert_mlp", "embed"), std),
            "w_up": spec.normal((e, f, d), ("expert", "expert_mlp", "embed"), std),
            "w_down": spec.normal((e, d, f), ("expert", "embed", "expert_mlp"), out_std),
        },
    }
    if cfg.expert_bias:
        params["experts"].update(b_gate=spec.zeros((e, f), ("expert", "expert_mlp")),
                                 b_up=spec.zeros((e, f), ("expert", "expert_mlp")),
                                 b_down=spec.zeros((e, d), ("expert", "embed")))
    if cfg.router_logit_bias:
        params["router_logit_bias"] = spec.ParamSpec((e,), ("router",), "normal", std, weight_decay=False)
    if cfg.has_selection_bias:
        # Zeros (a normal of std 0). It gets no gradient: it only moves the top-k choice, and
        # `update_expert_bias` changes it after each optimizer step.
        params["router_bias"] = spec.ParamSpec((e,), ("router",), "normal", 0.0, weight_decay=False,
                                               trainable=False)
    if cfg.num_shared_experts:
        width = cfg.num_shared_experts * f
        params["shared"] = {
            "w_gate": spec.normal((width, d), ("mlp", "embed"), std),
            "w_up": spec.normal((width, d), ("mlp", "embed"), std),
            "w_down": spec.normal((d, width), ("embed", "mlp"), out_std),
        }
    return params


def update_expert_bias(params: dict[str, Any], stats: RouterStats, rate: float, add_=torch.Tensor.add_,
                       block_path=lambda layer: f"blocks.{layer}") -> None:
    """Auxiliary-loss-free balancing (DeepSeek-V3), after the optimizer step: each MoE layer's
    `router_bias` moves by `rate` towards balance, down for experts above the mean load and up
    for those below. `params` is the model's tree (nested, or flat with dotted names such as
    `blocks.3.moe.router_bias`), or the part of it one pipeline stage holds (layers it lacks are
    left out); `block_path(layer)` says where a layer's block is. `stats` should already be summed
    over the data-parallel ranks. `add_(bias, delta)` applies a full-shaped delta (the parallel
    backend passes one for shards)."""
    if any("." in key for key in params):
        params = spec.unflatten(params)
    with torch.no_grad():
        for layer, load in stats.load.items():
            node = params
            for key in (*block_path(layer).split("."), "moe", "router_bias"):
                node = node.get(key) if isinstance(node, dict) else None
            if node is not None:
                add_(node, (rate * torch.sign(load.mean() - load)).to(node.device, node.dtype))
