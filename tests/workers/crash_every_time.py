"""The CLI, but the faults of DTRAIN_FAULT fire every time their step runs, not once per run
directory: a failure that a restart meets again (an OOM at that step, a rank that crashes there)."""

import shutil
import sys

from dtrain.resilience import faults
from dtrain.run import main

fire_once = faults.FaultInjector._take


def fire_every_time(self, step, kinds):
    shutil.rmtree(self.markers, ignore_errors=True)
    return fire_once(self, step, kinds)


faults.FaultInjector._take = fire_every_time

if __name__ == "__main__":
    sys.exit(main())
