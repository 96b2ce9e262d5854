"""`python -m dtrain.run` (plain, or under torchrun): train, or print the sharding plan."""

from __future__ import annotations

import logging
import os
import sys

from models.errors import UserError


def main(argv: list[str] | None = None) -> int:
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", stream=sys.stdout,
    )
    from dtrain.config import load_config
    from dtrain.train import print_plan, train

    try:
        config = load_config(argv)
        if config.parallel.print_plan:
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
