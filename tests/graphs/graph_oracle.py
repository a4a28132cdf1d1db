"""The perturbation oracle for graph edges: a forward of the replacement model frozen *by value* (every pattern,
norm scale and MLP output replaced by its clean value, read from a cache), with one source node's contribution
added once more. Every block is then affine in the residual stream, so the change of a target node's quantity is
exactly the edge weight: no autograd, no finite-difference step."""

import torch

from transformer_bridge.graphs import Graph, TranscoderSet
from transformer_bridge.graphs.replacement import frozen_points


class FrozenByValue:
    def __init__(self, model, tc: TranscoderSet, graph: Graph):
        self.model, self.tc, self.graph = model, tc, graph
        self.tokens = graph.tokens[None]
        names = [*frozen_points(model), "hook_embed"]
        names += [tc.input_point(layer) for layer in range(tc.n_layers)]
        names += [tc.output_point(layer) for layer in range(tc.n_layers)]
        with torch.no_grad():
            _, self.cache = model.run_with_cache(self.tokens, names_filter=[*names, "unembed.hook_out"])
        self.frozen = frozen_points(model)
        self.base = self._measure({})

    def _measure(self, deltas: dict) -> dict:
        """Run with ``deltas`` ({point: [pos, d_model] tensor}) added; return each layer's input and the pre-cap
        logits."""
        seen = {}

        def freeze(x, hook):
            return self.cache[hook.name].clone()

        def embed(x, hook):
            return self.cache["hook_embed"] + deltas.get("hook_embed", 0)

        def read(x, hook):
            seen[hook.name] = x.detach().clone()

        def write(x, hook, layer):
            clean_in = self.cache[self.tc.input_point(layer)][0]
            now_in = seen[self.tc.input_point(layer)][0]
            skip = self.tc.skip(now_in, layer) - self.tc.skip(clean_in, layer)
            return self.cache[hook.name] + skip[None] + deltas.get(hook.name, 0)

        hooks = [(n, freeze) for n in self.frozen] + [("hook_embed", embed), ("unembed.hook_out", read)]
        for layer in range(self.tc.n_layers):
            hooks += [(self.tc.input_point(layer), read),
                      (self.tc.output_point(layer), lambda x, hook, layer=layer: write(x, hook, layer))]  # fmt: skip
        with torch.no_grad(), self.model.hooks(fwd_hooks=hooks):
            self.model(self.tokens)
        return seen

    def source_deltas(self, node: int) -> dict:
        g, tc = self.graph, self.tc
        info = g.node_info(node)
        n_pos = g.n_pos
        d = tc.d_model

        def at(pos, vec):
            out = torch.zeros(1, n_pos, d)
            out[0, pos] = vec
            return out

        if info["kind"] == "feature":
            scaled = lambda out: info["activation"] * tc.decoder(info["layer"], out)[info["feature"]].detach()  # noqa: E731
            return {tc.output_point(out): at(info["pos"], scaled(out)) for out in tc.writes_to(info["layer"])}
        if info["kind"] == "error":
            layer, pos = info["layer"], info["pos"]
            name = tc.output_point(layer)
            clean_in = self.cache[tc.input_point(layer)][0]
            with torch.no_grad():
                acts = [tc.encode(self.cache[tc.input_point(i)][0], i) for i in range(layer + 1)]
                for a in acts:
                    a[: g.meta["skip_positions"]] = 0
                recon = tc.reconstruct(acts, clean_in, layer)
            return {name: at(pos, (self.cache[name][0] - recon)[pos])}
        if info["kind"] == "token":
            return {"hook_embed": at(info["pos"], self.cache["hook_embed"][0, info["pos"]])}
        raise ValueError(node)

    def quantity(self, seen: dict, node: int) -> torch.Tensor:
        g, tc = self.graph, self.tc
        info = g.node_info(node)
        if info["kind"] == "feature":
            x = seen[tc.input_point(info["layer"])][0, info["pos"]]
            return x @ tc.W_enc[info["layer"], info["feature"]].detach()
        u = seen["unembed.hook_out"][0, info["pos"]].double()
        if info["token"] >= 0:
            return u[info["token"]] - u.mean()
        raise ValueError("direction targets: measure with a direction")

    def effect(self, target: int, source: int) -> float:
        with torch.no_grad():
            seen = self._measure(self.source_deltas(source))
            return float(self.quantity(seen, target) - self.quantity(self.base, target))
