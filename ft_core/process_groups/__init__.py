"""Reconfigurable process groups: Gloo, NCCL and XCCL in this process, subprocess variants, wrappers.

Every group type is importable from here: `from ft_core.process_groups import ProcessGroupGloo`.
"""

from ft_core.process_groups.backends import ProcessGroupGloo, ProcessGroupNCCL, ProcessGroupWrapper, ProcessGroupXCCL
from ft_core.process_groups.base import COLLECTIVES, DEFAULT_TIMEOUT, CompletedWork, ProcessGroup
from ft_core.process_groups.subprocess_group import (
    ProcessGroupBaby,
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
    ProcessGroupBabyXCCL,
)
from ft_core.process_groups.wrappers import (
    ErrorSwallowingProcessGroupWrapper,
    FakeProcessGroupWrapper,
    ManagedProcessGroup,
    ProcessGroupDelegate,
    ProcessGroupDummy,
)

__all__ = [
    "COLLECTIVES", "DEFAULT_TIMEOUT", "CompletedWork", "ErrorSwallowingProcessGroupWrapper", "FakeProcessGroupWrapper",
    "ManagedProcessGroup", "ProcessGroup", "ProcessGroupBaby", "ProcessGroupBabyGloo", "ProcessGroupBabyNCCL",
    "ProcessGroupBabyXCCL", "ProcessGroupDelegate", "ProcessGroupDummy", "ProcessGroupGloo", "ProcessGroupNCCL",
    "ProcessGroupWrapper", "ProcessGroupXCCL",
]
