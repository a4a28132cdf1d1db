"""The check that every hooked site ran, around each forward (compiled code does not see torch hooks added after
it was traced): `arm_sites` before, `check_sites` after (`StaleCompiledHooksError` when a hooked site was silent),
`disarm_sites` to restore the flags of an enclosing forward. Split from `transformer_bridge.sites.build`."""

import torch

from ..hooks.points import HookPoint


@torch.compiler.disable
def arm_sites(live: dict) -> list:
    """Mark the attached sites as not yet run; returns ``(site, had_run)`` pairs for `check_sites` and
    `disarm_sites` (hooks added during the forward are not checked)."""
    armed = [(site, site.fired) for site in live]
    for site in live:
        site.fired = False
    return armed


@torch.compiler.disable
def disarm_sites(armed: list) -> None:
    """After a forward: a site an enclosing forward had already seen run counts as run (nested forwards)."""
    for site, had_run in armed:
        site.fired = site.fired or had_run


@torch.compiler.disable  # runs eagerly even after compiled code: it must see what really ran
def check_sites(points: dict[str, HookPoint], sites_for: dict[str, list], armed: list) -> None:
    """Raise when a hooked site did not run: compiled code traced without its hook ran instead."""
    silent = [site for site, _ in armed if site.attached and not site.fired]
    if silent:
        names = [n for n, p in points.items() if p.active and any(s in silent for s in sites_for[n])]
        raise StaleCompiledHooksError(
            f"The hooks on {names[:5]} did not run: the forward ran code compiled by `torch.compile` without "
            "them (compiled code does not see torch hooks added after it was traced). Add hooks before the "
            "first compiled call, call `torch.compiler.reset()` after changing hooks, or compile the bridge "
            "(`torch.compile(model)`), not `model.hf_model`. See docs/compile.md."
        )


class StaleCompiledHooksError(RuntimeError):
    """Hooks did not run because `torch.compile` reused code traced without them."""
