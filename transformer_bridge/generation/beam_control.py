"""Controllers in beam search: `BeamControl`, what `beams.beam_search` asks at every step when a controller is given.

Beam search keeps ``num_beams`` rows per prompt and reorders them at every step, so a controller there can
do what fits one token per row and step: **mask** (``Branch.sample(mask)``: the beam's continuations are
scored among those tokens only, after the processors and before the warpers, as in the plain loop),
**force** (``Branch.forced(tokens)``, or a sampled token that starts one of the branch's ``ff_tokens``: the
beam's next steps are restricted to those tokens, one per step, without asking the controller), and
**stop** (no branch: the beam ends as it stands and competes, length-penalised, with the beams that
ended at EOS; finish reason ``"controller"``). A backtrack or a fork has no meaning for beams (the beams
are the fork) and raises.

Each beam slot has its controller; when the beams are reordered, a slot takes its parent's controller
(``fork()``-ed when two slots continue the same parent). A grammar follows the row's tokens, so it is
always in step with the beam it masks.

Example:
    >>> model.generate("Answer in JSON: ", max_new_tokens=30, num_beams=3, controller=grammar.json_schema(s))
"""

from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from .branch import View, as_branches, check_branch, samples
from .control import ControllerError, own_copy


class BeamControl:
    """Per-beam controllers, forced-token queues and reads (see the module docstring).

    ``controllers`` holds one controller per beam row (``batch * num_beams``, in the beams' row order).
    """

    def __init__(self, controllers: list[Any]) -> None:
        self.controllers = controllers
        self.queues: list[list[int]] = [[] for _ in controllers]  # forced tokens still to come, per beam
        self.follow: list[list[list[int]]] = [[] for _ in controllers]  # this step's ff sequences, per beam
        self.names = list(dict.fromkeys(n for c in controllers for n in getattr(c, "reads", ())))
        self.captured: dict[str, Tensor] = {}
        self.hooks = [(n, self._capture(n)) for n in self.names]

    def _capture(self, name: str) -> Callable:
        def hook(tensor: Tensor, hook: Any) -> None:
            self.captured[name] = tensor.detach()

        return hook

    def allowed(
        self,
        logits: Float[Tensor, "rows d_vocab"],
        tokens: Int[Tensor, "rows pos"],
        real: Int[Tensor, "rows pos"],
        prompt_width: int,
        step: int,
        alive: Bool[Tensor, " rows"],
    ) -> tuple[Bool[Tensor, "rows d_vocab"], Bool[Tensor, " rows"]]:
        """Ask each live beam's controller (or its forced queue): the tokens it may take, and whether it stops.

        A beam that is not ``alive`` (its score is -inf: every controller of its prompt stopped) is not asked."""
        rows, d_vocab = logits.shape
        mask = torch.ones((rows, d_vocab), dtype=torch.bool)
        stop = torch.zeros(rows, dtype=torch.bool)
        seqs = [[t for t, r in zip(ts, rs, strict=True) if r] for ts, rs in zip(tokens.tolist(), real.tolist(),
                                                                                   strict=True)]  # fmt: skip
        prompt_lengths = real[:, :prompt_width].sum(-1).tolist()
        for i, live in enumerate(alive.tolist()):
            self.follow[i] = []
            if not live:
                continue
            if self.queues[i]:
                mask[i] = False
                mask[i, self.queues[i][0]] = True
                continue
            generated = seqs[i][prompt_lengths[i] :]
            reads = {n: _newest(t[i], n) for n, t in self.captured.items()}
            view = View(i, step, seqs[i], prompt_lengths[i], 0, -1, 0, generated[-1:], logits[i], reads)
            c = self.controllers[i]
            try:
                result = (getattr(c, "mid_process", None) or c)(view)
            except Exception as e:
                raise ControllerError(
                    f"The controller raised at beam row {i}, step {step}: {type(e).__name__}: {e}. The generation "
                    "stopped; every hook it added was removed."
                ) from e
            where = f"The controller's branch for beam row {i} at step {step}"
            branches = as_branches(result, where)
            if not branches:
                stop[i] = True
                continue
            if len(branches) > 1 or branches[0].backtrack:
                raise ValueError(
                    f"{where}: with `num_beams` > 1 a controller can mask, force and stop, not "
                    f"{'fork' if len(branches) > 1 else 'backtrack'} (the beams are the search's own forks). "
                    "Use `num_beams=1` for a controller that forks or backtracks."
                )
            b = branches[0]
            allowed = check_branch(b, len(generated), d_vocab, where)
            if not samples(b):
                mask[i] = False
                mask[i, int(b.ff_tokens[0][0])] = True
            elif allowed is not None:
                mask[i] = allowed
            self.follow[i] = [[int(t) for t in s] for s in b.ff_tokens if len(s)]
        return mask.to(logits.device), stop.to(logits.device)

    def reorder(self, parents: Int[Tensor, " rows"], chosen: Int[Tensor, " rows"]) -> None:
        """The beams continue ``parents`` with ``chosen``: each slot takes its parent's controller and queue."""
        controllers, queues, taken = [], [], set()
        for p, t in zip(parents.tolist(), chosen.tolist(), strict=True):
            c = self.controllers[p]
            controllers.append(own_copy(c) if p in taken else c)
            taken.add(p)
            if self.queues[p]:
                queues.append(self.queues[p][1:])
            else:
                queues.append(next((s[1:] for s in self.follow[p] if s[0] == t), []))
        self.controllers, self.queues = controllers, queues


def _newest(tensor: Tensor, name: str) -> Tensor:
    """A row's activation at its newest position (the pattern and scores: the last query)."""
    axis = 1 if name.endswith(("hook_pattern", "hook_attn_scores")) else 0
    return tensor.narrow(axis, tensor.shape[axis] - 1, 1)
