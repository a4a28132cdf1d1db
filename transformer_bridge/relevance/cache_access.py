"""Reading what a method needs from an `ActivationCache`, with an error that says how to get it."""

from collections.abc import Sequence

from torch import Tensor

from ..cache.activation_cache import ActivationCache


class MissingHookError(KeyError):
    """A relevance method needs hook points that the cache does not hold.

    ``missing`` lists them; the message shows the ``names_filter`` that requests them.
    """

    def __init__(self, method: str, missing: Sequence[str], detail: str = "", no_cache: bool = False) -> None:
        self.method = method
        self.missing = list(missing)
        shown = self.missing if len(self.missing) <= 6 else [*self.missing[:6], f"… ({len(self.missing)} in all)"]
        where = "no cache was given" if no_cache else "the cache lacks them"
        how = (
            f"Request them when generating: `model.forward_pass(..., names_filter=relevance_hooks(model, "
            f"{method!r}{', ' + detail if detail else ''}))` (from transformer_bridge.relevance), or "
            "names_filter=None for everything; with `run_with_cache`, pass the same `names_filter`."
        )
        super().__init__(f"Method {method!r} reads hook points {shown}, but {where}. {how}")

    def __str__(self) -> str:
        return str(self.args[0])


def require(cache: ActivationCache | None, names: Sequence[str], method: str, detail: str = "") -> dict[str, Tensor]:
    """``{name: tensor}`` for every name, or `MissingHookError` listing the absent ones."""
    if cache is None:
        raise MissingHookError(method, names, detail, no_cache=True)
    missing = [n for n in names if n not in cache]
    if missing:
        raise MissingHookError(method, missing, detail)
    return {n: cache[n] for n in names}
