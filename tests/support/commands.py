"""Every ``weighbridge`` command, the least argv that reaches its body, and the one line it
answers with when the base install lacks its extras (None: the base is all it needs). The
walks of the base install read this table: tests/unit/test_extras.py in process,
tests/acceptance/test_wheel.py in a venv holding the wheel and the base dependencies
alone."""

from __future__ import annotations

from collections.abc import Iterator

import typer.main

from weighbridge.app.cli import app

_PIP = "pip install 'weighbridge[{}]'"

# words -> (argv after the words, the line on stderr without the extras)
COMMANDS: dict[str, tuple[list[str], str | None]] = {
    "emulator": ([], "weighbridge emulator needs the emulator extra: " + _PIP.format("emulator")),
    "sidecar": (["--config", "fleet.yaml"],
                "weighbridge sidecar needs the sidecar extra: " + _PIP.format("sidecar")),
    "epp": (["--config", "fleet.yaml"], "weighbridge epp needs the sidecar and epp extras: "
            + _PIP.format("sidecar,epp")),
    "reload": (["--pid", "1"],
               "weighbridge reload needs the sidecar extra: " + _PIP.format("sidecar")),
    "hash-key": (["a-key"], None),
    "report": (["runs/x"], "weighbridge report needs the analysis extra: "
               + _PIP.format("analysis")),
    "capacity": ([], "weighbridge capacity needs the analysis extra: "
                 + _PIP.format("analysis")),
    "demo": (["--quick"], "weighbridge demo needs the analysis, emulator, loadgen and sidecar "
             "extras: " + _PIP.format("analysis,emulator,loadgen,sidecar")),
    "simulate": ([], "weighbridge simulate needs the analysis extra: "
                 + _PIP.format("analysis")),
    "up": ([], "weighbridge up needs the emulator and sidecar extras: "
           + _PIP.format("emulator,sidecar")),
    "dashboards generate": (["--check"], "weighbridge dashboards generate needs the dashboards "
                            "extra: " + _PIP.format("dashboards")),
    "dashboards push": (["--url", "http://127.0.0.1:9", "--token", "t"],
                        "weighbridge dashboards push needs the dashboards extra: "
                        + _PIP.format("dashboards")),
}


def registered() -> Iterator[str]:
    """The words of every command the CLI registers, its groups walked into."""
    def walk(group: object, words: list[str]) -> Iterator[str]:
        for name, command in group.commands.items():  # type: ignore[attr-defined]
            if hasattr(command, "commands"):
                yield from walk(command, [*words, name])
            else:
                yield " ".join([*words, name])
    yield from walk(typer.main.get_command(app), [])
