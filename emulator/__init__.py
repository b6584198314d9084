"""A vLLM-compatible engine emulator: a pure step model of continuous batching, chunked
prefill, a finite KV cache and preemption, and an HTTP face with vLLM's API and metrics.

The surface (``__all__``) is what the application and the other parts use: the step model,
its types (``engine``) and its counters (``counters``), the step-time profiles, the options
declared once (``EmulatorOptions``), the tokenizers, the parsed requests and the one rule that turns
them into the engine's sequences (``engine_sequences``), the API front end and
end-of-sequence model the virtual-time engines reuse, the HTTP server, and the real-vLLM
harness. Each name is read from its module on first use (``weighbridge.surface``), so
importing the step model loads no aiohttp.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weighbridge.surface import surface

if TYPE_CHECKING:
    from weighbridge.emulator.api import (
        EmbeddingRequest,
        GenerationRequest,
        PoolingRequest,
        embeddings_response,
    )
    from weighbridge.emulator.counters import EngineCounters
    from weighbridge.emulator.engine import (
        Batch,
        Coast,
        EngineConfig,
        Sequence,
        SequenceStatus,
        StepModel,
        StepResult,
        simulate,
    )
    from weighbridge.emulator.eos import EosModel
    from weighbridge.emulator.frontend import ApiFrontEnd
    from weighbridge.emulator.intake import ApiRequest, engine_sequences
    from weighbridge.emulator.options import EmulatorOptions
    from weighbridge.emulator.profiles import PROFILES, StepTimeProfile, get_profile
    from weighbridge.emulator.real_vllm import RealVllmServer
    from weighbridge.emulator.server import Emulator, EmulatorSettings, run_emulator
    from weighbridge.emulator.tokenizer import RULE, ModelTokenizer
else:
    __getattr__, __dir__ = surface(__name__, {
        "api": ("EmbeddingRequest", "GenerationRequest", "PoolingRequest",
                "embeddings_response"),
        "counters": ("EngineCounters",),
        "engine": ("Batch", "Coast", "EngineConfig", "Sequence", "SequenceStatus", "StepModel",
                   "StepResult", "simulate"),
        "eos": ("EosModel",),
        "frontend": ("ApiFrontEnd",),
        "intake": ("ApiRequest", "engine_sequences"),
        "options": ("EmulatorOptions",),
        "profiles": ("PROFILES", "StepTimeProfile", "get_profile"),
        "real_vllm": ("RealVllmServer",),
        "server": ("Emulator", "EmulatorSettings", "run_emulator"),
        "tokenizer": ("ModelTokenizer", "RULE"),
    })

__all__ = [
    "PROFILES",
    "RULE",
    "ApiFrontEnd",
    "ApiRequest",
    "Batch",
    "Coast",
    "EmbeddingRequest",
    "Emulator",
    "EmulatorOptions",
    "EmulatorSettings",
    "EngineConfig",
    "EngineCounters",
    "EosModel",
    "GenerationRequest",
    "ModelTokenizer",
    "PoolingRequest",
    "RealVllmServer",
    "Sequence",
    "SequenceStatus",
    "StepModel",
    "StepResult",
    "StepTimeProfile",
    "embeddings_response",
    "engine_sequences",
    "get_profile",
    "run_emulator",
    "simulate",
]
