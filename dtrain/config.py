"""The run configuration: small frozen groups, one source of defaults, loadable from TOML and
overridable from the command line (every field is a flag: `lr` -> `--lr`)."""

import argparse
import json
import sys
import tomllib
from pathlib import Path
from typing import Any

import attrs

from dtrain import command_line
from models.errors import UserError


def _field(default: Any, help: str, choices: tuple | None = None, const: Any = None):
    # `const`: the value of the flag given without one (`--resume` alone means "latest").
    return attrs.field(default=default, metadata={"help": help, "choices": choices, "const": const})


@attrs.frozen
class ModelArgs:
    model: str = _field("tiny", "model preset (see models/presets.py)")
    model_overrides: str = _field("", "changes to the preset's shape, e.g. num_layers=2,vocab_size=1000")


@attrs.frozen
class ParallelArgs:
    mesh: str = _field("", "mesh sizes, e.g. tp=8,pp=8,cp=2; dp_shard (alias dp) takes the ranks left; 'auto': the "
                           "planner's best mesh, micro-batch, recompute and offload for the world size (python -m "
                           "dtrain.planner shows the candidates)")
    sequence_parallel: bool = _field(False, "split norms and residuals over tp along the sequence")
    tp_overlap: str = _field("auto", "under --sequence-parallel, fuse each all-gather (reduce-scatter) with the "
                                     "matmul that consumes (produces) it: symm_mem (torch's symmetric-memory "
                                     "ops, CUDA), chunked (the sequence cut into tp chunks whose collectives "
                                     "overlap the previous chunk's matmul), none (separate collectives); auto: "
                                     "none on CUDA, chunked elsewhere",
                             choices=("auto", "symm_mem", "chunked", "none"))
    async_tp: bool = _field(False, "let inductor fuse tp all-gathers/reduce-scatters with matmuls (needs --compile, "
                                   "--sequence-parallel and CUDA; --tp-overlap does this without inductor)")
    cp_comm: str = _field("allgather", "context-parallel attention: all-gather K/V, a ring of K/V "
                          "blocks, or all-to-all to head shards (Ulysses)", choices=("allgather", "ring", "a2a"))
    ep_dispatch: str = _field("auto", "how ep sends tokens to their experts: an all-to-all of uneven splits "
                              "(reads the split sizes on the host every layer), or all-gather + reduce-scatter "
                              "of whole tokens (ep / top_k times the bytes, static shapes, no host sync; dropless "
                              "routing only); auto: allgather where ep <= top_k and routing is dropless",
                              choices=("auto", "alltoall", "allgather"))
    dp_mode: str = _field(
        "fsdp", "what data parallelism over dp_shard x cp shards: fsdp (parameters, gradients and optimizer "
                "state, each unit's parameters gathered for its compute), or zero1 (Megatron's distributed "
                "optimizer: the parameters are all-gathered once per step and stay whole through it, the gradients "
                "are summed whole over the micro-batches and reduce-scattered once, the optimizer state and fp32 "
                "master weights stay sharded); zero1 is --fsdp-reshard-after-forward never with --fsdp-reduce-once",
        choices=("fsdp", "zero1"))
    fsdp_reshard_after_forward: str = _field(
        "default", "free each block's gathered parameters after its forward (always), keep them until its "
                   "backward (never: more memory, no backward all-gather), or default: never where the memory "
                   "model fits it on the GPU, else always except the last block, and never under pipelining",
        choices=("default", "always", "never"))
    fsdp_reduce_once: bool = _field(
        False, "reduce-scatter the gradients once per step, after the last micro-batch, not after each, and keep "
               "the parameters a backward gathered for the next micro-batch: whole gradients and parameters stay "
               "between micro-batches (more memory, fewer collectives); pipelined runs always reduce once, and so do "
               "FSDP units with one shard (one GPU, tp alone, experts held by one rank), where it costs no memory")
    pp_schedule: str = _field("1f1b", "pipeline schedule",
                              choices=("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zb", "zbv"))
    pp_virtual_stages: int = _field(1, "pipeline stages per rank (interleaved and V schedules)")
    pp_layout: str = _field("", "blocks per pipeline stage, e.g. 3,5,5,3 (default: balanced by cost)")
    cpu_offload: bool = _field(False, "FSDP2's CPU offload: parameters, gradients and optimizer state live in host "
                                      "memory, each block's parameters are copied in for its forward and backward, "
                                      "and the optimizer steps on the CPU")
    gpu_memory_gb: float = _field(0.0, "--mesh auto and out-of-memory reports: usable memory per GPU in GB (0: what "
                                       "the GPU reports, 80 without one)")
    print_plan: bool = _field(False, "print the run's layout (every parameter's placements and local shape, the "
                                     "pipeline stages, kernels, FP8, recompute, FSDP units) and the memory per rank, "
                                     "then exit")
    json: bool = _field(False, "with --print-plan: print the layout as one JSON object instead")
    dry_run: bool = _field(False, "run one training step of each distinct rank's program on fake tensors over a fake "
                                  "process group of --world-size ranks, in this one process; print each rank's "
                                  "parameter and optimizer bytes, collectives and peak memory, then exit")
    dry_run_rank: int | None = _field(None, "with --dry-run: only this rank")
    world_size: int | None = _field(None, "the number of ranks --dry-run and --print-plan plan for (default: "
                                          "torchrun's, else the product of the --mesh sizes)")


@attrs.frozen
class DataArgs:
    data: str = _field("bundled", "'bundled' (the corpus shipped with dtrain), 'synthetic', a text file, a "
                                  "Megatron indexed PREFIX (PREFIX.bin/.idx), or a blend '0.7 PREFIX_A 0.3 PREFIX_B'")
    tokenizer: str | None = _field(None, "a local Hugging Face tokenizer.json (default: the bundled one)")
    seq_len: int = _field(256, "tokens per sample")
    micro_batch: int | None = _field(None, "samples per micro-batch on each data-parallel rank (default: the largest "
                                           "that fits the GPU by the memory model, up to 32,768 tokens; 4 without "
                                           "a GPU or --gpu-memory-gb)")
    global_batch: int | None = _field(None, "samples per optimizer step over all data-parallel ranks "
                                            "(default: one micro-batch per data-parallel rank)")
    split: str = _field("969,30,1", "indexed data (--data PREFIX or \"0.7 PREFIX_A 0.3 PREFIX_B\"): "
                                    "train,validation,test shares of each dataset's documents")
    data_cache_dir: str | None = _field(None, "where indexed data's sample indices and a text file's tokens are "
                                              "cached; unset: a dtrain_index_cache directory beside the data")
    reset_position_ids: bool = _field(False, "position ids restart at 0 at each document boundary in a sample")
    document_mask: bool = _field(False, "attention stays within each document of a sample (packed documents)")
    synthetic_document_length: int = _field(0, "--data synthetic: pack documents of random lengths with this mean "
                                               "into each sample (0: one document per sample)")


@attrs.frozen
class OptimArgs:
    lr: float = _field(3e-3, "peak learning rate")
    min_lr_ratio: float = _field(0.1, "final learning rate as a fraction of --lr")
    warmup_steps: int = _field(20, "linear warm-up steps")
    decay: str = _field("cosine", "decay after warm-up", choices=("cosine", "linear", "constant", "wsd"))
    decay_fraction: float = _field(0.2, "wsd: fraction of the steps after warm-up spent decaying")
    weight_decay: float = _field(0.1, "AdamW weight decay (not applied to norms and embeddings)")
    beta1: float = _field(0.9, "AdamW beta1")
    beta2: float = _field(0.95, "AdamW beta2")
    eps: float = _field(1e-8, "AdamW epsilon")
    grad_clip: float = _field(1.0, "global gradient-norm clipping threshold (0 disables)")


@attrs.frozen
class TrainArgs:
    steps: int = _field(200, "optimizer steps")
    seed: int = _field(0, "seed of initialisation and data order")
    precision: str = _field("bf16", "compute precision (master weights and gradient reduction are fp32)",
                            choices=("bf16", "fp32"))
    fp8: str | None = _field(None, "FP8 matmuls in the blocks: torchao's recipes (on CPUs and pre-Hopper GPUs "
                                   "the casts are emulated), or with --fp8-backend te Transformer Engine's delayed or "
                                   "current per-tensor scaling, mxfp8 (Blackwell) or blockwise",
                             choices=("tensorwise", "rowwise", "rowwise_with_gw_hp",
                                      "delayed", "current", "mxfp8", "blockwise"))
    fp8_backend: str = _field("torchao", "FP8 implementation: torchao, or Transformer Engine (te: pip install -e "
                                         "'.[te]' on CUDA machines)", choices=("torchao", "te"))
    fp8_amax_history: int = _field(1024, "--fp8 delayed: steps of amax history whose max sets each scale")
    fp8_keep_ends: bool = _field(False, "keep the first and last blocks in bf16 under --fp8")
    fp8_head: bool = _field(False, "under --fp8, run the output projection in FP8 too (bf16 by default: its "
                                   "logits feed the loss directly)")
    fp8_experts: bool = _field(False, "the routed experts' grouped GEMMs in FP8: torchao's rowwise-scaled grouped "
                                      "GEMMs (no host sync; with or without --fp8 for the other matmuls; emulated "
                                      "where no FP8 kernel runs), or with --fp8-backend te Transformer Engine's "
                                      "(reads each block's row counts on the host); the run says at start whether "
                                      "the planner expects them faster than bf16 at the model's shape")
    fp8_all_gather: bool = _field(True, "under --fp8 tensorwise with FSDP over CUDA GPUs and tp=1, all-gather the "
                                        "FP8 blocks' matmul weights in float8 (half the bytes of bf16)")
    compile: bool = _field(False, "torch.compile each transformer block")
    attention_kernel: str = _field("auto", "kernel of attention within documents or a sliding window on GPUs: "
                                           "auto (variable-length flash attention over whole rows, FlexAttention "
                                           "elsewhere), flex, varlen (where it applies), or a dense mask",
                                   choices=("auto", "flex", "varlen", "dense"))
    fuse_projections: bool = _field(False, "one matmul for q/k/v and one for gate/up where the weights are "
                                           "whole on the rank (tp=1)")
    loss_chunk_tokens: int = _field(0, "compute the output projection and the cross-entropy N tokens at a time "
                                       "(of each rank's micro-batch), with their gradients, so that the logits of "
                                       "all tokens never exist at once (0: all at once); not with --fp8-head")
    recompute: str = _field("none", "activation recompute of blocks", choices=("none", "selective", "full"))
    recompute_layers: int = _field(0, "full recompute of the first N blocks of each pipeline stage (of the model "
                                      "when pp=1), as Megatron's --recompute-num-layers with its block method; the "
                                      "other blocks follow --recompute")
    run_dir: str = _field("runs/default", "directory for the resolved config, TensorBoard files and log")
    overwrite: bool = _field(False, "start a new run in a --run-dir that holds another run's train.log, TensorBoard "
                                    "files or checkpoints, deleting them (without it, or --resume, such a directory "
                                    "is refused)")
    log_every: int = _field(1, "steps between console lines (0: the last step's only)")
    checkpoint_every: int = _field(0, "steps between checkpoints in RUN_DIR/checkpoints (0: only the final one)")
    final_checkpoint: bool = _field(True, "save a checkpoint at the run's last step (--no-final-checkpoint: only "
                                          "the --checkpoint-every ones)")
    keep_last: int = _field(0, "keep only the newest K checkpoints (0: keep all)")
    async_checkpoint: bool = _field(False, "write checkpoints in the background while training goes on")
    resume: str | None = _field(None, "continue from a checkpoint: alone (or latest), the latest valid one in --run-dir, "
                                "which must exist; auto: the same, or step 0 where --run-dir never had a checkpoint "
                                "(for jobs that restart; every checkpoint corrupt still stops the run); or a "
                                "step_NNNNNN or run directory", const="latest")
    start_over: bool = _field(False, "with --resume latest or auto: start at step 0 where --run-dir holds no valid "
                                     "checkpoint, even where its checkpoints were all found corrupt (they stay, "
                                     "set aside as step_N.corrupt); a valid checkpoint is still resumed")
    init_from_hf: str | None = _field(None, "start from the weights of a Hugging Face Llama, Mixtral or DeepSeek-V3 "
                                            "checkpoint directory (config.json + safetensors)")
    init_timeout: float = _field(600.0, "seconds a collective may wait, and a phase may last, while the run starts "
                                        "(building, loading, compiling: the first step included), saves or evaluates")
    step_timeout: float = _field(120.0, "seconds a phase of a step (data, forward, backward, optimizer, sync) may last "
                                        "once steps run before the run names the ranks it waits for and exits; "
                                        "collectives wait 20 s longer (0: no hang detection)")
    straggler_every: int = _field(50, "steps between straggler checks (each rank's forward compute time, logged as "
                                      "perf/straggler_ratio; a rank that stays slow is named) (0: off)")
    max_skipped_steps: int = _field(5, "stop with an error once this many steps in a row had their update skipped "
                                       "(non-finite loss or gradient norm, or a loss spike)")
    skip_spikes: float = _field(0.0, "skip the update of a step whose loss is above K times the median loss of the "
                                     "last --spike-window updated steps (0: off)")
    spike_window: int = _field(32, "--skip-spikes: how many recent steps' losses the median is taken over; spikes "
                                   "are looked for once that many steps were updated")
    eval_every: int = _field(0, "steps between evaluations on the validation split, logged as val/loss (0: off)")
    eval_steps: int = _field(10, "global batches per evaluation (capped at one pass over the validation split)")


@attrs.frozen
class Config:
    model: ModelArgs = ModelArgs()
    parallel: ParallelArgs = ParallelArgs()
    data: DataArgs = DataArgs()
    optim: OptimArgs = OptimArgs()
    train: TrainArgs = TrainArgs()

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return attrs.asdict(self)


GROUPS = {f.name: f.type for f in attrs.fields(Config)}


# Fields that may be left unset take the type of their value on the command line.
_OPTIONAL = {str | None: str, int | None: int}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    parser = command_line.Parser(
        prog="python -m dtrain.run",
        description="Train a language model on any mesh. Every flag can also be set in --config FILE.toml "
                    "under its group ([model], [parallel], [data], [optim], [train]); flags win over the file.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--config", default=None, help="TOML file with [model], [parallel], [data], [optim], [train] tables")
    parser.add_argument("--list-models", action=command_line.ListModels)
    sections = {name: parser.add_argument_group(name) for name in command_line.SECTIONS}
    for flag, (metavar, help) in command_line.LAUNCH_FLAGS.items():
        sections[command_line.LAUNCH_SECTION].add_argument(flag, metavar=metavar, type=int, help=help,
                                                           default=argparse.SUPPRESS)
    for group_name, group_cls in GROUPS.items():
        for field in attrs.fields(group_cls):
            # The default shown by --help; load_config parses with SUPPRESS so that only the flags
            # given override the TOML file, and the attrs class stays the one source of defaults.
            kwargs: dict[str, Any] = dict(dest=f"{group_name}.{field.name}", help=field.metadata["help"],
                                          default=field.default)
            if field.type is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = _OPTIONAL.get(field.type, field.type)
                kwargs["choices"] = field.metadata["choices"]
                kwargs["metavar"] = field.name.upper()
                if field.metadata.get("const") is not None:
                    kwargs.update(nargs="?", const=field.metadata["const"])
            sections[command_line.section_of(group_name, field.name)].add_argument(_flag(field.name), **kwargs)
    return parser


def load_config(argv: list[str] | None = None) -> Config:
    """Defaults, then the TOML file of --config, then the flags given."""
    argv = sys.argv[1:] if argv is None else argv
    if command_line.wants_help(argv):
        build_parser().parse_args([next(a for a in argv if command_line.wants_help([a]))])  # prints, exits
    parser = build_parser()
    for action in parser._actions:
        if action.dest.count(".") == 1:
            action.default = argparse.SUPPRESS
    args = vars(parser.parse_args(argv))
    for flag in command_line.LAUNCH_FLAGS:
        args.pop(flag[2:].replace("-", "_"), None)  # how the ranks start, not how they train
    values: dict[str, dict[str, Any]] = {name: {} for name in GROUPS}
    config_path = args.pop("config", None)
    if config_path:
        path = Path(config_path)
        if not path.is_file():
            raise UserError(f"--config {config_path}: no such file")
        try:
            loaded = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as error:
            raise UserError(f"--config {config_path} is not valid TOML: {error}") from None
        for group_name, table in loaded.items():
            if group_name not in GROUPS or not isinstance(table, dict):
                raise UserError(f"--config {config_path}: unknown table [{group_name}]; use {', '.join(GROUPS)}")
            known = {f.name for f in attrs.fields(GROUPS[group_name])}
            unknown = set(table) - known
            if unknown:
                raise UserError(f"--config {config_path}: unknown keys {sorted(unknown)} in [{group_name}]")
            for key, value in table.items():
                _check_type(GROUPS[group_name], key, value, config_path)
            values[group_name].update(table)
    for dest, value in args.items():
        group_name, name = dest.split(".")
        values[group_name][name] = value
    return Config(**{name: GROUPS[name](**group_values) for name, group_values in values.items()})


def _check_type(group_cls: type, key: str, value: Any, source: str) -> None:
    field = attrs.fields_dict(group_cls)[key]
    expected = {str | None: (str,), int | None: (int,), float: (int, float)}.get(field.type, (field.type,))
    if isinstance(value, bool) and field.type is not bool or not isinstance(value, expected):
        raise UserError(f"--config {source}: {key} = {value!r} should be of type {field.type.__name__ if isinstance(field.type, type) else 'str'}")


def to_toml(config: Config) -> str:
    lines = []
    for group_name, table in config.to_dict().items():
        lines.append(f"[{group_name}]")
        for key, value in table.items():
            if value is None:
                continue
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, str):
                text = json.dumps(value)  # JSON string escapes are valid TOML basic-string escapes
            else:
                text = repr(value)
            lines.append(f"{key} = {text}")
        lines.append("")
    return "\n".join(lines)
