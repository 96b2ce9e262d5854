"""The chunked output projection and cross-entropy (--loss-chunk-tokens): loss and gradients equal
to the unfused path's (fp32, 1e-6 relative) for chunks that divide the tokens and chunks that do
not, with ignored labels, and through DeepSeek's multi-token prediction; in bf16 about as accurate
as the unfused path; no gradient work where no backward comes; under compile, the head's graph
ending at the chunk loop and each chunk's element-wise part one graph per chunk shape; a head whose
peak memory stays below one micro-batch of fp32 logits; and training losses of one process and of
tp=2 (eager with evaluations, and compiled) equal to the unfused run's."""

from __future__ import annotations

import functools

import attrs
import pytest
import torch

from models import deepseek, linear_cross_entropy, llama, mtp, spec
from models.presets import get_model_config
from tests.launch import TINY_ARGS, run_cli, scalars, train_scalars
from tests.unit.test_linear_cross_entropy import RTOL, _case, _context, _loss_and_gradients, _relative


def test_bf16_is_about_as_accurate_as_the_unfused_path():
    """Against the fp32 result: within 1.3 times the unfused bf16 path's error (measured 0.98-1.10
    over seeds). Chunks of 4 tokens make 19 partial weight gradients, whose sum in bf16 would
    double the error."""
    h, weight, labels = _case(vocab=512, dim=64)
    reference = _loss_and_gradients(h, weight, labels, 0)
    unfused = _loss_and_gradients(h.bfloat16(), weight.bfloat16(), labels, 0)
    chunked = _loss_and_gradients(h.bfloat16(), weight.bfloat16(), labels, 4)
    for i, name in enumerate(("loss", "d h", "d weight")):
        assert chunked[i].dtype == unfused[i].dtype, name
        error, baseline = _relative(chunked[i], reference[i]), _relative(unfused[i], reference[i])
        assert error <= 1.3 * baseline + 1e-7, (name, error, baseline)


def test_whole_model_with_multi_token_prediction_equals_the_unfused():
    """DeepSeek's MTP heads share the output projection: every parameter's gradient and the MTP
    losses, chunked against unfused."""
    cfg = attrs.evolve(get_model_config("tiny-mla"), num_layers=2, first_dense_layers=1)
    values = {f"{layer.name}.{path}": spec.init_value(s, 0, f"{layer.name}.{path}")
              for layer in deepseek.layers(cfg) for path, s in spec.flatten(layer.params)}
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    labels = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))

    def run(chunk):
        params = {path: value.clone().requires_grad_() for path, value in values.items()}
        stats = mtp.MTPStats()
        loss = deepseek.forward(spec.unflatten(params), tokens, labels, cfg, _context(chunk), mtp_stats=stats)
        loss.backward()
        return loss.detach(), stats.totals[0], {path: p.grad for path, p in params.items()}

    (loss, mtp_totals, grads), (loss_0, mtp_totals_0, grads_0) = run(5), run(0)
    assert _relative(loss, loss_0) <= RTOL and _relative(mtp_totals, mtp_totals_0) <= RTOL
    assert grads.keys() == grads_0.keys()
    for path, grad in grads_0.items():
        if grad is not None and grad.any():
            # Through the MTP block and its router: at most 6e-7 here.
            assert _relative(grads[path], grad) <= 2 * RTOL, path


def test_compiled_head_breaks_its_graph_at_the_chunk_loop_and_equals_eager(monkeypatch):
    """Under --compile the head's graph ends where the chunk loop starts (a deliberate break), and
    each chunk's element-wise part is one graph of its own, compiled once per chunk shape: 64
    tokens in chunks of 48 make two."""
    cfg = get_model_config("tiny")
    head = llama.layers(cfg)[-1]
    params = {path: spec.init_value(s, 0, path).requires_grad_() for path, s in spec.flatten(head.params)}
    x = torch.randn(2, 32, cfg.dim, requires_grad=True)
    labels = torch.randint(0, cfg.vocab_size, (2, 32))
    labels[0, :9] = -100
    aux = llama.make_aux(cfg, torch.arange(32), labels)
    graphs = {"head": 0, "chunk": 0}

    def counting(name):
        # Traces forward and backward as inductor's backend would, without generating kernels
        # (seconds instead of a minute on the CI machine).
        def backend(graph_module, example_inputs):
            graphs[name] += 1
            return torch._dynamo.backends.registry.lookup_backend("aot_eager_decomp_partition")(
                graph_module, example_inputs)

        return backend

    def compiled_terms(gradients):
        return torch.compile(functools.partial(linear_cross_entropy.logit_terms, gradients=gradients), dynamic=False,
                             fullgraph=True, backend=counting("chunk"))

    monkeypatch.setattr(linear_cross_entropy, "_compiled", functools.cache(compiled_terms))

    def run(forward, compile_chunks):
        ctx = _context(48)
        ctx.compile_loss_chunks = compile_chunks
        loss = forward(spec.unflatten(params), x, aux, ctx)
        return [loss, *torch.autograd.grad(loss, [x, *params.values()])]

    torch._dynamo.reset()
    compiled = torch.compile(head.forward, backend=counting("head"))
    for actual, expected in zip(run(compiled, True), run(head.forward, False)):
        assert _relative(actual, expected) <= RTOL
    assert graphs == {"head": 1, "chunk": 2}, graphs


def test_one_process_training_equals_the_unfused(tmp_path, single_run):
    """128 tokens per micro-batch in chunks of 48: three chunks, the last of 32."""
    chunked = train_scalars(tmp_path, ["--steps", "4", "--loss-chunk-tokens", "48"])
    for tag in ("train/loss", "train/grad_norm"):
        assert len(chunked[tag]) == 4
        for step, (a, e) in enumerate(zip(chunked[tag], single_run[tag]), 1):
            assert abs(a - e) <= RTOL * abs(e), f"{tag} at step {step}: chunked {a} vs unfused {e}"


# Indexed documents with a validation split: evaluations (the loss without gradients).
DOCUMENTS = ["--steps", "4", "--split", "90,10,0"]


EVALUATIONS = ["--eval-every", "2", "--eval-steps", "1"]


_REFERENCE: dict[str, dict[str, list[float]]] = {}


@pytest.mark.slow
@pytest.mark.timeout(600)  # the compiled case: compilation on two processes
@pytest.mark.parametrize("flags", [EVALUATIONS, ["--compile"]], ids=["eager", "compiled"])
def test_tensor_parallel_training_equals_the_unfused(tmp_path, indexed_corpus, flags):
    """tp=2 with sequence parallelism (the head's input arrives split over the sequence): the
    vocabulary-parallel chunked loss on every step (tests/workers/chunked_loss.py) and evaluation,
    or compiled at most twice per function (without evaluations, whose grad mode compiles the
    blocks once more), the losses those of one process without chunks."""
    if indexed_corpus not in _REFERENCE:
        _REFERENCE[indexed_corpus] = train_scalars(tmp_path / "single", ["--data", indexed_corpus, *DOCUMENTS,
                                                                        *EVALUATIONS])
    reference = _REFERENCE[indexed_corpus]
    args = [*TINY_ARGS, "--run-dir", str(tmp_path / "tp"), "--data", indexed_corpus, *DOCUMENTS, "--mesh", "tp=2",
            "--sequence-parallel", "--loss-chunk-tokens", "48", *flags]
    result = run_cli(args, nproc=2, module="tests.workers.chunked_loss")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    parallel = scalars(tmp_path / "tp")
    tags = ["train/loss", "train/grad_norm", *(["val/loss"] if flags == EVALUATIONS else [])]
    for tag in tags:
        assert len(parallel[tag]) == len(reference[tag]) == (2 if tag == "val/loss" else 4), tag
        for step, (a, e) in enumerate(zip(parallel[tag], reference[tag]), 1):
            # Sums over two ranks in another order: the tolerance of the overlapped-SP test.
            assert abs(a - e) <= 1e-5 * abs(e), f"{tag} at {step}: tp=2 chunked {a} vs one process unfused {e}"
