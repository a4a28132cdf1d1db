"""Optional dependencies, imported when first needed (pandas costs more than a second to import, and most
uses of the bridge never need it), with an `ImportError` that says how to get them."""

import importlib
from typing import Any


def pandas(needed_by: str) -> Any:
    """The pandas module; ``needed_by`` names what asked for it, in the error when pandas is missing.

    Example:
        >>> pd = pandas("`logits_to_df`")
    """
    try:
        return importlib.import_module("pandas")
    except ImportError as e:
        raise ImportError(f"{needed_by} needs pandas: `pip install pandas` (or transformer-bridge[patching]).") from e
