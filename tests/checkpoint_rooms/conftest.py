import pytest

from tests.checkpoint_rooms import fakes


@pytest.fixture
def sess():
    """A one-rank session whose threads are stopped after the test."""
    s = fakes.session()
    yield s
    s.close_threads()
