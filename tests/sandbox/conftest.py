"""The sandbox tests' fixtures (sandbox_fixtures.py), for tests/sandbox/ and its sdk/, service/,
runtime/ and store/ folders."""

from sandbox_fixtures import *  # noqa: F403 (pytest finds the fixtures and the hook by name here)
