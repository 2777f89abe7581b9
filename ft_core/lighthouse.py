"""Deprecated: `ft_core.lighthouse` moved to `ft_core.control.lighthouse`; this alias goes away in the next release."""

import warnings

from ft_core.control.lighthouse import *  # noqa: F401,F403
from ft_core.control.lighthouse import __all__  # noqa: F401

warnings.warn("ft_core.lighthouse is deprecated; import from ft_core.control.lighthouse", DeprecationWarning, stacklevel=2)
