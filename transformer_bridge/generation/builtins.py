"""Small built-in controllers: `force` (append a text in one forward) and `stop_on` (stop a row on a string,
a token or a condition). Each can wrap another controller (``then=``), which decides the other steps.

Example:
    >>> c = force(' {"answer": ', then=stop_on("}"))
    >>> model.generate("Q: 2+2? A:", max_new_tokens=12, controller=c)
"""

from collections.abc import Callable
from typing import Any

from ..checks import ArgumentTypeError, describe, is_int
from .branch import Branch, View


def _call(controller: Any, view: View) -> Any:
    if controller is None:
        return None
    fn = getattr(controller, "mid_process", None) or controller
    return fn(view)


def _bind(controller: Any, model: Any) -> Any:
    bind = getattr(controller, "bind", None)
    return bind(model) if callable(bind) else controller


def _fork(controller: Any) -> Any:
    fork = getattr(controller, "fork", None)
    return fork() if callable(fork) else controller


class _Wrapper:
    """Shared plumbing: the wrapped controller's ``reads``, ``bind``, ``fork`` and ``appended``."""

    then: Any = None

    @property
    def reads(self) -> list[str]:
        return list(getattr(self.then, "reads", ()))

    def appended(self, generated: list[int]) -> None:
        notify = getattr(self.then, "appended", None)
        if callable(notify):
            notify(generated)


class force(_Wrapper):  # noqa: N801 - used like a function: `controller=force("text")`
    """Append ``text`` (its tokens, in one forward) at the first step, then let ``then`` decide.

    Example:
        >>> model.generate("The answer is", max_new_tokens=8, controller=force(" forty"))
    """

    def __init__(self, text: str, then: Any = None) -> None:
        if not isinstance(text, str) or not text:
            raise ArgumentTypeError(f"`text` must be a non-empty str, got {describe(text)}.")
        self.text, self.then, self.ids, self.done = text, then, None, False

    def bind(self, model: Any) -> "force":
        out = force(self.text, _bind(self.then, model))
        out.ids = model.tokenizer.encode(self.text, add_special_tokens=False)
        return out

    def fork(self) -> "force":
        out = force(self.text, _fork(self.then))
        out.ids, out.done = self.ids, self.done
        return out

    def mid_process(self, view: View) -> Any:
        if not self.done:
            if self.ids is None:
                raise ValueError("`force` is not bound to a model: pass it to `generate(..., controller=...)`.")
            self.done = True
            return Branch.forced(self.ids)
        return _call(self.then, view)


class stop_on(_Wrapper):  # noqa: N801 - used like a function: `controller=stop_on("\n")`
    """Stop a row when its generated text contains one of the strings, it produces one of the token ids,
    or ``when(view)`` is true (finish reason ``"controller"``); otherwise let ``then`` decide.

    Example:
        >>> c = stop_on("\\n\\n", when=lambda v: len(v.generated) > 30)
        >>> model.generate("List:", max_new_tokens=40, controller=c)
    """

    def __init__(self, *stops: str | int, when: Callable[[View], bool] | None = None, then: Any = None) -> None:
        for s in stops:
            if not (isinstance(s, str) and s) and not is_int(s):
                raise ArgumentTypeError(f"`stop_on` takes non-empty strings and token ids, got {describe(s)}.")
        if when is not None and not callable(when):
            raise ArgumentTypeError(f"`when` must be a callable `f(view) -> bool`, got {describe(when)}.")
        self.stops, self.when, self.then = stops, when, then
        self.strings = [s for s in stops if isinstance(s, str)]
        self.ids = {int(s) for s in stops if not isinstance(s, str)}
        self.decode: Callable | None = None

    def bind(self, model: Any) -> "stop_on":
        out = stop_on(*self.stops, when=self.when, then=_bind(self.then, model))
        out.decode = model.tokenizer.decode if model.tokenizer is not None else None
        if self.strings and out.decode is None:
            raise ValueError("`stop_on` with strings needs the model's tokenizer, and this bridge has none.")
        return out

    def fork(self) -> "stop_on":
        out = stop_on(*self.stops, when=self.when, then=_fork(self.then))
        out.decode = self.decode
        return out

    def mid_process(self, view: View) -> Any:
        generated = view.generated
        if generated and generated[-1] in self.ids:
            return []
        if self.strings and generated and any(s in self.decode(generated) for s in self.strings):
            return []
        if self.when is not None and self.when(view):
            return []
        return _call(self.then, view)
