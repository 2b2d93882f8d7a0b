import pytest
from dist_pool import DistPool

WORLD_SIZE = 4  # enough for cp=4 and dp_shard=2 x cp=2; smaller layouts run as identical copies
WORLD_SIZE_8 = 8  # dp x cp x tp with every degree 2: the few 8-process tests share this pool


@pytest.fixture(scope="session")
def pool():
    p = DistPool(WORLD_SIZE)
    yield p
    p.close()


@pytest.fixture(scope="session")
def pool8():
    """Started by the first test that asks for it (8 processes on 2 cores cost real time: keep
    the tests that use it few)."""
    p = DistPool(WORLD_SIZE_8)
    yield p
    p.close()
