"""Token data as a hostile or unlucky user hands it over: a .bin that does not belong to its .idx,
a preprocessor stopped while it overwrites a dataset, token ids that are not integers or do not
fit, text that is not text, and input files of the wrong shape: each is a one-line error that
says what to change (or, where stated, repaired and reported once), never silent wrong data."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time

from dtrain.data.indexed import IndexedDataset
from tests.launch import REPO, cli_env
from tools.preprocess_data import preprocess
from tests.unit.test_data_inputs import TOKENIZER, write_jsonl, TEXTS


def test_a_preprocessor_killed_while_overwriting_leaves_the_earlier_dataset_whole(tmp_path):
    prefix = str(tmp_path / "data")
    preprocess(write_jsonl(tmp_path / "small.jsonl", TEXTS), prefix, tokenizer=TOKENIZER, log=io.StringIO())
    before = {suffix: open(prefix + suffix, "rb").read() for suffix in (".bin", ".idx")}
    big = write_jsonl(tmp_path / "big.jsonl", TEXTS * 2000)
    command = [sys.executable, "-m", "tools.preprocess_data", "--input", big, "--output-prefix", prefix,
               "--tokenizer", TOKENIZER]
    process = subprocess.Popen(command, cwd=REPO, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # Killed once it writes tokens: a temporary file appears, or the old .bin is overwritten.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            started = any(name.endswith(".tmp") for name in os.listdir(tmp_path))
            if started or os.path.getsize(prefix + ".bin") != len(before[".bin"]):
                break
            time.sleep(0.01)
        assert process.poll() is None, "the preprocessor finished before it could be killed"
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait()
    assert {suffix: open(prefix + suffix, "rb").read() for suffix in (".bin", ".idx")} == before
    assert IndexedDataset(prefix).num_documents == len(TEXTS)
