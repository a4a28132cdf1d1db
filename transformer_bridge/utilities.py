"""``transformer_bridge.utilities``: TransformerLens 4's name for its utils module, so that ``from
transformer_lens.utilities import get_act_name`` keeps working when ``transformer_lens`` becomes
``transformer_bridge``. The same objects as `transformer_bridge.utils` (see there, and docs/transformerlens.md).

Example:
    >>> from transformer_bridge import utilities, utils
    >>> utilities.get_act_name is utils.get_act_name
    True
"""

from .utils import *  # noqa: F403 (the same public names, one module under TransformerLens 4's name)
from .utils import __all__  # noqa: F401
