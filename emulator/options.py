"""The emulator's options, declared once: ``weighbridge emulator``'s flags, a stack file's
``engines.emulator`` section and the virtual-time engines all read this model, so a name, a
default, a bound or a help text cannot differ between them.

Each field's description is its ``--help`` text; ``flags`` in a field's extra names its
command-line spellings when they are not just the field's name (vLLM's own spelling beside
ours). :meth:`EmulatorOptions.engine` and :meth:`EmulatorOptions.step_profile` build what the
emulator runs, with the start-up checks vLLM makes (a ``ValueError`` says what is wrong).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from emulator.engine import EngineConfig, kv_blocks_for_bytes
from emulator.profiles import StepTimeProfile, get_profile

__all__ = ["DEFAULT_KV_BLOCKS", "EmulatorOptions"]

# As vLLM's CPU build without --num-gpu-blocks-override or --kv-cache-memory-bytes: a cache
# of this many blocks.
DEFAULT_KV_BLOCKS = 512


def _override(what: str) -> Any:
    return Field(default=None, ge=0, description=f"Override: {what}.")


class EmulatorOptions(BaseModel):
    """Everything ``weighbridge emulator`` takes besides where to listen."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    model_name: str = Field(default="weighbridge-emulator",
                            description="Model name served and checked.")
    profile: str = Field(default="cpu-tiny", description=(
        "Step-time profile: cpu-tiny or h100-llama3-8b (docs/emulator.md)."))
    max_num_seqs: int = Field(default=64, ge=1, description="Most sequences running at once.")
    max_num_batched_tokens: int = Field(default=2048, ge=1,
                                        description="Token budget B of one step.")
    num_kv_blocks: int | None = Field(
        default=None, ge=1,
        description=(f"KV-cache size in blocks (vLLM's --num-gpu-blocks-override); default "
                     f"{DEFAULT_KV_BLOCKS} unless --kv-cache-memory-bytes sizes it."),
        json_schema_extra={"flags": ["--num-kv-blocks", "--num-gpu-blocks-override"]})
    kv_cache_memory_bytes: int | None = Field(default=None, ge=1, description=(
        "KV-cache size in bytes, as vLLM's flag: as many whole blocks as fit, at the "
        "profile's KV bytes per token. --num-kv-blocks wins when both are given."))
    kv_bytes_per_token: int | None = Field(default=None, ge=1, description=(
        "Override: KV-cache bytes per token (for --kv-cache-memory-bytes)."))
    block_size: int = Field(default=16, ge=1, description="Tokens per KV block.")
    max_model_len: int = Field(default=4096, ge=1,
                               description="Longest prompt + output accepted.")
    scheduling_policy: Literal["fcfs", "priority"] = Field(default="fcfs", description=(
        "Waiting-queue order: fcfs or priority (by the request's priority field)."))
    long_prefill_token_threshold: int = Field(default=0, ge=0, description=(
        "Most prompt tokens one sequence prefills per step (0: no cap), as vLLM's flag of "
        "the same name."))
    no_chunked_prefill: bool = Field(default=False, description=(
        "Steps are all-prefill or all-decode (vLLM V0) instead of mixed."),
        json_schema_extra={"flags": ["--no-chunked-prefill"]})
    seed: int = Field(default=0, description="Seed of the output-length draws.")
    mean_output_tokens: float = Field(default=128.0, gt=0, description=(
        "Mean output length when a request does not set ignore_eos."))
    vocab_size: int = Field(default=32000, ge=1, description="Token ids must be below this.")
    t_fixed: float | None = _override("seconds per step")
    t_prefill_token: float | None = _override("seconds per prefill token")
    t_decode_seq: float | None = _override("seconds per decoding sequence")
    t_kv_token: float | None = _override("seconds per KV token attended")
    t_api_serial: float | None = _override(
        "API-server seconds per request, one request at a time")
    t_api_latency: float | None = _override("API-server latency per request, in parallel")
    t_api_token: float | None = _override(
        "API-server seconds per streamed token, serial with admission")

    def step_profile(self) -> StepTimeProfile:
        """The named profile with this option's overrides (ValueError: unknown profile)."""
        return get_profile(self.profile).with_overrides(
            t_fixed=self.t_fixed, t_prefill_token=self.t_prefill_token,
            t_decode_seq=self.t_decode_seq, t_kv_token=self.t_kv_token,
            t_api_serial=self.t_api_serial, t_api_latency=self.t_api_latency,
            t_api_token=self.t_api_token, kv_bytes_per_token=self.kv_bytes_per_token)

    def kv_blocks(self) -> int:
        """The cache's blocks, as vLLM sizes it: a block count wins over a size in bytes;
        without either, ``DEFAULT_KV_BLOCKS``."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        if self.kv_cache_memory_bytes is None:
            return DEFAULT_KV_BLOCKS
        per_token = self.step_profile().kv_bytes_per_token
        if not per_token:
            raise ValueError(f"profile {self.profile} has no KV bytes per token: give "
                             "--kv-bytes-per-token or size the cache in blocks")
        return kv_blocks_for_bytes(self.kv_cache_memory_bytes, self.block_size, per_token)

    def engine(self) -> EngineConfig:
        """The engine these options describe, checked as vLLM checks it at start-up."""
        return EngineConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            num_kv_blocks=self.kv_blocks(), block_size=self.block_size,
            max_model_len=self.max_model_len, scheduling_policy=self.scheduling_policy,
            chunked_prefill=not self.no_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold)

    def check(self) -> None:
        """Every start-up check of ``weighbridge emulator`` (ValueError)."""
        self.step_profile()
        self.engine()

    def flags(self, seed_offset: int = 0) -> dict[str, object]:
        """The options that differ from the defaults, in Python spelling (the keyword
        arguments of ``weighbridge.launch.emulator_process``); ``seed_offset`` moves the seed
        so that several engines draw different output lengths."""
        flags = self.model_dump(exclude_defaults=True)
        flags["seed"] = self.seed + seed_offset
        return flags

    @classmethod
    def cli_flags(cls, name: str) -> list[str]:
        """The command-line spellings of field ``name``."""
        extra = cls.model_fields[name].json_schema_extra
        flags = extra.get("flags") if isinstance(extra, dict) else None
        if isinstance(flags, list):
            return [str(flag) for flag in flags]
        return ["--" + name.replace("_", "-")]
