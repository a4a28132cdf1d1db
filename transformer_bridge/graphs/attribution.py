"""`attribute`: an attribution graph from one forward of the frozen replacement model and batched backward passes.

One forward (batch 1) runs with hooks that detach patterns and norm scales, make the token embeddings and each MLP
output's non-linear part leaves of autograd, and keep each transcoder input and the unembedding input. A chunk of
target nodes (features: their encoder rows at their input; targets: their directions at the unembedding input) is
one ``torch.autograd.grad`` call with ``is_grads_batched`` (one gradient row per target node, the forward's saved
tensors shared). A row's edges are the gradient at each source's point contracted with the source's vector:
``a_f W_dec_f`` (every layer a cross-layer feature writes to), the error vector, the token embedding. Rows are
kept sparse (all non-zero edges, or the top ``edges_per_node``), so memory follows the edges kept.
"""

import time

import torch
from jaxtyping import Float
from torch import Tensor

from .graph import Graph
from .influence import partial_influence
from .replacement import check_points, freeze_hooks
from .targets import Sequence, as_sequence, resolve_targets, target_vectors, token_label
from .transcoders import TranscoderSet


class _Forward:
    """The attribution forward's tensors: leaves (sources) and the points target rows are seeded at."""

    def __init__(self, model, tc: TranscoderSet, tokens: Tensor, skip_positions: int, zero_skipped_errors: bool):
        self.tc, self.inputs, self.leaves, self.acts, self.errors = tc, {}, {}, {}, {}
        self.zero_skipped = skip_positions if zero_skipped_errors else 0
        hooks = freeze_hooks(model) + _score_input_hooks(model)
        hooks.append(("hook_embed", self._embed))
        hooks.append(("unembed.hook_in", self._unembed))
        for layer in range(tc.n_layers):
            hooks.append((tc.input_point(layer), lambda x, hook, layer=layer: self._read(x, layer, skip_positions)))
            hooks.append((tc.output_point(layer), lambda x, hook, layer=layer: self._write(x, layer)))
        with torch.enable_grad(), model.hooks(fwd_hooks=hooks):
            self.logits = model(tokens[None].to(model.cfg.device))[0].detach()

    def _embed(self, e, hook):
        self.embed = e.detach().requires_grad_(True)
        return self.embed

    def _unembed(self, h, hook):
        self.final = h

    def _read(self, x, layer, skip_positions):
        self.inputs[layer] = x
        with torch.no_grad():
            acts = self.tc.encode(x[0].to(self.tc.W_enc.dtype), layer)
            acts[:skip_positions] = 0
        self.acts[layer] = acts

    def _write(self, out, layer):
        tc, x = self.tc, self.inputs[layer]
        skip = tc.skip(x.to(tc.W_enc.dtype), layer).to(out.dtype)
        with torch.no_grad():
            recon = tc.reconstruct([self.acts[i] for i in range(layer + 1)], x[0].to(tc.W_enc.dtype), layer)
            self.errors[layer] = (out[0] - recon.to(out.dtype)).detach()
            self.errors[layer][: self.zero_skipped] = 0
        self.leaves[layer] = (out - skip).detach().requires_grad_(True)
        return skip + self.leaves[layer]


def _score_input_hooks(model) -> list:
    """Detach what the attention scores read (post-RoPE queries and keys, else the projections). The pattern is
    frozen anyway, so no gradient is lost; autograd then keeps no ``[head, pos, pos]`` tensor of the softmax path,
    only the pattern that multiplies the values."""
    hooks = []
    for layer in range(model.cfg.n_layers):
        prefix = f"blocks.{layer}.attn."
        for name in ("hook_rot_q", "hook_rot_k") if prefix + "hook_rot_q" in model.hook_dict else ("hook_q", "hook_k"):
            if prefix + name in model.hook_dict:
                hooks.append((prefix + name, lambda x, hook: x.detach()))
    return hooks


def attribute(
    model,
    input,
    transcoders: TranscoderSet,
    *,
    targets=None,
    positions=None,
    max_n_logits: int = 10,
    desired_logit_prob: float = 0.95,
    batch_size: int = 64,
    max_feature_nodes: int | None = None,
    edges_per_node: int | None = None,
    skip_positions: int = 1,
    zero_skipped_errors: bool = False,
    update_interval: int = 4,
    backward_mb: float = 512,
) -> Graph:
    """The attribution graph of ``input`` in the replacement model of ``model`` with ``transcoders``.

    Args:
        model: a `TransformerBridge` (any family with attention layers).
        input: token ids, text, or the ``(output, cache)`` of ``generate(..., return_cache=True)`` (one row).
        transcoders: a `TranscoderSet` whose points the model serves.
        targets: None (the most probable tokens at each of ``positions``: up to ``max_n_logits``, until their
            probability reaches ``desired_logit_prob``; for a generation with no ``positions``, every generated
            token where it was predicted), token ids (at each of ``positions``), or a list of `Target`.
        positions: target positions (int or list; negative counts from the end); default the last.
        batch_size: target nodes per backward pass.
        max_feature_nodes: keep only this many features, chosen by influence on the targets as rows are computed
            (circuit-tracer's order); None keeps every active feature.
        edges_per_node: keep the largest ``|weight|`` edges per row; None keeps every non-zero edge.
        skip_positions: features of the first positions are not nodes (their MLP output is all error), as
            circuit-tracer drops the first token's.
        backward_mb: torch's batching rule broadcasts each attention pattern over the rows of a backward pass
            (``rows × heads × pos²`` floats); rows per pass are capped so that this stays under ``backward_mb``.
        zero_skipped_errors: also zero the error nodes of those positions (circuit-tracer's graphs: the first
            position's MLP outputs then belong to no node); False keeps them, so the graph stays complete.

    Returns:
        A `Graph`: features, error nodes, token nodes and targets, with sparse direct-effect edges.

    Example:
        >>> tc = TranscoderSet.random(model, d_transcoder=64, seed=0)
        >>> graph = attribute(model, "The capital of France is", tc, max_n_logits=3)
        >>> out, cache = model.generate("Once", max_new_tokens=8, return_cache=True, return_type="tokens")
        >>> gen_graph = attribute(model, (out, cache), tc)          # every generated token is a target
    """
    check_points(model, transcoders)
    if batch_size < 1:
        raise ValueError(f"`batch_size` must be >= 1, got {batch_size}")
    start = time.perf_counter()
    seq: Sequence = as_sequence(model, input)
    tc = transcoders
    fwd = _Forward(model, tc, seq.tokens, skip_positions, zero_skipped_errors)
    n_layers, n_pos = tc.n_layers, len(seq.tokens)
    tokenizer = getattr(model, "tokenizer", None)
    tlist = resolve_targets(seq, fwd.logits, targets, positions, max_n_logits, desired_logit_prob, tokenizer)
    unembed = model.hf_model.get_output_embeddings().weight.detach()
    tvecs = target_vectors(tlist, unembed.to(fwd.final.dtype))
    tpos = torch.tensor([t.pos for t in tlist], dtype=torch.long)

    # active features, layer by layer: (layer, pos, feature), activation, encoder row
    layer_of, pos_of, feat_of, act_of = [], [], [], []
    for layer in range(n_layers):
        sp = TranscoderSet.sparse(fwd.acts[layer])
        layer_of.append(torch.full_like(sp.pos, layer))
        pos_of.append(sp.pos), feat_of.append(sp.feature), act_of.append(sp.value)
    f_layer, f_pos, f_feat, f_act = (torch.cat(t) for t in (layer_of, pos_of, feat_of, act_of))
    n_feat = len(f_layer)
    sources = _Sources(tc, fwd, f_layer, f_pos, f_feat, f_act, n_pos)
    n_cols = n_feat + n_layers * n_pos + n_pos

    rows, cols, vals = [], [], []

    step = max(1, int(backward_mb * 2**20) // (4 * max(model.cfg.n_heads, 1) * n_pos * n_pos))

    def run(kind: str, index: Tensor, row_ids: Tensor) -> None:
        for i in range(0, len(index), step):
            block = _rows(fwd, tc, kind, index[i : i + step], tvecs, tpos, f_layer, f_pos, f_feat, sources)
            r, c, v = _sparsify(block, row_ids[i : i + step], edges_per_node)
            rows.append(r), cols.append(c), vals.append(v)

    # target rows get ids n_cols.. so that every node id is unique while rows are gathered
    n_targets = len(tlist)
    for i in range(0, n_targets, batch_size):
        idx = torch.arange(i, min(i + batch_size, n_targets))
        run("target", idx, idx + n_cols)
    budget = n_feat if max_feature_nodes is None else min(max_feature_nodes, n_feat)
    visited = torch.zeros(n_feat, dtype=torch.bool)
    weights = torch.tensor([t.weight if t.weight is not None else 1.0 for t in tlist], dtype=torch.float32)
    while int(visited.sum()) < budget:
        if budget == n_feat:
            pending = torch.arange(n_feat)
        else:
            infl = partial_influence(torch.cat(rows), torch.cat(cols), torch.cat(vals), weights, n_cols)
            order = infl[:n_feat].argsort(descending=True)
            pending = order[~visited[order]][: min(update_interval * batch_size, budget - int(visited.sum()))]
        for i in range(0, len(pending), batch_size):
            idx = pending[i : i + batch_size]
            run("feature", idx, idx)
            visited[idx] = True
        if budget == n_feat:
            break
    edge_rows, edge_cols, edge_vals = torch.cat(rows), torch.cat(cols), torch.cat(vals)

    # renumber: selected features first (in their original order), then errors, tokens, targets
    selected = visited.nonzero()[:, 0]
    new_id = torch.full((n_cols + n_targets,), -1, dtype=torch.long)
    new_id[selected] = torch.arange(len(selected))
    n_sel = len(selected)
    new_id[n_feat:n_cols] = torch.arange(n_sel, n_sel + n_cols - n_feat)
    new_id[n_cols:] = torch.arange(n_sel + n_cols - n_feat, n_sel + n_cols - n_feat + n_targets)
    r, c = new_id[edge_rows], new_id[edge_cols]
    keep = (r >= 0) & (c >= 0)
    meta = dict(model=model.cfg.model_name, model_type=model.cfg.model_type, scan=tc.scan or "",
                input_hook=tc.input_hook, output_hook=tc.output_hook, kind=tc.kind, skip_positions=skip_positions,
                prompt_length=-1 if seq.prompt_length is None else seq.prompt_length,
                n_active_features=n_feat, seconds=round(time.perf_counter() - start, 3))  # fmt: skip
    return Graph(
        tokens=seq.tokens.clone(),
        features=torch.stack([f_layer, f_pos, f_feat], 1)[selected],
        activations=f_act[selected].float(),
        n_layers=n_layers,
        target_pos=torch.tensor([t.pos for t in tlist], dtype=torch.long),
        target_tokens=torch.tensor([-1 if t.token is None else t.token for t in tlist], dtype=torch.long),
        target_weights=weights,
        target_labels=[
            t.label or (token_label(tokenizer, t.token) if t.token is not None else f"direction {i}")
            for i, t in enumerate(tlist)
        ],
        edge_index=torch.stack([r[keep], c[keep]]),
        edge_weight=edge_vals[keep].float(),
        meta=meta,
    )


class _Sources:
    """Source vectors: each feature's scaled decoder rows (per layer it writes to), errors and embeddings."""

    def __init__(self, tc, fwd, f_layer, f_pos, f_feat, f_act, n_pos):
        self.by_out_layer = []  # per output layer: (feature node ids, positions, vectors a_f W_dec_f[out])
        for out in range(tc.n_layers):
            ids = (f_layer <= out).nonzero()[:, 0] if tc.kind == "clt" else (f_layer == out).nonzero()[:, 0]
            vecs = torch.empty(len(ids), tc.d_model, dtype=tc.W_dec[0].dtype)
            with torch.no_grad():
                for layer in f_layer[ids].unique().tolist():
                    m = f_layer[ids] == layer
                    vecs[m] = f_act[ids[m], None] * tc.decoder(layer, out)[f_feat[ids[m]]]
            self.by_out_layer.append((ids, f_pos[ids], vecs))
        self.errors = [fwd.errors[layer] for layer in range(tc.n_layers)]
        self.embed = fwd.embed[0].detach()
        self.n_feat, self.n_pos = len(f_layer), n_pos


def _rows(fwd, tc, kind, index, tvecs, tpos, f_layer, f_pos, f_feat, sources: _Sources) -> Float[Tensor, "row source"]:
    """Dense edge rows of a chunk of target nodes: gradients of their seeds, contracted with every source."""
    b, n_pos = len(index), sources.n_pos
    outputs, seeds = [], []
    if kind == "target":
        seed = fwd.final.new_zeros(b, *fwd.final.shape)
        seed[torch.arange(b), 0, tpos[index], :] = tvecs[index].to(seed)
        outputs, seeds = [fwd.final], [seed]
    else:
        for layer in f_layer[index].unique().tolist():
            m = f_layer[index] == layer
            x = fwd.inputs[layer]
            seed = x.new_zeros(b, *x.shape)
            rows = m.nonzero()[:, 0]
            seed[rows, 0, f_pos[index[m]], :] = tc.W_enc[layer][f_feat[index[m]]].detach().to(seed)
            outputs.append(x), seeds.append(seed)
    inputs = [fwd.leaves[layer] for layer in range(tc.n_layers)] + [fwd.embed]
    grads = torch.autograd.grad(outputs, inputs, seeds, retain_graph=True, allow_unused=True, is_grads_batched=True)
    block = torch.zeros(b, sources.n_feat + tc.n_layers * n_pos + n_pos)
    with torch.no_grad():
        for out_layer in range(tc.n_layers):
            g = grads[out_layer]
            if g is None:
                continue
            g = g[:, 0].to(sources.errors[0].dtype)  # [row, pos, d_model]
            ids, pos, vecs = sources.by_out_layer[out_layer]
            for i in range(0, len(ids), 4096):
                sl = slice(i, i + 4096)
                block[:, ids[sl]] += torch.einsum("bnd,nd->bn", g[:, pos[sl]], vecs[sl].to(g)).float()
            err_start = sources.n_feat + out_layer * n_pos
            block[:, err_start : err_start + n_pos] = (g * sources.errors[out_layer][None]).sum(-1).float()
        if grads[-1] is not None:
            block[:, -n_pos:] = (grads[-1][:, 0] * sources.embed[None]).sum(-1).float()
    return block


def _sparsify(block: Tensor, row_ids: Tensor, edges_per_node: int | None) -> tuple[Tensor, Tensor, Tensor]:
    """The non-zero entries of a block of rows, or each row's ``edges_per_node`` largest by magnitude."""
    if edges_per_node is not None and edges_per_node < block.shape[1]:
        top = block.abs().topk(edges_per_node, dim=1).indices
        kept = torch.zeros_like(block, dtype=torch.bool).scatter_(1, top, True)
        block = torch.where(kept, block, torch.zeros_like(block))
    r, c = block.nonzero(as_tuple=True)
    return row_ids[r], c, block[r, c]
