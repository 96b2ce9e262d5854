"""The CLI, but building each step's batches takes $DTRAIN_TEST_DATA_SECONDS longer, as a data
loader on a slow filesystem would."""

import os
import sys
import time

from dtrain.data import TokenDataset
from dtrain.run import main

delay = float(os.environ["DTRAIN_TEST_DATA_SECONDS"])
micro_batches = TokenDataset.micro_batches


def slow_micro_batches(self, *args, **kwargs):
    time.sleep(delay)
    return micro_batches(self, *args, **kwargs)


TokenDataset.micro_batches = slow_micro_batches

if __name__ == "__main__":
    sys.exit(main())
