"""tests/gpu: the worker launches, started together when the first GPU test runs.

Each test module names the launches it reads with ``pytest.mark.gpu_worker(name, ...)``
(names: gpu_common.LAUNCHES). The ``gpu_workers`` fixture starts every launch the
selected tests need at once (one process each on the one GPU), so the run costs
about the longest launch, not their sum; each test then waits for its own. On a
machine without CUDA every module is skipped at collection and nothing starts, unless ``GPU_TESTS_DRY_RUN=1``
(gpu_common.DRY_RUN) lets the modules that support it run their launches on the CPU.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

if str(Path(__file__).parent) not in sys.path:  # appended: tests/conftest.py must stay the one named "conftest"
    sys.path.append(str(Path(__file__).parent))
import gpu_common  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu_worker(*names): the tests/gpu worker launches a test reads")


def skipped(item) -> bool:
    """The item carries a ``skip`` mark or a ``skipif`` whose condition (a bool here) holds: its launch is not
    needed (e.g. no deepspeed, or a dry run on the CPU, which runs only the launches that support it)."""
    return item.get_closest_marker("skip") is not None or any(
        m.args and m.args[0] is True for m in item.iter_markers("skipif"))


@pytest.fixture(scope="session")
def gpu_workers(request, tmp_path_factory):
    """:class:`gpu_common.Launches` of every worker the selected tests name; stopped at the end of the session."""
    names = set()
    for item in request.session.items:
        marker = item.get_closest_marker("gpu_worker")
        if marker is not None and not skipped(item):
            names.update(marker.args)
    launches = gpu_common.Launches(tmp_path_factory.mktemp("gpu_workers"), names)

    def terminated(signum, frame):  # e.g. `timeout` ending this pytest: take the launches down with it, and
        launches.terminate_now()    # end the session as an interrupt does (summary and figures still printed)
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield launches
    finally:
        launches.close()
        signal.signal(signal.SIGTERM, previous)


def pytest_terminal_summary(terminalreporter):
    """Every figure the GPU tests recorded, in the summary that a plain ``pytest -q`` prints too."""
    if gpu_common.RECORDED:
        terminalreporter.section("GPU test figures")
        for name, text in gpu_common.RECORDED:
            terminalreporter.write_line(f"GPU-TEST {name}: {text}")
