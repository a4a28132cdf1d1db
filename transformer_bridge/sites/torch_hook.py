"""`TorchHook`: what every site shares — one torch hook on one module, attached only while a point it serves
has a function (so an unhooked model runs HF's own code)."""

from torch import nn
from torch.utils.hooks import RemovableHandle

from ..hooks.points import HookPoint


class TorchHook:
    """Base of the sites: ``module``, the ``served`` points, and the ``handle`` of the torch hook `_register` adds.

    Subclasses set those three attributes and implement `_register`.
    """

    module: nn.Module
    served: list[HookPoint]
    handle: RemovableHandle | None

    def _register(self) -> RemovableHandle:
        raise NotImplementedError

    @property
    def attached(self) -> bool:
        return self.handle is not None

    def sync(self) -> None:
        """Attach the torch hook iff a point this site serves has a function (idempotent)."""
        wanted = any(point.active for point in self.served)
        if wanted and self.handle is None:
            self.handle = self._register()
        elif not wanted:
            self.detach()

    def detach(self) -> None:
        """Remove the torch hook whatever the points say (undone by `sync`)."""
        if self.handle is not None:
            self.handle.remove()  # idempotent, so a failure after it is healed by syncing again
            self.handle = None
