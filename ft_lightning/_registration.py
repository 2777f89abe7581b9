"""Register "fault_tolerant_ddp" in every Lightning namespace, now or when it is first imported.

Lightning finds strategy names only in registries filled by its own modules (no entry points),
so registration must run in every process before `Trainer(strategy=...)`. Importing
`ft_lightning` calls `install()`: namespaces already imported are registered at once; for the
others a tiny import hook registers them right after their package finishes importing, so
`import ft_lightning` stays cheap and never imports Lightning itself.

The opt-in `ft-lightning-autoregister` distribution calls `install()` from a `.pth` file at
interpreter start-up, which makes the string work with no import in user code.

Kept free of heavy imports (no importlib.abc, no Lightning, no torch): it may run at start-up.
"""

from __future__ import annotations

import importlib  # already imported by ft_lightning/__init__.py: free here
import sys

TYPE_CHECKING = False  # typing costs ~5 ms at start-up; annotations only
if TYPE_CHECKING:
    from typing import Any

STRATEGY_NAME = "fault_tolerant_ddp"


# namespace -> (our module, its strategy class, the namespace's registry module, registry name)
TARGETS: dict[str, tuple[str, str, str, str]] = {
    "lightning.pytorch": ("ft_lightning.strategy", "FaultTolerantDDPStrategy",
                          "lightning.pytorch.strategies", "StrategyRegistry"),
    "pytorch_lightning": ("ft_lightning.pytorch_lightning", "FaultTolerantDDPStrategy",
                          "pytorch_lightning.strategies", "StrategyRegistry"),
    "lightning.fabric": ("ft_lightning.fabric", "FaultTolerantFabricDDPStrategy",
                         "lightning.fabric.strategies", "STRATEGY_REGISTRY"),
    "lightning_fabric": ("ft_lightning.lightning_fabric", "FaultTolerantFabricDDPStrategy",
                         "lightning_fabric.strategies", "STRATEGY_REGISTRY"),
}

_done: set[str] = set()


def register(namespace: str, cls: Any = None) -> bool:
    """Register the strategy in one namespace (idempotent). False, with a warning logged, on failure.

    Our strategy modules call this with their class when they finish importing, which covers the
    case where importing one of them is what imported Lightning (the hook then finds it half-done)."""
    if namespace in _done:
        return True
    ours, class_name, registry_module, registry_name = TARGETS[namespace]
    if cls is None and _importing(ours):
        return False  # it registers itself at the end of its import
    try:
        if cls is None:
            cls = getattr(importlib.import_module(ours), class_name)
        registry = getattr(importlib.import_module(registry_module), registry_name)
        cls.register_strategies(registry)
    except Exception as exc:  # noqa: BLE001 - never break the user's `import lightning` because of us
        import logging

        logging.getLogger(__name__).warning(
            "ft_lightning could not register %r in %s: %s: %s; pass the strategy object instead of its name",
            STRATEGY_NAME, namespace, type(exc).__name__, exc)
        return False
    _done.add(namespace)
    return True


class _RegisterAfterImport:
    """A meta-path finder that never finds anything itself: for a watched package it asks the other
    finders for the spec, then wraps that loader's exec_module to register once the package ran.

    Duck-typed (importlib.abc would cost ~50 ms at start-up)."""

    def __init__(self) -> None:
        self._busy: set[str] = set()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in TARGETS or fullname in _done or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy.discard(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        inner = loader.exec_module

        def exec_module(module: Any) -> None:
            inner(module)
            register(fullname)
            _uninstall_when_done()

        # The loader object is created for this one spec, so patching the instance is local.
        loader.exec_module = exec_module
        return spec


_finder: _RegisterAfterImport | None = None


def _uninstall_when_done() -> None:
    global _finder
    if _finder is not None and all(ns in _done for ns in TARGETS):
        try:
            sys.meta_path.remove(_finder)
        except ValueError:
            pass
        _finder = None


def install() -> None:
    """Register in the Lightning namespaces already imported; hook the others' first import."""
    global _finder
    for namespace in TARGETS:
        # a namespace still importing (we are inside its import) cannot be registered yet
        if namespace in sys.modules and not _importing(namespace):
            register(namespace)
    if _finder is None and not all(ns in _done for ns in TARGETS):
        _finder = _RegisterAfterImport()
        sys.meta_path.insert(0, _finder)


def _importing(name: str) -> bool:
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))
