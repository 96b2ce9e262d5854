import contextlib
import io
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist


def pytest_collection_modifyitems(config, items):
    # Stress runs take minutes: only a -m expression that names them runs them (pyproject's
    # addopts leaves them out; a plain `-m "not slow"` would otherwise take them in).
    if "stress" not in (config.option.markexpr or ""):
        for item in items:
            if "stress" in item.keywords:
                item.add_marker(pytest.mark.skip(reason="a stress run: select it with -m stress"))
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


REPO = Path(__file__).resolve().parent.parent
# What Python and pytest write into a checkout by themselves.
_OWN_LEFTOVERS = {".git", "__pycache__", ".pytest_cache", ".venv"}


def repository_files() -> set[str]:
    found = set()
    for folder, subfolders, files in os.walk(REPO):
        subfolders[:] = [name for name in subfolders if name not in _OWN_LEFTOVERS and not name.endswith(".egg-info")]
        found.update(os.path.relpath(os.path.join(folder, name), REPO) for name in files)
    return found


@pytest.fixture(scope="session", autouse=True)
def repository_stays_clean():
    """Tests write into temporary directories only: a run directory left in the checkout (runs/...)
    would mix with the user's own runs."""
    before = repository_files()
    yield
    added = sorted(repository_files() - before)
    if added:
        pytest.fail(f"the tests wrote into the repository: {', '.join(added[:10])}", pytrace=False)


@pytest.fixture(scope="session")
def single_run(tmp_path_factory):
    """The one-process reference run of the tiny model that parity tests compare against."""
    from tests.launch import train_scalars

    return train_scalars(tmp_path_factory.mktemp("single"), [])


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """One uninterrupted single-process run that saves at steps 3, 6, 9 and 10: (run dir, losses).
    Tests copy its checkpoints before changing them."""
    from tests.launch import train_scalars

    run_dir = tmp_path_factory.mktemp("reference")
    losses = train_scalars(run_dir, ["--checkpoint-every", "3"])["train/loss"]
    assert len(losses) == 10
    return run_dir, losses


@pytest.fixture(scope="session")
def dp2_run(tmp_path_factory):
    """The uninterrupted two-process run (dp_shard=2) of the tiny model: resumed, restarted and
    multi-node runs on the same mesh must match its losses bit for bit."""
    from tests.launch import train_scalars

    return train_scalars(tmp_path_factory.mktemp("dp2"), [], nproc=2)


@pytest.fixture(scope="session")
def indexed_corpus(tmp_path_factory):
    """A Megatron indexed corpus of bundled documents (prefix path), for runs with a validation split."""
    from dtrain.data import BUNDLED_TOKENIZER
    from tools.preprocess_data import preprocess

    folder = tmp_path_factory.mktemp("indexed")
    corpus = (BUNDLED_TOKENIZER.parent / "corpus.txt").read_text().split("\n\n")
    lines = [json.dumps({"text": text}) for text in corpus[:3000] if text.strip()]
    (folder / "docs.jsonl").write_text("\n".join(lines) + "\n")
    preprocess(str(folder / "docs.jsonl"), str(folder / "docs"), tokenizer=str(BUNDLED_TOKENIZER),
               append_eod=True, log=io.StringIO())
    return str(folder / "docs")


@pytest.fixture
def fake_world():
    """`with fake_world(n):` a fake world of n ranks in this process, seen from rank 0: meshes,
    DTensors and FSDP work, collectives move no data (values are not meaningful)."""
    from dtrain import distributed

    @contextlib.contextmanager
    def world(world_size: int):
        if dist.is_initialized():
            pytest.skip("a default process group already exists in this process")
        distributed.init_fake_process_group(world_size)
        try:
            yield
        finally:
            dist.destroy_process_group()

    return world


@pytest.fixture
def one_rank_group():
    """A real gloo process group of one rank in this process (collectives run, on one rank)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()
