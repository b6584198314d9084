"""What the engine runs for an API request: its sequences.

The emulator's handlers (``emulator/server.py``) and the virtual-time engines
(``weighbridge/app/simulation``) both turn a parsed request into the step model's
:class:`~weighbridge.emulator.engine.Sequence` objects here, so a request is the same work
to the engine live and in simulation. A completion or a chat is one sequence whose output
length the end-of-sequence model draws; a pooling request (embeddings, ``/pooling``,
``/classify``, ``/score``, ``/rerank``) is one pooling sequence per input, its prompt tokens
only, as vLLM's pooling runner runs each input as a prefill-only request (a rerank's query
and each of its documents are inputs). Pure: no clock, no I/O (the caller passes the
arrival time and its EOS model).
"""

from __future__ import annotations

from weighbridge.emulator.api import GenerationRequest, PoolingRequest
from weighbridge.emulator.engine import SchedulingPolicy, Sequence
from weighbridge.emulator.eos import EosModel

__all__ = ["ApiRequest", "engine_sequences"]

ApiRequest = GenerationRequest | PoolingRequest


def engine_sequences(request: ApiRequest, request_id: str, arrival_s: float, eos: EosModel,
                     policy: SchedulingPolicy) -> list[Sequence]:
    """The sequences the engine runs for ``request``, which arrived at ``arrival_s``.

    A generation request is one sequence named ``request_id`` (its length drawn from
    ``eos``, which is ``max_tokens`` under ``ignore_eos``); its prompt ids are what the
    prefix cache hashes, and none (an empty tuple) gives it content of its own. A pooling
    request is one pooling sequence per input, ``{request_id}-{i}``, whose one output is
    the pooled state at the end of its prefill. Under ``fcfs`` the engine queues
    every sequence at priority 0 (vLLM's FCFS queue ignores the field).
    """
    priority = request.priority if policy == "priority" else 0
    if isinstance(request, PoolingRequest):
        return [Sequence(request_id=f"{request_id}-{i}", prompt_tokens=len(ids),
                         target_output_tokens=1, max_tokens=1, arrival_s=arrival_s,
                         pooling=True, priority=priority, lora=request.lora, prompt_ids=ids)
                for i, ids in enumerate(request.input_ids)]
    return [Sequence(request_id=request_id, prompt_tokens=request.prompt_tokens,
                     target_output_tokens=eos.output_tokens(request.max_tokens,
                                                            request.ignore_eos),
                     max_tokens=request.max_tokens, arrival_s=arrival_s, priority=priority,
                     lora=request.lora, prompt_ids=request.prompt_ids or None)]
