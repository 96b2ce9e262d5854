"""What one rank feeds its model from a micro-batch of full-sequence rows: its tokens (its
load-balanced chunks under cp), labels, multi-token-prediction targets, positions and attention
mask, on its device; and how many query-key pairs attention needs over a step."""

from __future__ import annotations

import attrs
import torch

from dtrain.layout import RunLayout
from models import families, flops, llama, masking, mtp
from parallel import context_parallel


class RankInputs:
    """`base` is the aux every micro-batch starts from: RoPE at this rank's positions, the loss
    scale, and (windows or chunks without documents) the masks of every micro-batch."""

    def __init__(self, layout: RunLayout, cp_rank: int, ctx, device: torch.device):
        data, model_cfg, loss_scale = layout.config.data, layout.model_cfg, layout.loss_scale
        self.data, self.model_cfg, self.ctx, self.device = data, model_cfg, ctx, device
        self.cp, self.cp_rank = layout.mesh.cp, cp_rank
        self.mtp_depth = flops.mtp_depth(model_cfg)
        positions = (context_parallel.load_balance_indices(data.seq_len, self.cp, cp_rank)
                     if self.cp > 1 else torch.arange(data.seq_len))
        self.base = families.make_aux(model_cfg, positions.to(device), loss_scale=loss_scale)
        if not data.document_mask:
            self.base = attrs.evolve(self.base, masks=llama.one_document_masks(model_cfg, ctx, data.micro_batch,
                                                                               data.seq_len))

    def tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of full-sequence rows: its load-balanced chunks when cp > 1."""
        if self.device.type == "cuda" and tokens.device.type == "cpu":
            tokens = tokens.pin_memory()  # a pageable copy would wait for the queued kernels
        tokens = tokens.to(self.device, non_blocking=True)
        if self.cp == 1:
            return tokens
        return context_parallel.shard_sequence(tokens, self.cp, self.cp_rank)

    def pipeline_targets(self, labels: torch.Tensor) -> torch.Tensor:
        """This rank's part of full-sequence labels, packed with the tokens ahead for multi-token
        prediction (made from the whole sequences: under cp they cross this rank's chunks)."""
        return self.tokens(mtp.packed_targets(labels, self.mtp_depth) if self.mtp_depth else labels)

    def aux(self, batch) -> llama.Aux:
        """The micro-batch's labels (and tokens ahead, for multi-token prediction), and its
        per-document positions and attention masks when asked for (this rank's chunks of the
        positions under cp; each mask's forms for its attention)."""
        changes = {"labels": self.tokens(batch[1])}
        if self.mtp_depth:
            changes["mtp_targets"] = self.tokens(mtp.future_targets(batch[1], self.mtp_depth))
        if self.data.reset_position_ids:
            changes["rope"] = families.rope(self.model_cfg, self.tokens(batch.position_ids))
        if self.data.document_mask:
            changes["masks"] = masking.layer_masks(self.model_cfg, self.ctx, batch.document_ids)
        return attrs.evolve(self.base, **changes)

    def attended_pairs(self, micro_batches) -> float:
        """Query-key pairs that attention needs over this rank's rows of a step (the sum over
        documents of their causal attention, windowed or chunked as each layer is), per layer
        (the mean over the layers), for the document-attention MFU."""
        d, cfg = self.data, self.model_cfg
        kinds = [masking.mask_kind(kind) for kind in cfg.layer_kinds]
        if not d.document_mask and set(kinds) == {"full"}:
            return len(micro_batches) * d.micro_batch * d.seq_len * (d.seq_len + 1) // 2
        total = 0
        for batch in micro_batches:
            document_ids = batch.document_ids if d.document_mask else torch.zeros_like(batch[0])
            pairs = {kind: masking.attended_pairs(masking.first_keys(document_ids, **masking.mask_extent(cfg, kind)))
                     for kind in set(kinds)}
            total += sum(pairs[kind] for kind in kinds)
        return total / len(kinds)
