"""The CLI on hosts that report $DTRAIN_TEST_HOST_GB GB of memory available to rank 0's process,
and plenty to the others (where they ask the host alike, every rank must still refuse)."""

import os
import sys

from dtrain.layout import host_memory
from dtrain.run import main

GB = float(os.environ["DTRAIN_TEST_HOST_GB"])
host_memory.available_bytes = lambda: GB * 1e9 if os.environ.get("RANK", "0") == "0" else 1e15

if __name__ == "__main__":
    sys.exit(main())
