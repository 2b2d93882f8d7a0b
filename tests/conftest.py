import pytest

from dist_pool import DistPool

WORLD_SIZE = 4  # enough for cp=4 and dp_shard=2 x cp=2; smaller layouts run as identical copies


@pytest.fixture(scope="session")
def pool():
    p = DistPool(WORLD_SIZE)
    yield p
    p.close()
