"""Every test starts, and leaves, with no mpaccel shared state (discovery is kept)."""

import pytest

from mpaccel.testing import reset_state


@pytest.fixture(autouse=True)
def _fresh_mpaccel_state():
    reset_state()
    yield
    reset_state()
