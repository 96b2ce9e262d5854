"""`python -m dtrain.run` (plain, or under torchrun): train, or print the sharding plan."""

from __future__ import annotations

import logging
import os
import sys

from models.errors import UserError


def main(argv: list[str] | None = None) -> int:
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
    from dtrain.resilience import failures

    try:
        config = load_config(argv)
        if rank == 0 and not config.parallel.print_plan:
            # Before torch is imported: a restart that is refused costs a second, not a start-up.
            failures.check_start(config.train.run_dir)
        from dtrain.plan.describe import print_plan
        from dtrain.train import train

        if config.parallel.print_plan:
            print_plan(config)
        else:
            train(config)
    except UserError as error:
        # A user's mistake: one line that says what to change, no traceback.
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
