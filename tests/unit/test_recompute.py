"""Activation recompute: every mode trains to the same losses, selective recompute re-runs the
cheap element-wise ops but never a GEMM, a grouped GEMM, a collective or an FP8 amax, and
`--recompute-layers N` fully recomputes exactly N blocks per stage."""

from __future__ import annotations

from collections import Counter

import attrs
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from models.context import grouped_swiglu
from parallel import collectives, recompute


_aten = torch.ops.aten


_ALL_TO_ALL = (torch.ops._c10d_functional.all_to_all_single.default,
               torch.ops._c10d_functional_autograd.all_to_all_single.default)


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def test_selective_recompute_reruns_element_wise_ops_only(one_rank_group):
    if not hasattr(F, "grouped_mm"):
        pytest.skip("this torch has no F.grouped_mm")
    torch.manual_seed(0)
    e, f, d, rows = 3, 16, 8, 10
    counts = torch.tensor([4, 0, 6])

    def block(x, w_in, w_gate, w_up, w_down):
        # A matmul scaled as FP8 scales (tensorwise and rowwise amax), an all-to-all (identity on
        # one rank, as in expert parallelism), the experts' grouped GEMMs.
        h = (x / x.abs().max()) @ w_in
        h = F.silu(h / h.abs().amax(dim=-1, keepdim=True))
        h = collectives.all_to_all(h, None, None, one_rank_group)
        return grouped_swiglu(h, counts, w_gate, w_up, w_down, use_grouped_mm=True)

    inputs = [torch.randn(rows, d), torch.randn(d, d), torch.randn(e, f, d), torch.randn(e, f, d), torch.randn(e, d, f)]
    upstream = torch.randn(rows, d)
    seen, grads = {}, {}
    for mode in recompute.RECOMPUTE_MODES:
        leaves = [t.clone().requires_grad_() for t in inputs]
        with _CountOps() as counter:
            recompute.wrap(block, mode)(*leaves).backward(upstream)
        seen[mode], grads[mode] = counter.counts, [t.grad for t in leaves]

    def calls(mode, *ops):
        return sum(seen[mode][op] for op in ops)

    for mode in ("selective", "full"):
        for a, b in zip(grads[mode], grads["none"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    expensive = [(_aten.mm.default,), (_aten._grouped_mm.default,), _ALL_TO_ALL, (_aten.max.default,),
                 (_aten.amax.default,)]
    for ops in expensive:
        assert calls("none", *ops) > 0, ops
        assert calls("selective", *ops) == calls("none", *ops), ops  # saved, not recomputed
        assert calls("full", *ops) > calls("none", *ops), ops  # full recompute re-runs them
    assert calls("selective", _aten.silu.default) > calls("none", _aten.silu.default)


def test_full_recompute_blocks_are_the_first_n_of_each_stage():
    assert recompute.full_recompute_blocks([1, 3], 2) == {"blocks.0", "blocks.1", "blocks.2"}
    assert recompute.full_recompute_blocks([4], 0) == frozenset()
    assert recompute.full_recompute_blocks([2, 2, 2], 1) == {"blocks.0", "blocks.2", "blocks.4"}


def _mm_calls_and_grads(recompute_args: list[str]):
    """One forward and backward of the tiny model in this process; its matmuls and gradients."""
    from dtrain import rank_model
    from models import families
    from parallel.mesh import build_meshes
    from tests.layouts import resolved

    layout = resolved(["--model", "tiny", "--precision", "fp32", *recompute_args])
    model_cfg = layout.model_cfg
    built = rank_model.build_model_parts(layout, build_meshes(layout.mesh, "cpu"), device=torch.device("cpu"))
    model = built.parts[0]
    tokens = torch.randint(0, model_cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    aux = attrs.evolve(families.make_aux(model_cfg, torch.arange(32)), labels=tokens)
    with _CountOps() as counter, built.ctx.kernel_scope():
        model(tokens, aux).backward()
    grads = {name: p.grad.to_local().clone() for name, p in model.named_parameters()}
    return counter.counts[_aten.mm.default] + counter.counts[_aten.addmm.default], grads, model_cfg.num_layers


def test_recompute_layers_reruns_exactly_the_chosen_blocks(one_rank_group):
    # Loss parity of the lever over several steps is a pipeline case (tests/unit/test_pipeline_parallel.py);
    # here, in one process: the chosen blocks' matmuls run twice and the gradients do not change.
    none, grads_none, num_layers = _mm_calls_and_grads([])
    every, _, _ = _mm_calls_and_grads(["--recompute", "full"])
    two, grads_two, _ = _mm_calls_and_grads(["--recompute-layers", "2"])
    per_block = (every - none) / num_layers  # the forward matmuls of one block, run again
    assert per_block > 0
    assert two - none == 2 * per_block
    for name, grad in grads_two.items():
        torch.testing.assert_close(grad, grads_none[name], rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("mode", recompute.RECOMPUTE_MODES)
def test_a_compiled_block_is_one_graph_in_every_mode(mode):
    """A graph break inside a checkpointed block sends the whole block back to eager (dynamo cannot
    split the checkpoint), and selective recompute's saving with it: each mode compiles in full."""
    from models import families, spec
    from models.context import LocalContext
    from models.presets import get_model_config

    cfg = get_model_config("tiny", "dim=64,num_heads=4,num_kv_heads=1,ffn_dim=128,num_layers=1,vocab_size=64")
    layer = families.layers(cfg)[1]
    params = spec.unflatten({path: spec.init_value(s, 0, path).requires_grad_()
                             for path, s in spec.flatten(layer.params)})
    x = torch.randn(2, 16, cfg.dim, requires_grad=True)
    torch._dynamo.reset()
    forward = torch.compile(recompute.wrap(layer.forward, mode), fullgraph=True, backend="eager")
    forward(params, x, families.make_aux(cfg, torch.arange(16)), LocalContext()).sum().backward()
    assert x.grad is not None
