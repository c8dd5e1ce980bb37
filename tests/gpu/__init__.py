"""GPU-only tests (see docs/gpu_tests.md). A package, so that its conftest.py does not take the name
``conftest`` from tests/conftest.py, which test modules there import by that name."""
