import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def single_run(tmp_path_factory):
    """The one-process reference run of the tiny model that parity tests compare against."""
    from tests.launch import train_scalars

    return train_scalars(tmp_path_factory.mktemp("single"), [])
