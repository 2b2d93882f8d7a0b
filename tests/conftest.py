import sys
from pathlib import Path

import pytest

# The fast tier's modules (tests/unit) hold helpers the other tests share (packed rows, the
# thread group of test_cp_attention, test_hf_processor's folders): importable from every test
# whatever order pytest collects the files in.
sys.path.insert(0, str(Path(__file__).parent / "unit"))

from dist_pool import DistPools  # noqa: E402

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
    """The distributed checks' process groups: each check runs on as many processes as its mesh
    has ranks (dist_pool.DistPools; 8 processes on 2 cores cost real time: keep such tests few)."""
    p = DistPools(defaults=_pool_defaults(pytestconfig))
    yield p
    p.close()
