import pytest
from dist_pool import DistPool

WORLD_SIZE = 4  # enough for cp=4 and dp_shard=2 x cp=2; smaller layouts run as identical copies
WORLD_SIZE_8 = 8  # dp x cp x tp with every degree 2: the few 8-process tests share this pool
COMPILE_BACKENDS = ("none", "aot_eager", "inductor")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--compile-backend",
        choices=COMPILE_BACKENDS,
        default="none",
        help="run every parity case (dist_checks.parity) with each ViT and decoder block "
        "compiled by this torch.compile backend; 'none' (the default): eager blocks. Cases that "
        "name a backend themselves (test_compile.py) keep theirs.",
    )


def _pool_defaults(config: pytest.Config) -> dict[str, dict[str, str]]:
    backend = config.getoption("--compile-backend")
    return {} if backend == "none" else {"parity": {"compile_backend": backend}}


@pytest.fixture(scope="session")
def pool(pytestconfig: pytest.Config):
    p = DistPool(WORLD_SIZE, defaults=_pool_defaults(pytestconfig))
    yield p
    p.close()


@pytest.fixture(scope="session")
def pool8(pytestconfig: pytest.Config):
    """Started by the first test that asks for it (8 processes on 2 cores cost real time: keep
    the tests that use it few)."""
    p = DistPool(WORLD_SIZE_8, defaults=_pool_defaults(pytestconfig))
    yield p
    p.close()
