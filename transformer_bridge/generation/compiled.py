"""How the one-token decode step is compiled: the ``torch.compile`` options and one inductor graph pass.

`compile_options` gives the options `fast.compiled_step` compiles the step with. On CUDA that is mode
``"reduce-overhead"`` (CUDA graphs). On CPU it is inductor's defaults plus `RowTimesMatrix`, a
post-grad graph pass over the step's matrix products ``[b, k] @ [k, n]`` by a row-major weight
(every linear layer and the unembedding of a decode step of ``b`` rows):

- one row (batch 1): a multiply and a sum over ``k``, which inductor compiles into one vectorised
  reduction. A decode step at batch 1 is bound by reading the weights, and on the CPUs measured here
  BLAS reads them at about 12 GB/s for a single row (its matrix-vector path), the generated reduction
  at about 20 GB/s (docs/benchmarks.md);
- several rows (batch > 1, fp32): `packed.packed_mm`, oneDNN with the weight packed once into its
  blocked layout (a SmolLM2 batch-8 step's products: ~44 ms instead of BLAS's ~75 ms). The packed copy
  is re-packed whenever the weight changes (see `packed`).

Other products (a symbolic size, GPT-2's Conv1D layout, an activation times an activation) keep BLAS;
the prefill is not compiled.

The weights stay inputs of the compiled graph (nothing is frozen into it), so editing a weight after
compiling is seen by the next step. The sums run in another order than BLAS's: logits move by ~1e-5
to ~1e-4 (SmolLM2, batch 8), as with any inductor kernel.
"""

from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import packed

aten = torch.ops.aten


def _fake(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, Node) else None


class RowTimesMatrix(CustomGraphPass):
    """Inductor post-grad pass: ``mm(a, b)`` / ``addmm(c, a, b)`` with ``b`` the transpose of a row-major matrix
    (fp32/bf16/fp16 on CPU) becomes ``sum(a * b.T, -1)`` when ``a`` has one row, which inductor compiles into
    a reduction reading ``b`` once, row by row; with several rows, an fp32 ``b`` that is a graph input (a
    weight) goes to `packed.packed_mm` (oneDNN, packed weights).

    Example:
        >>> import torch
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> gm = make_fx(lambda a, w: torch.mm(a, w.t()), tracing_mode="fake")(torch.ones(1, 4), torch.ones(3, 4))
        >>> RowTimesMatrix()(gm.graph)
        >>> sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        ['aten.mul.Tensor', 'aten.permute.default', 'aten.sum.dim_IntList', 'aten.t.default']
    """

    rewrites = 0  # one-row products rewritten in this process (not counted when inductor's cache serves a graph)
    packs = 0  # products of several rows sent to `packed.packed_mm`

    def __call__(self, graph: Graph) -> None:
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default):
                continue
            bias, (a, b) = (None, node.args[:2]) if node.target is aten.mm.default else (node.args[0], node.args[1:3])
            if node.kwargs or not _transposed_on_cpu(_fake(a), _fake(b)):
                continue  # addmm with beta/alpha keeps BLAS
            rows = _fake(a).shape[0]
            if statically_known_true(rows == 1):
                new = _row_times_matrix(graph, node, a, b)
                RowTimesMatrix.rewrites += 1
            elif (statically_known_true(rows >= packed.MIN_ROWS) and packed.packable(_fake(b))
                  and _graph_input(b)):  # fmt: skip
                new = _packed_product(graph, node, a, b)
                RowTimesMatrix.packs += 1
            else:
                continue
            if bias is not None:
                with graph.inserting_before(node):
                    new.append(graph.call_function(aten.add.Tensor, (bias, new[-1])))
            for added in new:
                added.meta["val"] = _meta(added)
            node.replace_all_uses_with(new[-1])
            graph.erase_node(node)

    def uuid(self) -> bytes:
        # inductor's cache key: the sources, and the threshold the pass reads
        return get_hash_for_files((__file__, packed.__file__)) + str(packed.MIN_ROWS).encode()


def _row_times_matrix(graph: Graph, node: Node, a: Node, b: Node) -> list[Node]:
    with graph.inserting_before(node):
        new = [graph.call_function(aten.permute.default, (b, [1, 0]))]  # [n, k]: rows of the weight
        new.append(graph.call_function(aten.mul.Tensor, (a, new[-1])))  # [1, k] * [n, k] -> [n, k]
        new.append(graph.call_function(aten.sum.dim_IntList, (new[-1], [1], True)))  # [n, 1]
        new.append(graph.call_function(aten.permute.default, (new[-1], [1, 0])))  # [1, n]
    return new


def _packed_product(graph: Graph, node: Node, a: Node, b: Node) -> list[Node]:
    with graph.inserting_before(node):
        new = [graph.call_function(aten.permute.default, (b, [1, 0]))]  # [n, k]: the weight itself
        new.append(graph.call_function(torch.ops.transformer_bridge.packed_mm.default, (a, new[-1])))
    return new


def _graph_input(node: Any) -> bool:
    """Whether ``node`` is a graph input (a weight), seen through views: only those are worth packing once."""
    while isinstance(node, Node) and node.op == "call_function" and node.target in _VIEWS:
        node = node.args[0]
    return isinstance(node, Node) and node.op == "placeholder"


_VIEWS = (aten.permute.default, aten.t.default, aten.view.default, aten._unsafe_view.default)


def _transposed_on_cpu(a: Any, b: Any) -> bool:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    # b.stride(0) == 1: b is the transpose of a row-major weight [n, k] (nn.Linear), so the sum reads each
    # weight row in order; a row-major [k, n] (GPT-2's Conv1D) would be read across rows, slower than BLAS.
    # statically_known_true: a symbolic size (a dynamic graph) is left to BLAS rather than guarded on here.
    return (a.dim() == 2 and b.dim() == 2 and a.device.type == "cpu" and b.device.type == "cpu"
            and a.dtype == b.dtype and a.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and statically_known_true(b.stride(0) == 1))  # fmt: skip


def _meta(node: Node) -> Any:
    """The fake value of a node added by the pass, computed from its inputs' fake values."""
    args = [_fake(x) if isinstance(x, Node) else x for x in node.args]
    fake = next(x for x in args if isinstance(x, torch.Tensor))
    mode = getattr(fake, "fake_mode", None)
    if mode is None:
        return node.target(*args)
    with mode:
        return node.target(*args)


def compile_options(device: torch.device) -> dict[str, Any]:
    """Keyword arguments of ``torch.compile`` for the decode step on ``device``.

    Example:
        >>> sorted(compile_options(torch.device("cpu"))["options"])
        ['post_grad_custom_pre_pass']
        >>> compile_options(torch.device("cuda"))
        {'mode': 'reduce-overhead'}
    """
    if device.type == "cuda":
        return {"mode": "reduce-overhead"}
    if device.type == "cpu":
        return {"options": {"post_grad_custom_pre_pass": RowTimesMatrix()}}
    return {}
