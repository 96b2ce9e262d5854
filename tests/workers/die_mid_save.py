"""The CLI, but the process SIGKILLs itself (no cleanup, like an OOM kill or a lost node) inside the
save of step $DTRAIN_TEST_DIE_AT, at the point $DTRAIN_TEST_DIE_WHERE names:

    shards  in the middle of writing the shard file (some tensors written, no .metadata)
    commit  after the COMPLETE marker is written into step_N.tmp/, before the rename
    async   with --async-checkpoint: the background writer stops in the middle of the shard file
            and the process dies at the next step boundary, training gone on, the save in flight
"""

import os
import signal
import sys
import threading

from torch.distributed.checkpoint import filesystem

from dtrain.checkpoint import storage as checkpoint
from dtrain.checkpoint.checkpointer import Checkpointer
from dtrain.run import main

WHERE = os.environ["DTRAIN_TEST_DIE_WHERE"]
AT = int(os.environ["DTRAIN_TEST_DIE_AT"])
TARGET = f"{checkpoint.checkpoint_name(AT)}.tmp"


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


if WHERE not in ("shards", "commit", "async"):
    raise SystemExit(f"unknown DTRAIN_TEST_DIE_WHERE={WHERE!r}")
if WHERE in ("shards", "async"):
    original_write_item = filesystem._write_item
    written = 0
    midway = threading.Event()  # the writer has written some tensors and stopped

    def write_item(transforms, stream, *args, **kwargs):
        global written
        if TARGET in str(getattr(stream, "name", "")):
            written += 1
            if written == 10:
                stream.flush()
                if WHERE == "shards":
                    die()
                midway.set()
                threading.Event().wait(120)  # until the kill: never set
        return original_write_item(transforms, stream, *args, **kwargs)

    filesystem._write_item = write_item
if WHERE == "async":
    original_after_step = Checkpointer.after_step

    def after_step(self, step, *args, **kwargs):
        if step == AT + 1:
            if not midway.wait(120) or self.pending is None or self.pending.future.done():
                raise SystemExit(f"die_mid_save: the save of step {AT} was not in flight at step {step}")
            die()
        return original_after_step(self, step, *args, **kwargs)

    Checkpointer.after_step = after_step
if WHERE == "commit":
    original_write_synced = checkpoint._write_synced

    def write_synced(path, text):
        original_write_synced(path, text)
        if path.name == checkpoint.COMPLETE and path.parent.name == TARGET:
            die()

    checkpoint._write_synced = write_synced

if __name__ == "__main__":
    sys.exit(main())
