"""The CLI, but the process SIGKILLs itself (no cleanup, like an OOM kill or a lost node) inside the
save of step $DTRAIN_TEST_DIE_AT, at the point $DTRAIN_TEST_DIE_WHERE names:

    shards  in the middle of writing the shard file (some tensors written, no .metadata)
    commit  after the COMPLETE marker is written into step_N.tmp/, before the rename
"""

import os
import signal
import sys

from torch.distributed.checkpoint import filesystem

from dtrain.checkpoint import storage as checkpoint
from dtrain.run import main

WHERE = os.environ["DTRAIN_TEST_DIE_WHERE"]
TARGET = f"{checkpoint.checkpoint_name(int(os.environ['DTRAIN_TEST_DIE_AT']))}.tmp"


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


if WHERE == "shards":
    original_write_item = filesystem._write_item
    written = 0

    def write_item(transforms, stream, *args, **kwargs):
        global written
        if TARGET in str(getattr(stream, "name", "")):
            written += 1
            if written == 10:
                stream.flush()
                die()
        return original_write_item(transforms, stream, *args, **kwargs)

    filesystem._write_item = write_item
elif WHERE == "commit":
    original_write_synced = checkpoint._write_synced

    def write_synced(path, text):
        original_write_synced(path, text)
        if path.name == checkpoint.COMPLETE and path.parent.name == TARGET:
            die()

    checkpoint._write_synced = write_synced
else:
    raise SystemExit(f"unknown DTRAIN_TEST_DIE_WHERE={WHERE!r}")

if __name__ == "__main__":
    sys.exit(main())
