"""Train per-layer transcoders on an activation store (`transformer_bridge.activations.harvest`).

A store that holds both of a layer's points (the transcoder's input and the MLP output) keeps them row-aligned:
batches of the two with the same seed are the same token positions, so a training batch is a pair of them.
The loss is the reconstruction's mean squared error relative to the output's variance, plus an L1 penalty on
``activation × ||W_dec row||`` (the sparsity term of Anthropic's transcoders) relative to the output's scale.
"""

import torch
from torch import Tensor

from .transcoders import TranscoderSet


def harvest_points(tc: TranscoderSet) -> list[str]:
    """The points a store must hold to train ``tc``'s layers: each layer's input and output point."""
    return [p for layer in range(tc.n_layers) for p in (tc.input_point(layer), tc.output_point(layer))]


def train_transcoders(
    store,
    init: TranscoderSet,
    *,
    steps: int = 1000,
    batch_size: int = 1024,
    lr: float = 1e-3,
    l1: float = 1e-3,
    seed: int = 0,
    log_every: int = 0,
) -> tuple[TranscoderSet, list[dict]]:
    """Fit ``init``'s per-layer ReLU / JumpReLU / TopK transcoders to ``store`` (an `ActivationStore` holding
    `harvest_points`), in place; returns the transcoders and one log entry per layer (final loss parts).

    Example:
        >>> init = TranscoderSet.random(model, d_transcoder=256, seed=0)
        >>> store = harvest(model, texts, harvest_points(init), "acts/")
        >>> tc, log = train_transcoders(store, init, steps=500)
    """
    if init.kind != "plt":
        raise ValueError(f"`init` must be per-layer transcoders (kind 'plt'), got kind {init.kind!r}")
    if steps < 1 or batch_size < 1:
        raise ValueError(f"`steps` and `batch_size` must be >= 1, got {steps} and {batch_size}")
    names = set(store.names)
    missing = [p for p in harvest_points(init) if p not in names]
    if missing:
        raise ValueError(f"the store lacks {missing}; harvest `harvest_points(transcoders)`")
    opt = torch.optim.Adam([p for p in init.parameters() if p.requires_grad], lr=lr)
    log = []
    for layer in range(init.n_layers):
        xs = store.batches(init.input_point(layer), batch_size=batch_size, seed=seed + layer, epochs=None)
        ys = store.batches(init.output_point(layer), batch_size=batch_size, seed=seed + layer, epochs=None)
        with torch.no_grad():  # start the decoder at the output's scale, its bias at the output's mean
            y0 = next(store.batches(init.output_point(layer), batch_size=4096, seed=seed)).float()
            init.b_dec[layer] = y0.mean(0)
            rows = init.W_dec[layer]
            rows *= 0.1 * y0.std() / rows.norm(dim=-1, keepdim=True).clamp(min=1e-8)
        for step in range(steps):
            x, y = next(xs).float(), next(ys).float()
            mse, sparsity = _loss(init, layer, x, y)
            loss = mse + l1 * sparsity
            opt.zero_grad()
            loss.backward()
            opt.step()
            if log_every and step % log_every == 0:
                print(f"layer {layer} step {step}: normalised mse {float(mse):.4f}, l1 {float(sparsity):.3f}")
        with torch.no_grad():
            x, y = next(xs).float(), next(ys).float()
            mse, sparsity = _loss(init, layer, x, y)
            l0 = float((init.encode(x, layer) > 0).float().sum(-1).mean())
        log.append(dict(layer=layer, normalised_mse=float(mse), l1=float(sparsity), l0=l0))
    return init, log


def _loss(tc: TranscoderSet, layer: int, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    acts = tc.encode(x, layer)
    recon = acts @ tc.W_dec[layer] + tc.b_dec[layer] + tc.skip(x, layer)
    var = (y - y.mean(0)).pow(2).sum(-1).mean().clamp(min=1e-12)
    mse = (recon - y).pow(2).sum(-1).mean() / var
    sparsity = (acts * tc.W_dec[layer].norm(dim=-1)).sum(-1).mean() / var.sqrt()
    return mse, sparsity
