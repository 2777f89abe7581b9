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

import logging
import sys
from typing import Any, Callable

logger = logging.getLogger(__name__)

STRATEGY_NAME = "fault_tolerant_ddp"


def _register_trainer(namespace: str) -> None:
    if namespace == "lightning.pytorch":
        from lightning.pytorch.strategies import StrategyRegistry

        from ft_lightning.strategy import FaultTolerantDDPStrategy as cls
    else:
        from pytorch_lightning.strategies import StrategyRegistry  # type: ignore[no-redef]

        from ft_lightning.pytorch_lightning import FaultTolerantDDPStrategy as cls  # type: ignore[no-redef]
    cls.register_strategies(StrategyRegistry)


def _register_fabric(namespace: str) -> None:
    if namespace == "lightning.fabric":
        from lightning.fabric.strategies import STRATEGY_REGISTRY

        from ft_lightning.fabric import FaultTolerantFabricDDPStrategy as cls
    else:
        from lightning_fabric.strategies import STRATEGY_REGISTRY  # type: ignore[no-redef]

        from ft_lightning.lightning_fabric import FaultTolerantFabricDDPStrategy as cls  # type: ignore[no-redef]
    cls.register_strategies(STRATEGY_REGISTRY)


# namespace package -> how to register our strategy in it (runs once that package is imported)
REGISTRARS: dict[str, Callable[[str], None]] = {
    "lightning.pytorch": _register_trainer,
    "pytorch_lightning": _register_trainer,
    "lightning.fabric": _register_fabric,
    "lightning_fabric": _register_fabric,
}

_done: set[str] = set()


def register(namespace: str) -> bool:
    """Register the strategy in one namespace (idempotent). False, with a warning logged, on failure."""
    if namespace in _done:
        return True
    try:
        REGISTRARS[namespace](namespace)
    except Exception as exc:  # never break the user's `import lightning` because of us
        logger.warning("ft_lightning could not register %r in %s: %s: %s; pass the strategy object "
                       "instead of its name", STRATEGY_NAME, namespace, type(exc).__name__, exc)
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
        if fullname not in REGISTRARS or fullname in _done or fullname in self._busy:
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
    if _finder is not None and all(ns in _done for ns in REGISTRARS):
        try:
            sys.meta_path.remove(_finder)
        except ValueError:
            pass
        _finder = None


def install() -> None:
    """Register in the Lightning namespaces already imported; hook the others' first import."""
    global _finder
    for namespace in REGISTRARS:
        if namespace in sys.modules and getattr(sys.modules[namespace], "__spec__", None) is not None:
            # a namespace still importing (we are inside its import) is finished by the hook
            if not _importing(namespace):
                register(namespace)
    if _finder is None and not all(ns in _done for ns in REGISTRARS):
        _finder = _RegisterAfterImport()
        sys.meta_path.insert(0, _finder)


def _importing(name: str) -> bool:
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))
