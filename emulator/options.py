"""The emulator's options, declared once: ``weighbridge emulator``'s flags, a stack file's
``engines.emulator`` section and the virtual-time engines all read this model, so a name, a
default, a bound or a help text cannot differ between them.

Each field's description is its ``--help`` text; ``flags`` in a field's extra names its
command-line spellings when they are not just the field's name (vLLM's own spelling beside
ours). :meth:`EmulatorOptions.engine` and :meth:`EmulatorOptions.step_profile` build what the
emulator runs, with the start-up checks vLLM makes (a ``ValueError`` says what is wrong).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from weighbridge.emulator.engine import EngineConfig, kv_blocks_for_bytes
from weighbridge.emulator.profiles import StepTimeProfile, get_profile

__all__ = ["DEFAULT_KV_BLOCKS", "MAX_LORA_RANKS", "EmulatorOptions", "LoraModule",
           "parse_lora_module"]

# As vLLM's CPU build without --num-gpu-blocks-override or --kv-cache-memory-bytes: a cache
# of this many blocks.
DEFAULT_KV_BLOCKS = 512


# vLLM's allowed --max-lora-rank values (MaxLoRARanks in vllm/config/lora.py).
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One static LoRA adapter, as vLLM's ``--lora-modules`` gives it. The emulator never
    reads ``path``: /v1/models shows it as the adapter card's ``root``."""

    name: str
    path: str


def parse_lora_module(item: str) -> LoraModule:
    """One ``--lora-modules`` value, read as vLLM reads it: ``name=path`` when it holds an
    ``=`` and no comma, else a JSON object ``{"name", "path"[, "base_model_name"]}``
    (ValueError). vLLM ignores a ``base_model_name`` that is not a served model, and the
    emulator serves one, so the adapter's parent is always the served model."""
    if "=" in item and "," not in item:
        name, path = item.split("=", 1)
    else:
        try:
            spec = json.loads(item)
        except json.JSONDecodeError:
            raise ValueError(f"Invalid JSON format for --lora-modules: {item}") from None
        fields = {"name", "path", "base_model_name", "is_3d_lora_weight"}
        if not isinstance(spec, dict) or not {"name", "path"} <= spec.keys() <= fields:
            raise ValueError(f"Invalid fields for --lora-modules: {item} - expected name, "
                             "path and optionally base_model_name")
        name, path = spec["name"], spec["path"]
        if not isinstance(name, str) or not isinstance(path, str):
            raise ValueError(f"Invalid fields for --lora-modules: {item} - name and path "
                             "must be strings")
    if not name or not path:
        # vLLM's answer when it loads the adapter.
        raise ValueError(f"{item}: Both 'lora_name' and 'lora_path' must be provided.")
    return LoraModule(name=name, path=path)


def _override(what: str) -> Any:
    return Field(default=None, ge=0, description=f"Override: {what}.")


class EmulatorOptions(BaseModel):
    """Everything ``weighbridge emulator`` takes besides where to listen."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    model_name: str = Field(default="weighbridge-emulator",
                            description="Model name served and checked.")
    enable_lora: bool = Field(default=False, description=(
        "Serve LoRA adapters (vLLM's flag): --lora-modules, /v1/models lists them, a "
        "request naming one is served by it."),
        json_schema_extra={"flags": ["--enable-lora", "--no-enable-lora"]})
    lora_modules: list[str] = Field(default_factory=list, description=(
        "A LoRA adapter, name=path or vLLM's JSON form {\"name\": ..., \"path\": ...}; "
        "repeat the flag for each adapter (vLLM takes several after one flag, this command "
        "one per flag). Needs --enable-lora."))
    max_loras: int = Field(default=1, ge=1, description=(
        "Most distinct LoRA adapters in one step's batch (vLLM's flag): a waiting request "
        "of another adapter is passed over while the batch holds this many."))
    max_lora_rank: int = Field(default=16, description=(
        "Accepted and checked as vLLM's flag (one of "
        f"{', '.join(map(str, MAX_LORA_RANKS))}); adapters cost no step time here."))
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
        "Waiting-queue order: fcfs or priority (by the request's priority field). Under "
        "fcfs a request's priority is accepted and ignored, as vLLM 0.32 does."))
    refuse_priority_under_fcfs: bool = Field(default=False, description=(
        "Under fcfs, answer a request with a non-zero priority 400 \"Got priority N but "
        "Priority scheduling is not enabled.\", as vLLM's V0 engine did."))
    long_prefill_token_threshold: int = Field(default=0, ge=0, description=(
        "Most prompt tokens one sequence prefills per step (0: no cap), as vLLM's flag of "
        "the same name."))
    no_chunked_prefill: bool = Field(default=False, description=(
        "Steps are all-prefill or all-decode (vLLM V0) instead of mixed."),
        json_schema_extra={"flags": ["--no-chunked-prefill"]})
    enable_prefix_caching: bool = Field(default=True, description=(
        "vLLM's automatic prefix cache (on by default, as vLLM): full KV blocks are cached "
        "under a hash of their prefix and reused by later requests."),
        json_schema_extra={"flags": ["--enable-prefix-caching", "--no-enable-prefix-caching"]})
    enable_prompt_tokens_details: bool = Field(default=False, description=(
        "Put prompt_tokens_details.cached_tokens in usage, as vLLM's flag."),
        json_schema_extra={"flags": ["--enable-prompt-tokens-details",
                                     "--no-enable-prompt-tokens-details"]})
    stream_interval: int = Field(default=1, ge=1, description=(
        "Tokens batched into each streamed chunk, as vLLM's flag: the first token's chunk "
        "goes at once, then one chunk per N tokens, the rest with the finish. A request's "
        "stream_interval raises it, never lowers it."))
    tokenizer: str | None = Field(default=None, description=(
        "A Hugging Face model directory (vLLM's flag) whose tokenizer.json and chat "
        "template count, number and cache prompt tokens as that model's vLLM does; "
        "default: the emulator's own rule (docs/emulator.md)."))
    seed: int = Field(default=0, description="Seed of the output-length draws.")
    mean_output_tokens: float = Field(default=128.0, gt=0, description=(
        "Mean output length when a request does not set ignore_eos."))
    vocab_size: int = Field(default=32000, ge=1, description="Token ids must be below this.")
    t_fixed: float | None = _override("seconds per step")
    t_prefill_token: float | None = _override("seconds per prefill token")
    t_decode_seq: float | None = _override("seconds per decoding sequence")
    t_kv_token: float | None = _override("seconds per KV token attended")
    t_prefill_context: float | None = _override(
        "seconds per prefill token x token cached before its chunk")
    t_api_serial: float | None = _override(
        "API-server seconds per request, one request at a time")
    t_api_latency: float | None = _override("API-server latency per request, in parallel")
    t_api_token: float | None = _override(
        "API-server seconds per streamed token, serial with admission")
    t_api_contended: float | None = _override(
        "API-server seconds added to the serial part of a request accepted while the "
        "engine has work")

    @field_validator("lora_modules")
    @classmethod
    def _lora_modules_as_vllm_loads_them(cls, modules: list[str],
                                         info: ValidationInfo) -> list[str]:
        # vLLM fails at start-up on each of these (vllm/entrypoints/openai/models/serving.py).
        if modules and not info.data.get("enable_lora"):
            raise PydanticCustomError("lora_disabled",
                                      "LoRA is not enabled. Use --enable-lora to enable LoRA.")
        seen: set[str] = set()
        for item in modules:
            try:
                name = parse_lora_module(item).name
            except ValueError as e:
                raise PydanticCustomError("lora_module", str(e)) from None
            if name == info.data.get("model_name"):
                raise PydanticCustomError(
                    "lora_module", "The lora adapter '{name}' conflicts with a served base "
                    "model.", {"name": name})
            if name in seen:
                raise PydanticCustomError(
                    "lora_module", "The lora adapter '{name}' has already been loaded.",
                    {"name": name})
            seen.add(name)
        return modules

    @field_validator("max_lora_rank")
    @classmethod
    def _a_rank_vllm_takes(cls, rank: int) -> int:
        if rank not in MAX_LORA_RANKS:
            raise PydanticCustomError(
                "lora_rank", "must be one of {ranks}",
                {"ranks": ", ".join(map(str, MAX_LORA_RANKS))})
        return rank

    def lora_adapters(self) -> tuple[LoraModule, ...]:
        """The adapters served, in the order given."""
        return tuple(parse_lora_module(item) for item in self.lora_modules)

    def step_profile(self) -> StepTimeProfile:
        """The named profile with this option's overrides (ValueError: unknown profile)."""
        return get_profile(self.profile).with_overrides(
            t_fixed=self.t_fixed, t_prefill_token=self.t_prefill_token,
            t_decode_seq=self.t_decode_seq, t_kv_token=self.t_kv_token,
            t_prefill_context=self.t_prefill_context, t_api_serial=self.t_api_serial,
            t_api_latency=self.t_api_latency, t_api_token=self.t_api_token,
            t_api_contended=self.t_api_contended, kv_bytes_per_token=self.kv_bytes_per_token)

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
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_loras=self.max_loras, enable_prefix_caching=self.enable_prefix_caching)

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
    def cli_declaration(cls, name: str) -> list[str]:
        """Field ``name``'s flags as click declares them: a switch with vLLM's two
        spellings (``--enable-x`` and ``--no-enable-x``) is one ``--enable-x/--no-enable-x``."""
        flags = cls.cli_flags(name)
        if len(flags) == 2 and flags[1] == "--no-" + flags[0].removeprefix("--"):
            return ["/".join(flags)]
        return flags

    @classmethod
    def cli_flags(cls, name: str) -> list[str]:
        """The command-line spellings of field ``name``."""
        extra = cls.model_fields[name].json_schema_extra
        flags = extra.get("flags") if isinstance(extra, dict) else None
        if isinstance(flags, list):
            return [str(flag) for flag in flags]
        return ["--" + name.replace("_", "-")]
