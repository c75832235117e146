"""``rc_worker.protocol``: the typed protocol, where issue 9's first step named it.

The messages and their one converter live in the pure core (``rc_worker.core.protocol``,
step 2 of the same issue); this module re-exports every name of it, so both imports give
the very same classes and converter. Nothing is defined here.
"""

from __future__ import annotations

from rc_worker.core.protocol import *  # noqa: F403
from rc_worker.core.protocol import __all__ as __all__
