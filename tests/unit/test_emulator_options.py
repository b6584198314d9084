"""The emulator's options, declared once: the command's flags, a stack's section and the
virtual-time engines read the same model."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from weighbridge.app.cli import app
from weighbridge.app.stack import parse_stack
from weighbridge.emulator.options import DEFAULT_KV_BLOCKS, EmulatorOptions


def test_every_option_is_a_flag_of_the_command_with_its_help() -> None:
    result = CliRunner().invoke(app, ["emulator", "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    for name, info in EmulatorOptions.model_fields.items():
        for flag in EmulatorOptions.cli_flags(name):
            assert flag in result.output, flag
        assert info.description
    assert EmulatorOptions.cli_flags("num_kv_blocks") == ["--num-kv-blocks",
                                                          "--num-gpu-blocks-override"]


def test_a_stack_without_an_emulator_section_gets_the_commands_defaults() -> None:
    spec = parse_stack({"sidecar": {"tenants": {"a": {"tier": "standard",
                                                      "api_keys": ["plain:k"]}}}})
    assert spec.engines.emulator == EmulatorOptions()
    assert spec.engines.emulator.flags() == {"seed": 0}  # nothing else differs


def test_the_cache_is_sized_as_vllm_sizes_it() -> None:
    assert EmulatorOptions().engine().num_kv_blocks == DEFAULT_KV_BLOCKS
    assert EmulatorOptions(num_kv_blocks=300).engine().num_kv_blocks == 300
    per_token = EmulatorOptions(profile="h100-llama3-8b").step_profile().kv_bytes_per_token
    assert per_token
    by_bytes = EmulatorOptions(profile="h100-llama3-8b", kv_cache_memory_bytes=per_token * 16 * 700)
    assert by_bytes.engine().num_kv_blocks == 700
    # A block count wins over a size in bytes, as in vLLM.
    both = EmulatorOptions(profile="h100-llama3-8b", num_kv_blocks=300,
                           kv_cache_memory_bytes=per_token * 16 * 700)
    assert both.engine().num_kv_blocks == 300


def test_overrides_reach_the_step_profile() -> None:
    profile = EmulatorOptions(t_fixed=0.5, t_api_token=0.25).step_profile()
    assert (profile.t_fixed, profile.t_api_token) == (0.5, 0.25)


def test_start_up_checks_are_vllms() -> None:
    with pytest.raises(ValueError, match="smaller than max_model_len"):
        EmulatorOptions(max_model_len=99_999).check()
    with pytest.raises(ValueError, match="unknown profile"):
        EmulatorOptions(profile="no-such-profile").check()


def test_a_bad_flag_is_named_in_one_line() -> None:
    result = CliRunner().invoke(app, ["emulator", "--max-num-seqs", "0"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 2
    assert "--max-num-seqs: Input should be greater than or equal to 1" in result.output
    result = CliRunner().invoke(app, ["emulator", "--max-model-len", "99999"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "smaller than max_model_len" in result.output
