from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from weighbridge.launch import ServerProcess, emulator_process, free_port

DELAY_SERVER = Path(__file__).with_name("delay_server.py")


@pytest.fixture(scope="module")
def delay_server() -> Iterator[ServerProcess]:
    port = free_port()
    with ServerProcess(name="delay-server", argv=[sys.executable, str(DELAY_SERVER), str(port)],
                       url=f"http://127.0.0.1:{port}") as server:
        yield server


@pytest.fixture(scope="module")
def emulator() -> Iterator[ServerProcess]:
    with emulator_process(max_num_seqs=128, num_kv_blocks=4096) as server:
        yield server
