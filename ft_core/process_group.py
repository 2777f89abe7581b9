"""Deprecated: `ft_core.process_group` moved to `ft_core.process_groups`; this alias goes away in the next release."""

import warnings

from ft_core.process_groups import *  # noqa: F401,F403
from ft_core.process_groups import __all__  # noqa: F401

warnings.warn("ft_core.process_group is deprecated; import from ft_core.process_groups", DeprecationWarning, stacklevel=2)
