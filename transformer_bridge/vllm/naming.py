"""Hook names on vLLM: the points a model serves, the ones its engine fuses away, and name filters.

The names are TransformerLens' canonical names, as the HF bridge serves them. Attention scores and patterns are
not tensors vLLM's kernels produce: they are recomputed from the cached ``hook_rot_q`` / ``hook_rot_k`` of the
layers asked for (read-only). A name the HF bridge has for this family but vLLM's engine fuses away (the experts of
a fused mixture-of-experts kernel, for instance) is listed in `ServedNames.fused`, and asking for it raises
`FusedPointError` naming it.
"""

import re
from collections.abc import Callable, Iterable, Sequence

from .. import UnknownHookError

RECOMPUTED = ("attn.hook_attn_scores", "attn.hook_pattern")  # from rot_q / rot_k, on the driver
NameFilter = str | Sequence[str] | Callable[[str], bool] | None


# Points a full cache or a predicate leaves out unless they alone are asked for (the HF bridge's on-demand head
# results).
ON_DEMAND = ".attn.hook_result"


class FusedPointError(KeyError):
    """A hook point that exists in the HF model but that vLLM's engine computes inside a fused kernel."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ServedNames:
    """The names of one engine's points, in forward order, and the ones it cannot serve."""

    def __init__(self, served: Sequence[str], n_layers: int, fused: Iterable[str] = ()) -> None:
        names = list(served)
        for i in range(n_layers):  # the recomputed points sit after rot_k in each block
            anchor = f"blocks.{i}.attn.hook_rot_k"
            if anchor in names:
                at = names.index(anchor) + 1
                names[at:at] = [f"blocks.{i}.{r}" for r in RECOMPUTED]
        self.all = names
        self.fused = list(fused)
        self.n_layers = n_layers

    def check(self, name: str, param: str = "name") -> str:
        """``name`` if served; `FusedPointError` or `UnknownHookError` (with suggestions) otherwise."""
        if name in self.all:
            return name
        if name in self.fused:
            raise FusedPointError(
                f"{name!r} is fused away by vLLM's engine for this model (computed inside one kernel, never as a "
                f"tensor); run the HF bridge for it. Points fused away here: {self.fused[:6]}"
                + (" ..." if len(self.fused) > 6 else "")
            )
        raise UnknownHookError(name, self.all, param)

    def matching(self, names_filter: NameFilter, param: str = "names_filter") -> list[str]:
        """The served names a filter selects: None (all), a name, a shorthand (``"resid_post"``: every layer's), a
        list of names, or a predicate. As in the HF bridge (``use_attn_result=False``, TransformerLens' default), the
        per-head results are computed on demand: named, or matched by a predicate that matches nothing else."""
        if names_filter is None:
            return [n for n in self.all if not n.endswith(ON_DEMAND)]
        if callable(names_filter):
            names = [n for n in self.all if names_filter(n)]
            if not all(n.endswith(ON_DEMAND) for n in names):
                names = [n for n in names if not n.endswith(ON_DEMAND)]
            return names
        if isinstance(names_filter, str):
            return self._one(names_filter, param)
        if isinstance(names_filter, (list, tuple, set)):
            out: list[str] = []
            for item in names_filter:
                if not isinstance(item, str):
                    raise TypeError(f"`{param}` lists hook names (str), got {type(item).__name__}.")
                out += [n for n in self._one(item, param) if n not in out]
            return [n for n in self.all if n in out]
        raise TypeError(
            f"`{param}` must be None, a hook name, a list of names or a predicate, got {type(names_filter).__name__}."
        )

    def _one(self, name: str, param: str) -> list[str]:
        if name in self.all or name in self.fused:
            return [self.check(name, param)]
        short = name if name.startswith("hook_") or ".hook_" in name else f"hook_{name}"
        found = [n for n in self.all if re.fullmatch(rf"(.*\.)?{re.escape(short)}", n)]
        if found:
            return found
        return [self.check(name, param)]


def needed_for(names: Iterable[str]) -> set[str]:
    """The served tensors to capture for ``names``: scores and patterns need that layer's rot_q and rot_k."""
    out = set()
    for n in names:
        for r in RECOMPUTED:
            if n.endswith(r):
                block = n[: -len(r)]
                out |= {f"{block}attn.hook_rot_q", f"{block}attn.hook_rot_k"}
                break
        else:
            out.add(n)
    return out
