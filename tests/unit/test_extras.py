"""The extras a command needs, read from the package's metadata, and the one line each
command answers with when they are absent (exit 2, no traceback): the whole CLI walked with
every extra's distributions hidden from the metadata lookup. The same walk runs in a real
base-only venv in tests/acceptance/test_wheel.py."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from tests.support.commands import COMMANDS, registered
from weighbridge import extras
from weighbridge.app.cli import app

REQUIRES = [
    "pydantic>=2.14",
    'aiohttp>=3.14; extra == "sidecar"',
    'uvloop>=0.23; sys_platform != "win32" and extra == "sidecar"',
    'redis>=8.1; extra == "sidecar"',
    'pandas>=3.1; extra == "analysis"',
    'grafana-foundation-sdk==1769699796!10.4.0; extra == "dashboards"',
    'weighbridge[analysis,sidecar]; extra == "all"',
    "pytest>=9.2 ; extra == 'dev'",
]


def test_requirements_by_extra() -> None:
    assert extras.requirements_by_extra(REQUIRES) == {
        "sidecar": ["aiohttp", "redis"],  # uvloop's platform marker: not judged here
        "analysis": ["pandas"],
        "dashboards": ["grafana-foundation-sdk"],
        "dev": ["pytest"],
    }


def test_missing_extras_in_the_order_asked() -> None:
    installed = {"aiohttp", "redis", "pytest"}.__contains__
    assert extras.missing_extras(["sidecar", "dashboards", "analysis", "dev"], REQUIRES,
                                 installed) == ["dashboards", "analysis"]


def test_this_environment_has_every_extra() -> None:
    assert extras.missing_here(["sidecar", "emulator", "loadgen", "analysis",
                                "dashboards", "epp"]) == []


def test_the_table_names_every_command() -> None:
    assert sorted(registered()) == sorted(COMMANDS)


@pytest.mark.parametrize("words", sorted(COMMANDS))
def test_each_command_names_its_extras_without_them(
        words: str, monkeypatch: pytest.MonkeyPatch) -> None:
    base = {"pydantic", "pyyaml", "typer", "rich", "orjson", "httpx"}
    monkeypatch.setattr(extras, "_installed", lambda name: name.lower() in base)
    argv, line = COMMANDS[words]
    result = CliRunner().invoke(app, [*words.split(), *argv])
    if line is None:  # the base is all it needs
        assert result.exit_code == 0, result.output
        return
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert result.stderr == line + "\n"
