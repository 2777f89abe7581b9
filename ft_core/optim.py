"""Optimizer wrapper: the quorum starts at zero_grad, the step applies only when the group commits."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch.optim

from ft_core.errors import ConfigError

if TYPE_CHECKING:
    from ft_core.manager import Manager


class OptimizerWrapper(torch.optim.Optimizer):
    """Wraps `optimizer` so a custom loop needs no explicit Manager calls.

    `zero_grad()` starts the (async) quorum, overlapping the forward pass; `step()` runs the
    inner step only if `manager.should_commit()` votes True. `committed` tells what the last step did.
    """

    def __init__(self, manager: "Manager", optimizer: torch.optim.Optimizer) -> None:
        # Deliberately no super().__init__: param_groups/state belong to the inner optimizer.
        self.manager = manager
        self.optim = optimizer
        self.committed = False

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.manager.start_quorum()
        self.optim.zero_grad(set_to_none)

    def step(self, closure: Callable[[], float] | None = None) -> None:
        if closure is not None:
            raise ConfigError("OptimizerWrapper.step does not support closures: compute the loss in the loop, "
                              "then call step() with no argument")
        self.committed = self.manager.should_commit()
        if self.committed:
            self.optim.step()

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optim.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optim.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optim.state = value

    def __repr__(self) -> str:
        return f"OptimizerWrapper({self.optim!r})"
