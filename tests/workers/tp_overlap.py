"""Run under torchrun with 2 ranks: `python -m tests.workers.tp_overlap METHOD [BACKEND]` checks
parallel/tensor_parallel.py's fused matmuls and vocab-parallel loss, forward and backward, against
the same math on whole tensors in one process (every rank draws the same global tensors). CPU:
float64 and the chunked method; CUDA: float32 and `chunked` or `symm_mem`. With a torch.compile
BACKEND (`inductor`, or `aot_eager`: traced, not code-generated) each is compiled as one graph.
Under `symm_mem` the profiler must see torch's fused symmetric-memory ops run, forward and backward
(a silent fallback to separate collectives fails). Prints `OK` on rank 0; any mismatch raises."""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel.tensor_parallel import (AllGatherLinear, LinearReduceScatter, TpGroup, VocabParallelCrossEntropySum,
                                      chunk_bounds, enable_symmetric_memory)

method = sys.argv[1]
backend = sys.argv[2] if len(sys.argv) > 2 else None
cuda = torch.cuda.is_available()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
world = dist.group.WORLD
group = TpGroup(world.group_name, world.size(), world.rank())
if method == "symm_mem":
    enable_symmetric_memory(group)
dtype = torch.float32 if cuda else torch.float64
# fp32 GEMMs on GPUs may use TF32; keep them exact enough to compare.
torch.backends.cuda.matmul.allow_tf32 = False
tol = dict(rtol=1e-4, atol=1e-4) if cuda else dict(rtol=1e-10, atol=1e-10)
n, rank = group.size, group.rank


def draw(*shape, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator, dtype=dtype).to(device)


def shard(t, dim):
    return t.chunk(n, dim)[rank]


def maybe_compiled(fn):
    return torch.compile(fn, fullgraph=True, backend=backend) if backend else fn


def check_all_gather_linear(batch, seq, k, outs):
    """q/k/v-like: input split over seq, weights over their output dim; one gather for all."""
    x, weights = draw(batch, seq, k, seed=1), [draw(o, k, seed=2 + i) for i, o in enumerate(outs)]
    upstream = [draw(batch, seq, o, seed=10 + i) for i, o in enumerate(outs)]
    x_ref = x.clone().requires_grad_()
    w_ref = [w.clone().requires_grad_() for w in weights]
    torch.autograd.backward([F.linear(x_ref, w) for w in w_ref], upstream)

    x_shard = shard(x, 1).clone().requires_grad_()
    w_shards = [shard(w, 0).clone().requires_grad_() for w in weights]
    fn = maybe_compiled(lambda x_, *ws: AllGatherLinear.apply(x_, group, method, *ws))
    got = fn(x_shard, *w_shards)
    for out, w in zip(got, weights):
        torch.testing.assert_close(out, F.linear(x, shard(w, 0)), **tol)
    torch.autograd.backward(list(got), [shard(u, 2).contiguous() for u in upstream])
    torch.testing.assert_close(x_shard.grad, shard(x_ref.grad, 1), **tol)
    for w, ref in zip(w_shards, w_ref):
        torch.testing.assert_close(w.grad, shard(ref.grad, 0), **tol)


def check_linear_reduce_scatter(batch, seq, k, out_dim):
    """wo-like: input split over features, weight over its input dim; output split over seq."""
    h, weight, upstream = draw(batch, seq, k, seed=20), draw(out_dim, k, seed=21), draw(batch, seq, out_dim, seed=22)
    h_ref, w_ref = h.clone().requires_grad_(), weight.clone().requires_grad_()
    F.linear(h_ref, w_ref).backward(upstream)

    h_shard = shard(h, 2).clone().requires_grad_()
    w_shard = shard(weight, 1).clone().requires_grad_()
    fn = maybe_compiled(lambda h_, w_: LinearReduceScatter.apply(h_, group, method, w_))
    out = fn(h_shard, w_shard)
    torch.testing.assert_close(out, shard(F.linear(h, weight), 1), **tol)
    # It joins the residual stream, which pipeline stages send: their buffers must be contiguous.
    assert out.is_contiguous(), out.stride()
    out.backward(shard(upstream, 1).contiguous())
    torch.testing.assert_close(h_shard.grad, shard(h_ref.grad, 2), **tol)
    torch.testing.assert_close(w_shard.grad, shard(w_ref.grad, 1), **tol)


def check_vocab_parallel_loss(batch, seq, vocab):
    logits = draw(batch, seq, vocab, seed=30) * 3
    labels = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(31)).to(device)
    labels[0, :3] = -100  # ignored positions
    ref = logits.clone().requires_grad_()
    expected = F.cross_entropy(ref.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=-100)
    expected.backward()
    local = shard(logits, 2).clone().requires_grad_()
    start = rank * -(-vocab // n)
    fn = maybe_compiled(lambda l_: VocabParallelCrossEntropySum.apply(l_, labels, start, group))
    loss = fn(local)
    torch.testing.assert_close(loss, expected.detach(), **tol)
    loss.backward()
    torch.testing.assert_close(local.grad, shard(ref.grad, 2), **tol)


FUSED_OPS = ("symm_mem::fused_all_gather_matmul", "symm_mem::fused_matmul_reduce_scatter")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
    # One sample, several; shards of 5 tokens (chunks of 3 and 2), of 4 (chunks of 2 and 2).
    for batch, seq in ((1, 8), (3, 10)):
        assert len(chunk_bounds(seq // n, n)) == n
        check_all_gather_linear(batch, seq, k=12, outs=[8, 4, 4])
        check_linear_reduce_scatter(batch, seq, k=8, out_dim=12)
ran = {e.name for e in profile.events()}
if method == "symm_mem":
    missing = [op for op in FUSED_OPS if op not in ran]
    assert not missing, f"symm_mem: {missing} never ran; ran {sorted(n for n in ran if '::' in n)[:40]}"
else:
    assert not ran & set(FUSED_OPS), f"{method}: symmetric-memory ops ran"
# A vocabulary of 11 over 2 ranks: shards of 6 and 5 columns.
check_vocab_parallel_loss(batch=2, seq=6, vocab=11)
dist.barrier()
if rank == 0:
    print("OK", flush=True)
dist.destroy_process_group()
