"""The kinds of request vLLM's OpenAI-compatible server takes, and the paths it serves each on.

A kind is named by its path, the one configs, rate limits and output estimates key on; vLLM
also serves some kinds on other paths (``/v1/score`` for ``/score``; ``/v1/rerank`` and
Cohere's ``/v2/rerank`` for ``/rerank``), which are the same kind: a limit on a kind holds
on every path it is served on. The sidecar, the emulator and the simulator read a body by
its kind, never by a test on its path's spelling.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["EndpointKind"]


class EndpointKind(StrEnum):
    """What a request asks the engine for. Generation kinds run one sequence that decodes
    (or ``n``); the others run on vLLM's pooling runner, one prefill-only sequence per
    input, and generate nothing: they cost their input tokens."""

    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"
    EMBEDDINGS = "/v1/embeddings"
    POOLING = "/pooling"
    CLASSIFY = "/classify"
    SCORE = "/score"
    RERANK = "/rerank"

    @classmethod
    def of_path(cls, path: str) -> EndpointKind | None:
        """The kind served on ``path``, or None for a path that serves no request."""
        return _BY_PATH.get(path)

    @classmethod
    def served_paths(cls) -> tuple[str, ...]:
        """Every path some kind is served on, each kind's own first."""
        return tuple(_BY_PATH)

    @property
    def paths(self) -> tuple[str, ...]:
        """The paths vLLM serves this kind on, its own first."""
        return (self.value, *_ALIASES.get(self, ()))

    @property
    def generates(self) -> bool:
        """It decodes output tokens (and may stream them); else it is prefill only."""
        return self in (EndpointKind.COMPLETIONS, EndpointKind.CHAT)

    @property
    def scores_pairs(self) -> bool:
        """It scores documents against queries (``/score``, ``/rerank``); else each input is
        its own prompt."""
        return self in (EndpointKind.SCORE, EndpointKind.RERANK)


# vLLM 0.32's other paths for a kind (vllm/entrypoints/pooling/scoring/api_router.py).
_ALIASES: dict[EndpointKind, tuple[str, ...]] = {
    EndpointKind.SCORE: ("/v1/score",),
    EndpointKind.RERANK: ("/v1/rerank", "/v2/rerank"),
}
_BY_PATH: dict[str, EndpointKind] = {path: kind for kind in EndpointKind
                                     for path in kind.paths}
