"""usage: python -m dtrain.launch slurm [OPTIONS] -- TRAIN ARGS   (inside a SLURM allocation)
       python -m dtrain.launch node --log-dir DIR -- COMMAND     (what srun runs on each node)"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("slurm", "node"):
        print(__doc__, file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "slurm":
        from dtrain.launch import slurm

        return slurm.main(argv[1:])
    from dtrain.launch import node

    return node.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
