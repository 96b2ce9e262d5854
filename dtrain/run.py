"""`python -m dtrain.run` (plain, or under torchrun): train, print the sharding plan, or dry-run
every distinct rank of a world of any size."""

from __future__ import annotations

import logging
import os
import sys

from models.errors import UserError


def main(argv: list[str] | None = None) -> int:
    # Console lines from rank 0; other ranks report only warnings and errors.
    level = logging.INFO if int(os.environ.get("RANK", "0")) == 0 else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stdout)
    logging.getLogger("dtrain").setLevel(level)
    from dtrain.config import load_config
    from dtrain.plan.describe import print_plan
    from dtrain.train import train

    try:
        config = load_config(argv)
        if config.parallel.dry_run:
            from dtrain.plan.dry_run import dry_run

            dry_run(config)
        elif config.parallel.print_plan:
            print_plan(config)
        else:
            train(config)
    except UserError as error:
        # A user's mistake: one line that says what to change, no traceback.
        print(f"dtrain: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
