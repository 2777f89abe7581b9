"""Deprecated: `ft_core.manager_server` moved to `ft_core.control.manager_server`; this alias goes away in the next release."""

import warnings

from ft_core.control.manager_server import *  # noqa: F401,F403
from ft_core.control.manager_server import __all__  # noqa: F401

warnings.warn("ft_core.manager_server is deprecated; import from ft_core.control.manager_server", DeprecationWarning, stacklevel=2)
