"""scripts/system-programs.sh, which `make test` runs before anything else: with the four
programs present it does nothing; without them it installs them with apt-get as root, and
otherwise stops with one line naming the command. The programs' absence, apt-get and the
user are simulated through PATH (a folder holding only the tools the script may use, and
stand-ins for ``id`` and ``apt-get``), so nothing is installed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "system-programs.sh"
PACKAGES = "prometheus chromium redis-server haproxy"


def _bin(tmp_path: Path, *, uid: int | None, apt: bool) -> Path:
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "bash").symlink_to(shutil.which("bash") or "/bin/bash")
    if uid is not None:
        (folder / "id").write_text(f"#!/bin/bash\necho {uid}\n")
        (folder / "id").chmod(0o755)
    if apt:  # records its arguments, installs nothing
        (folder / "apt-get").write_text(
            f'#!/bin/bash\necho "$*" >> {tmp_path / "apt-get.calls"}\n')
        (folder / "apt-get").chmod(0o755)
    return folder


def _run(folder: Path, mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(folder / "bash"), str(SCRIPT), mode], capture_output=True,
                          text=True, timeout=30, env={"PATH": str(folder)})


def test_with_every_program_present_nothing_happens() -> None:
    done = subprocess.run(["bash", str(SCRIPT), "install"], capture_output=True, text=True,
                          timeout=30)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_check_names_the_missing_packages(tmp_path: Path) -> None:
    done = _run(_bin(tmp_path, uid=None, apt=False), "check")
    assert (done.returncode, done.stdout) == (1, PACKAGES + "\n")


def test_as_root_with_apt_get_the_missing_ones_are_installed(tmp_path: Path) -> None:
    done = _run(_bin(tmp_path, uid=0, apt=True), "install")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "apt-get.calls").read_text().splitlines() == [
        "update -q", f"install -y -q --no-install-recommends {PACKAGES}"]


def test_without_root_one_line_names_the_command_and_nothing_runs(tmp_path: Path) -> None:
    done = _run(_bin(tmp_path, uid=1000, apt=True), "install")
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and done.stdout == ""
    assert f"sudo apt-get install -y -q --no-install-recommends {PACKAGES}" in done.stderr
    assert not (tmp_path / "apt-get.calls").exists()


def test_without_apt_get_one_line_names_the_programs(tmp_path: Path) -> None:
    done = _run(_bin(tmp_path, uid=0, apt=False), "install")
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and done.stdout == ""
    assert PACKAGES in done.stderr
