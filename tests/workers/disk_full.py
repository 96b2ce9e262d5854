"""The CLI on a disk that fills up while it writes the shards of step $DTRAIN_TEST_FULL_AT: while
the file RUN_DIR/disk_full exists, the tenth tensor written into that save fails with ENOSPC, as
a write to a full device does (the test removes the file to give the space back)."""

import errno
import os
import sys
from pathlib import Path

from torch.distributed.checkpoint import filesystem

from dtrain.checkpoint import storage as checkpoint
from dtrain.run import main

TARGET = f"{checkpoint.checkpoint_name(int(os.environ['DTRAIN_TEST_FULL_AT']))}.tmp"
FLAG = Path(sys.argv[sys.argv.index("--run-dir") + 1]) / "disk_full"
original_write_item = filesystem._write_item
written = 0


def write_item(transforms, stream, *args, **kwargs):
    global written
    if TARGET in str(getattr(stream, "name", "")) and FLAG.exists():
        written += 1
        if written == 10:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return original_write_item(transforms, stream, *args, **kwargs)


filesystem._write_item = write_item

if __name__ == "__main__":
    sys.exit(main())
