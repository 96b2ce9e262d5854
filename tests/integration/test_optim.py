"""Learning-rate schedules and AdamW weight-decay groups."""

from __future__ import annotations

import torch


def test_fused_optimizer_takes_the_clip_scale_in_its_step():
    """Handing the clip scale to a fused AdamW step equals scaling the gradients first."""
    from parallel.gradients import clip_grads_

    torch.manual_seed(0)
    weights = [torch.randn(16, 8), torch.randn(8)]
    grads = [10 * torch.randn(16, 8), 10 * torch.randn(8)]
    results = []
    for fused in (True, False):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        optimizer = torch.optim.AdamW(params, lr=0.1, fused=fused, foreach=not fused)
        for step in range(2):  # the second update also reads the first one's moments
            for param, grad in zip(params, grads):
                param.grad = grad.clone() * (step + 1)
            norm = clip_grads_(params, 1.0, optimizer=optimizer)
            assert norm.item() > 1.0  # the clip is engaged
            assert (getattr(optimizer, "grad_scale", None) is not None) == fused
            optimizer.step()
        results.append([p.detach() for p in params])
    for fused_value, reference in zip(*results):
        torch.testing.assert_close(fused_value, reference, rtol=1e-6, atol=1e-6)
