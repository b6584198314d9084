"""A third-party fuzzer holds the sidecar to its API description: schemathesis, as a new user
would run it (its ``st`` command), against the description a live sidecar serves
(/openapi.json) and that sidecar in front of an emulated engine. Coverage and fuzzing
phases, every check, 200 examples per operation at most, generated deterministically (the
same cases every run, so a failure reproduces and nothing flakes).

One check is replaced: openapi_fuzz_checks.py says why (the backend's own answers to what
only it validates pass through, as the description documents). /admin/state is fuzzed in
a second run with an admin key.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.stack import ADMIN_KEY, start_stack, tenant

pytestmark = pytest.mark.timeout(900)

REPO = Path(__file__).resolve().parents[3]
ST = Path(sys.executable).with_name("st")
KEY = "sk-fuzz"
HOOKS = "tests.acceptance.sidecar.openapi_fuzz_checks"


def fuzz(url: str, key: str, workdir: Path, *selection: str) -> subprocess.CompletedProcess[str]:
    # In workdir: st keeps its state (.schemathesis/) in the current directory.
    env = {**os.environ, "SCHEMATHESIS_HOOKS": HOOKS,
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [str(ST), "run", f"{url}/openapi.json", "--header", f"Authorization: Bearer {key}",
         "--phases", "coverage,fuzzing", "--checks", "all",
         "--exclude-checks", "positive_data_acceptance",
         "--max-examples", "200", "--generation-deterministic", "--workers", "1",
         "--request-timeout", "60", "--output-sanitize", "false", "--no-color", *selection],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=800, check=False)


def test_the_sidecar_keeps_to_its_description_under_schemathesis(
        processes: contextlib.ExitStack, tmp_path: Path) -> None:
    # A short context keeps the fuzzer's generations short; longer ones are the engine's
    # 400, which passes through.
    stack = start_stack(processes, {"tenants": {"fuzz": tenant("standard", KEY)},
                                    "admin_api_keys": [f"plain:{ADMIN_KEY}"]},
                        max_model_len=256)
    for key, selection in ((KEY, ("--exclude-path", "/admin/state")),
                           (ADMIN_KEY, ("--include-path", "/admin/state"))):
        run = fuzz(stack.sidecar, key, tmp_path, *selection)
        print(run.stdout[-2000:])
        assert run.returncode == 0, run.stdout[-12000:] + run.stderr[-3000:]
