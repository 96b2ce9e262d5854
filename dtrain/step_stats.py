"""Statistics a step gathers across ranks besides its loss: the MoE routers' (expert loads, the
aux-loss-free bias update) and multi-token prediction's losses."""

from __future__ import annotations

import torch
import torch.distributed as dist

from models import families, flops, moe, mtp
from models.config import LlamaConfig
from parallel.expert_parallel import max_ranks_per_token
from parallel.parallelize import add_full_


class StepStats:
    """`router_stats` and `mtp_stats` are the sinks the model's aux carries (None where the model
    has none). Router statistics are summed over `router_groups` (every rank counts its own
    tokens; pipeline stages hold other layers), MTP losses over `loss_groups`."""

    def __init__(self, model_cfg: LlamaConfig, aux, model_parts, router_groups: list, loss_groups: list,
                 device: torch.device):
        self.model_cfg, self.model_parts, self.device = model_cfg, model_parts, device
        self.router_groups, self.loss_groups = router_groups, loss_groups
        self.router_stats: moe.RouterStats | None = getattr(aux, "router_stats", None)
        self.mtp_stats: mtp.MTPStats | None = getattr(aux, "mtp_stats", None)
        self.mtp_depth = flops.mtp_depth(model_cfg)

    def after_moe_step(self, found_inf: torch.Tensor) -> moe.RouterStats | None:
        """Router statistics summed over the data-parallel ranks (one all-reduce for all layers);
        the aux-loss-free bias update, left out on a skipped step (`found_inf` 1) as the
        optimizer's. Returns the step's statistics, to read back later."""
        if self.router_stats is None:
            return None
        tensors = self.router_stats.tensors()
        if self.router_groups and tensors:
            flat = torch.cat([t.reshape(-1) for t in tensors])
            for group in self.router_groups:
                dist.all_reduce(flat, group=group)
            for tensor, summed in zip(tensors, flat.split([t.numel() for t in tensors])):
                tensor.copy_(summed.view_as(tensor))
        rate = self.model_cfg.bias_update_rate
        if rate > 0:
            skipped = found_inf.bool()

            def add_unless_skipped(bias, delta):
                add_full_(bias, delta.masked_fill(skipped, 0.0))

            for part in self.model_parts:
                moe.update_expert_bias(dict(part.named_parameters()), self.router_stats, rate, add_unless_skipped,
                                       block_path=families.block_path(self.model_cfg))
        return self.router_stats.take()

    def after_mtp_step(self) -> mtp.MTPStats | None:
        """The step's multi-token prediction losses summed over the ranks holding other tokens (and
        from the last pipeline stage), to read back later."""
        if self.mtp_stats is None:
            return None
        taken = self.mtp_stats.take()
        # A fixed shape on every rank: pipeline stages without the MTP layer recorded nothing.
        totals = torch.zeros(self.mtp_depth, 2, device=self.device)
        for index, value in taken.totals.items():
            totals[index] += value
        for group in self.loss_groups:
            dist.all_reduce(totals, group=group)
        taken.totals = dict(enumerate(totals))
        return taken


def ep_line(model_cfg, ep: int, dispatch: str | None) -> str:
    """The start-up line's expert-parallel part: the dispatch and the ranks a token's experts span."""
    if not dispatch:
        return ""
    ranks = max_ranks_per_token(model_cfg.num_experts, ep, model_cfg.top_k, model_cfg.num_expert_groups,
                                model_cfg.topk_groups)
    return f" | ep dispatch {dispatch}, each token's experts on at most {ranks} of {ep} ranks"
