"""`python -m dtrain.run` (plain, with --nproc-per-node N for the ranks of one machine, or under
torchrun): train, print the sharding plan, or dry-run every distinct rank of a world of any size."""

from __future__ import annotations

import functools
import logging
import os
import sys

from models.errors import UserError


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from dtrain.launch import local

    launched = local.main(argv)  # --nproc-per-node N: this process starts the ranks and watches them
    if launched is not None:
        return launched
    if "TORCHELASTIC_RUN_ID" in os.environ:
        from dtrain.resilience.parent import die_with_parent

        die_with_parent()  # a worker must not outlive its torchrun agent
    # Console lines from rank 0; other ranks report only warnings and errors.
    rank = int(os.environ.get("RANK", "0"))
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stdout)
    logging.getLogger("dtrain").setLevel(level)
    from dtrain.config import load_config
    from dtrain import run_directory
    from dtrain.resilience import failures, run_lock

    claim, training = None, False
    try:
        config = load_config(argv)
        if config.parallel.json:
            _log_to_stderr()  # stdout is the JSON's alone
        planning = config.parallel.print_plan or config.parallel.dry_run
        if rank == 0 and not planning:
            # The run directory's lock before anything touches the directory; a refusal reaches
            # every rank in train(). Before torch is imported: a restart that is refused costs a
            # second, not a start-up.
            claim = run_lock.take(config.train.run_dir, functools.partial(
                run_directory.check, config.train.run_dir, resume=config.train.resume, overwrite=config.train.overwrite))
            if claim.held:
                failures.check_start(config.train.run_dir)
        from dtrain.layout import Machine
        from dtrain.planner.advice import resolve_run

        if not planning:
            _check_launched(config.parallel.mesh)

        # The options checked and decided once, for this machine and world.
        layout = resolve_run(config, _world_size(config, planning), Machine.detect())
        if config.parallel.dry_run:
            from dtrain.inspect.dry_run import dry_run

            dry_run(layout)
        elif config.parallel.print_plan:
            from dtrain.inspect.describe import print_plan

            print_plan(layout)
        else:
            from dtrain.train import train

            training = True
            train(layout, claim=claim)
    except UserError as error:
        # A user's mistake: one line that says what to change, no traceback. A mistake in the
        # options (found before training, alike on every rank) or one the ranks agreed on is
        # said by rank 0 alone; the other ranks exit with the same code, quietly.
        if rank == 0 or (training and not error.every_rank):
            print(f"dtrain: error: {error}", file=sys.stderr)
        return 2
    except failures.JobFailure as error:
        # A failure of the job (a hang, a lost rank, a repeated failure): one line per rank.
        print(f"dtrain: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # A second Ctrl-C (the first saves at the next step boundary), or one during start-up.
        if rank == 0:
            print("dtrain: interrupted: stopped without saving; continue from the latest checkpoint with "
                  "--resume", file=sys.stderr)
        return 130
    finally:
        if claim is not None:
            claim.release()
    return 0


def _log_to_stderr() -> None:
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


def _check_launched(mesh: str) -> None:
    """A mesh of several ranks in one plain process: the user meant --nproc-per-node, or a dry run."""
    from dtrain import distributed
    from dtrain.launch import local
    from parallel.mesh import MeshSpec

    if distributed.launched_by_torchrun() or mesh in ("", "auto"):
        return
    ranks = MeshSpec.parse(mesh, None).world_size
    if ranks > 1:
        raise UserError(f"--mesh {mesh} spans {ranks} ranks but this is one process: start them with "
                        f"{local.command(ranks)} ..., or check the layout on this machine with "
                        f"--dry-run (every rank's memory and collectives) or --print-plan")


def _world_size(config, planning: bool) -> int | None:
    """The ranks of this run: torchrun's; for --dry-run and --print-plan --world-size, else torchrun's,
    else None (the product of the --mesh sizes)."""
    from dtrain import distributed

    if not planning:
        return distributed.world_size_from_env()
    if config.parallel.world_size is not None:
        return config.parallel.world_size
    return distributed.world_size_from_env() if distributed.launched_by_torchrun() else None


if __name__ == "__main__":
    sys.exit(main())
