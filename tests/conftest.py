"""Shared test setup."""

import pytest

from jitbyoc import cache


@pytest.fixture(autouse=True, scope="session")
def isolated_compile_cache(tmp_path_factory):
    """Every test session gets its own, empty disk cache, never the user's."""
    cache.configure(path=tmp_path_factory.mktemp("jitbyoc-cache"))
    cache.clear_memory()
    yield
