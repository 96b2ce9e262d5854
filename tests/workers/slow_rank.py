"""The CLI, but on rank $DTRAIN_TEST_SLOW_RANK every layer's forward takes $DTRAIN_TEST_SLOW_SECONDS
longer, as on a throttled GPU: a straggler."""

import os
import sys
import time

from dtrain.run import main
from parallel.modules import LayerModule

if int(os.environ.get("RANK", "0")) == int(os.environ["DTRAIN_TEST_SLOW_RANK"]):
    delay = float(os.environ["DTRAIN_TEST_SLOW_SECONDS"])
    forward = LayerModule.forward

    def slow_forward(self, x, aux):
        time.sleep(delay)
        return forward(self, x, aux)

    LayerModule.forward = slow_forward

if __name__ == "__main__":
    sys.exit(main())
