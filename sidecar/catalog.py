"""Which backends serve which model: the sidecar's map from a request's ``model`` to a pool.

A vLLM fleet serves several models, and LoRA adapters beside each base model; vLLM lists
both in ``/v1/models``. A request may only go to a backend that serves its ``model``, so the
backends that serve a model form its *pool* (``backends_for``); admission and fairness are
judged per pool (``weighbridge.sidecar.core``). Models served by the same backends share one pool: a
base model and its adapters on the same engines are one pool, not two.

What a backend serves is learned from its ``/v1/models`` (``learn``) or declared in the
config (``Backend.models``, which is never overwritten). A backend whose list is not known
yet, because it has not answered, is taken to serve every model. So before anything is
known the fleet is one pool, as a fleet of one model is, and a model is *not served*
(``backends_for`` returns an empty set: vLLM's 404) only when every backend has said what it
serves and none serves it.

A request without ``model`` gets, as vLLM gives it, a default: the config's
``default_model``, else the first model the first backend (in config order) that is known
lists, which is what vLLM itself serves such a request with on that backend.

Invariants (tests/unit/sidecar/test_catalog.py):
- ``backends_for(m)`` is the known backends listing ``m`` plus every unknown backend;
- while every backend is unknown, every model maps to all backends;
- the pools of two models are equal exactly when the same backends serve both.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

__all__ = ["ModelCatalog"]


class ModelCatalog:
    def __init__(self, backends: Sequence[str],
                 declared: Mapping[str, Sequence[str]] | None = None,
                 default_model: str | None = None) -> None:
        """``backends`` in config order; ``declared``: the models a backend is configured to
        serve (discovery does not change those)."""
        self._order = list(backends)
        self._declared = frozenset(declared or ())
        # backend -> the models it serves, in its own order; absent: unknown.
        self._served: dict[str, tuple[str, ...]] = {
            name: tuple(models) for name, models in (declared or {}).items()}
        self._default_model = default_model
        self._all = frozenset(self._order)

    @property
    def backends(self) -> frozenset[str]:
        return self._all

    def reconfigure(self, backends: Sequence[str],
                    declared: Mapping[str, Sequence[str]] | None = None) -> None:
        """A reloaded fleet (sidecar.reload): what a kept backend was learned to serve stays,
        a new one is unknown until it answers, a removed one is forgotten."""
        learned = {name: served for name, served in self._served.items()
                   if name in backends and name not in self._declared}
        self._order = list(backends)
        self._declared = frozenset(declared or ())
        self._served = {**learned, **{name: tuple(models)
                                      for name, models in (declared or {}).items()}}
        self._all = frozenset(self._order)

    def learn(self, backend: str, models: Iterable[str]) -> bool:
        """What ``backend``'s /v1/models lists (ids, adapters included); True if that
        changed the catalog. A declared backend keeps its declaration."""
        if backend not in self._all:
            raise ValueError(f"unknown backend {backend!r}")
        if backend in self._declared:
            return False
        served = tuple(dict.fromkeys(models))  # each once, in the backend's order
        if self._served.get(backend) == served:
            return False
        self._served[backend] = served
        return True

    def known(self, backend: str) -> bool:
        return backend in self._served

    def models_of(self, backend: str) -> tuple[str, ...] | None:
        """The models a backend serves, in its order; None while unknown."""
        return self._served.get(backend)

    def default_model(self) -> str | None:
        """The model a request without ``model`` is served with (module doc)."""
        if self._default_model is not None:
            return self._default_model
        for name in self._order:
            served = self._served.get(name)
            if served:
                return served[0]
        return None

    def backends_for(self, model: str | None) -> frozenset[str]:
        """The pool serving ``model`` (None: the default model's; all backends when no
        default is known). Empty: no backend serves it."""
        if model is None:
            model = self.default_model()
            if model is None:
                return self._all
        return frozenset(name for name in self._order
                         if name not in self._served or model in self._served[name])

    def models(self) -> dict[str, frozenset[str]]:
        """Every model a known backend serves -> the backends serving it (its pool)."""
        out: dict[str, set[str]] = {}
        for served in self._served.values():
            for model in served:
                out.setdefault(model, set())
        return {model: self.backends_for(model) for model in out}
