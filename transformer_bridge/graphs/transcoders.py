# ruff: noqa: N803, N806  (the weights keep the names transcoder files use: W_enc, W_dec, W_skip)
"""`TranscoderSet`: per-layer (PLT) or cross-layer (CLT) transcoders named by the bridge's hook points.

A transcoder of layer ``l`` reads ``blocks.l.<input_hook>`` and writes to ``blocks.l'.<output_hook>``: ``l' = l``
for a per-layer transcoder, every ``l' >= l`` for a cross-layer one. Features are ``act(W_enc x + b_enc)`` with
``act`` ReLU, JumpReLU (a per-feature threshold) or TopK (the ``top_k`` largest pre-activations of a position, then
ReLU); the reconstruction is ``Σ a_f W_dec_f + b_dec (+ x W_skip)``.
"""

from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor, nn

from . import transcoder_io

ACTIVATIONS = ("relu", "jumprelu", "topk")
KINDS = ("plt", "clt")


@dataclass(frozen=True)
class SparseActs:
    """Active features of one layer: ``pos``, ``feature`` and ``value`` per active (position, feature)."""

    pos: Tensor
    feature: Tensor
    value: Tensor


class TranscoderSet(nn.Module):
    """Transcoders for every layer of a model, read and written at the bridge's hook points.

    Shapes (``layer`` = the model's layers, ``feature`` = ``d_transcoder``): ``W_enc [layer, feature, d_model]``,
    ``b_enc [layer, feature]``, ``b_dec [layer, d_model]``, ``threshold [layer, feature]`` (JumpReLU), ``W_skip
    [layer, d_model, d_model]`` (optional; the skip adds ``x @ W_skip[l]``), and ``W_dec``: ``[layer, feature,
    d_model]`` per-layer, or for cross-layer transcoders one tensor per source layer ``l``, ``[feature, n_layers - l,
    d_model]`` (its writes to layers ``l, l+1, ...``).

    Example:
        >>> tc = TranscoderSet.random(model, kind="plt", d_transcoder=64, seed=0)
        >>> tc.save("my_transcoders"); TranscoderSet.load("my_transcoders").kind
        'plt'
    """

    def __init__(
        self,
        W_enc: Float[Tensor, "layer feature d_model"],
        b_enc: Float[Tensor, "layer feature"],
        W_dec: Float[Tensor, "layer feature d_model"] | list[Tensor],
        b_dec: Float[Tensor, "layer d_model"],
        *,
        kind: str = "plt",
        activation: str = "relu",
        threshold: Float[Tensor, "layer feature"] | None = None,
        top_k: int | None = None,
        W_skip: Float[Tensor, "layer d_model d_model"] | None = None,
        input_hook: str = "mlp.hook_in",
        output_hook: str = "hook_mlp_out",
        scan: str | None = None,
    ):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"`kind` must be one of {KINDS}, got {kind!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"`activation` must be one of {ACTIVATIONS}, got {activation!r}")
        if (activation == "jumprelu") != (threshold is not None):
            raise ValueError("`threshold` is given exactly when `activation` is 'jumprelu'")
        if (activation == "topk") != (top_k is not None):
            raise ValueError(f"`top_k` is given exactly when `activation` is 'topk' (got activation={activation!r}, "
                             f"top_k={top_k!r})")  # fmt: skip
        n_layers, d_transcoder, d_model = W_enc.shape
        if b_enc.shape != (n_layers, d_transcoder) or b_dec.shape != (n_layers, d_model):
            raise ValueError(
                f"`b_enc` must be [layer, feature] = {(n_layers, d_transcoder)} and `b_dec` [layer, d_model] = "
                f"{(n_layers, d_model)}; got {tuple(b_enc.shape)} and {tuple(b_dec.shape)}"
            )
        self.kind, self.activation, self.top_k, self.scan = kind, activation, top_k, scan
        self.input_hook, self.output_hook = input_hook, output_hook
        self.W_enc, self.b_enc, self.b_dec = nn.Parameter(W_enc), nn.Parameter(b_enc), nn.Parameter(b_dec)
        if kind == "plt":
            if not isinstance(W_dec, Tensor) or W_dec.shape != W_enc.shape:
                raise ValueError(f"a per-layer `W_dec` is one [layer, feature, d_model] = {tuple(W_enc.shape)} tensor")
            self.W_dec = nn.Parameter(W_dec)
        else:
            expected = [(d_transcoder, n_layers - layer, d_model) for layer in range(n_layers)]
            if [tuple(w.shape) for w in W_dec] != expected:
                raise ValueError(f"a cross-layer `W_dec` is a list of [feature, n_layers - l, d_model] tensors, "
                                 f"expected {expected}, got {[tuple(w.shape) for w in W_dec]}")  # fmt: skip
            self.W_dec = nn.ParameterList([nn.Parameter(w) for w in W_dec])
        self.threshold = None if threshold is None else nn.Parameter(threshold)
        self.W_skip = None if W_skip is None else nn.Parameter(W_skip)

    @property
    def n_layers(self) -> int:
        return self.W_enc.shape[0]

    @property
    def d_transcoder(self) -> int:
        return self.W_enc.shape[1]

    @property
    def d_model(self) -> int:
        return self.W_enc.shape[2]

    def input_point(self, layer: int) -> str:
        return f"blocks.{layer}.{self.input_hook}"

    def output_point(self, layer: int) -> str:
        return f"blocks.{layer}.{self.output_hook}"

    def pre_acts(self, x: Float[Tensor, "... d_model"], layer: int) -> Float[Tensor, "... feature"]:
        """``W_enc x + b_enc`` of ``layer`` (the quantity a feature node's incoming edges explain, bias aside)."""
        return x @ self.W_enc[layer].T + self.b_enc[layer]

    def activate(self, pre: Float[Tensor, "... feature"], layer: int) -> Float[Tensor, "... feature"]:
        """The activation function of ``layer`` applied to pre-activations."""
        if self.activation == "relu":
            return pre.relu()
        if self.activation == "jumprelu":
            return pre * (pre > self.threshold[layer])
        kept = pre.topk(self.top_k, dim=-1).indices
        return torch.zeros_like(pre).scatter(-1, kept, pre.gather(-1, kept)).relu()

    def encode(self, x: Float[Tensor, "... d_model"], layer: int) -> Float[Tensor, "... feature"]:
        """Feature activations of ``layer`` on inputs ``x``."""
        return self.activate(self.pre_acts(x, layer), layer)

    def decoder(self, layer: int, out_layer: int) -> Float[Tensor, "feature d_model"]:
        """Decoder rows of ``layer``'s features into ``out_layer``'s output (zeros where they do not write)."""
        if self.kind == "plt":
            return self.W_dec[layer] if out_layer == layer else self.W_dec.new_zeros(self.W_dec.shape[1:])
        if out_layer < layer:
            return self.W_dec[layer].new_zeros(self.d_transcoder, self.d_model)
        return self.W_dec[layer][:, out_layer - layer]

    def writes_to(self, layer: int) -> range:
        """Output layers that features of ``layer`` write to."""
        return range(layer, layer + 1) if self.kind == "plt" else range(layer, self.n_layers)

    def skip(self, x: Float[Tensor, "... d_model"], layer: int) -> Float[Tensor, "... d_model"]:
        """The skip connection's term (zeros without one)."""
        return torch.zeros_like(x) if self.W_skip is None else x @ self.W_skip[layer]

    def reconstruct(
        self, acts: list[Float[Tensor, "... feature"]], x: Float[Tensor, "... d_model"], out_layer: int
    ) -> Float[Tensor, "... d_model"]:
        """Reconstruction of ``out_layer``'s output from the activations of layers ``0..out_layer`` and its input."""
        out = self.b_dec[out_layer] + self.skip(x, out_layer)
        for layer in range(out_layer + 1) if self.kind == "clt" else [out_layer]:
            out = out + acts[layer] @ self.decoder(layer, out_layer)
        return out

    def save(self, directory) -> None:
        """Write circuit-tracer's folder format: ``config.yaml`` naming the points, one safetensors per layer."""
        transcoder_io.write_folder(self, directory)

    @classmethod
    def load(cls, directory, dtype: torch.dtype = torch.float32) -> "TranscoderSet":
        """Read a circuit-tracer transcoder folder (written by `save` or by circuit-tracer).

        Example:
            >>> TranscoderSet.load("my_transcoders").n_layers
        """
        return cls(**transcoder_io.read_folder(directory, dtype))

    @classmethod
    def from_saelens(cls, folders, dtype: torch.dtype = torch.float32) -> "TranscoderSet":
        """Per-layer transcoders saved by SAELens, one folder per layer (``cfg.json`` + ``sae_weights.safetensors``)."""
        return cls(**transcoder_io.read_saelens(list(folders), dtype))

    @staticmethod
    def sparse(acts: Float[Tensor, "pos feature"]) -> SparseActs:
        """The non-zero entries of one layer's activations."""
        pos, feature = acts.nonzero(as_tuple=True)
        return SparseActs(pos, feature, acts[pos, feature])

    @classmethod
    def random(
        cls,
        model,
        kind: str = "plt",
        d_transcoder: int = 128,
        seed: int = 0,
        *,
        activation: str = "relu",
        top_k: int | None = None,
        skip: bool = False,
        density: float = 0.05,
        input_hook: str | None = None,
        output_hook: str = "hook_mlp_out",
        dtype: torch.dtype = torch.float32,
    ) -> "TranscoderSet":
        """Seeded random transcoders for ``model`` (a `TransformerBridge`), for tests and demonstrations.

        Encoder rows are unit vectors scaled by ``1 / rms(input)`` so pre-activations are about N(0, 1), with a
        bias (ReLU) or threshold (JumpReLU) putting roughly ``density`` of the features above zero; TopK keeps
        ``top_k`` per position. ``input_hook`` defaults to ``mlp.hook_in`` where every layer has it, else
        ``ln2.hook_normalized``.

        Example:
            >>> tc = TranscoderSet.random(model, kind="clt", d_transcoder=64, activation="jumprelu", seed=1)
        """
        if kind not in KINDS:
            raise ValueError(f"`kind` must be one of {KINDS}, got {kind!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"`activation` must be one of {ACTIVATIONS}, got {activation!r}")
        if not 0.0 < density < 1.0:
            raise ValueError(f"`density` must be in (0, 1), got {density}")
        cfg = model.cfg
        n_layers, d_model = cfg.n_layers, cfg.d_model
        if input_hook is None:
            input_hook = next(
                (h for h in ("mlp.hook_in", "ln2.hook_normalized", "hook_resid_mid")
                 if all(f"blocks.{layer}.{h}" in model.hook_dict for layer in range(n_layers))),
                None,
            )  # fmt: skip
            if input_hook is None:
                raise ValueError(f"{cfg.model_type} has no MLP input point in every layer; pass `input_hook`")
        for layer in range(n_layers):
            for name in (f"blocks.{layer}.{input_hook}", f"blocks.{layer}.{output_hook}"):
                if name not in model.hook_dict:
                    raise ValueError(f"{name!r} is not a hook point of this {cfg.model_type} model")
        if activation == "topk" and top_k is None:
            top_k = max(1, round(density * d_transcoder))
        g = torch.Generator().manual_seed(seed)
        gen = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
        W_enc = gen(n_layers, d_transcoder, d_model)
        W_enc = W_enc / W_enc.norm(dim=-1, keepdim=True)
        # N(0, 1) quantile that leaves `density` above it
        cut = float(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(1.0 - density)))
        b_enc = torch.full((n_layers, d_transcoder), -cut if activation == "relu" else 0.0, dtype=torch.float64)
        b_enc = b_enc + 0.1 * gen(n_layers, d_transcoder)
        threshold = torch.full((n_layers, d_transcoder), cut, dtype=torch.float64) if activation == "jumprelu" else None
        scale = 1.0 / max(1.0, density * d_transcoder) ** 0.5
        if kind == "plt":
            W_dec = scale * gen(n_layers, d_transcoder, d_model) / d_model**0.5
        else:
            W_dec = [scale * gen(d_transcoder, n_layers - layer, d_model) / d_model**0.5 for layer in range(n_layers)]
        W_skip = 0.05 * gen(n_layers, d_model, d_model) / d_model**0.5 if skip else None
        b_dec = 0.01 * gen(n_layers, d_model)
        cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
        tc = cls(
            cast(W_enc), cast(b_enc), [cast(w) for w in W_dec] if kind == "clt" else cast(W_dec), cast(b_dec),
            kind=kind, activation=activation, threshold=cast(threshold), top_k=top_k, W_skip=cast(W_skip),
            input_hook=input_hook, output_hook=output_hook,
            scan=f"random-{kind}-{activation}-{d_transcoder}-seed{seed}",
        )  # fmt: skip
        tc.calibrate(model)
        return tc

    @torch.no_grad()
    def calibrate(self, model, tokens: Tensor | None = None) -> None:
        """Rescale encoder rows so each layer's pre-activations have unit RMS on ``tokens`` (random tokens if
        None): random transcoders then fire at the density they were made for on any model."""
        if tokens is None:
            g = torch.Generator().manual_seed(0)
            tokens = torch.randint(0, model.cfg.d_vocab, (1, 32), generator=g)
        names = [self.input_point(layer) for layer in range(self.n_layers)]
        _, cache = model.run_with_cache(tokens, names_filter=names)
        for layer in range(self.n_layers):
            x = cache[names[layer]].to(self.W_enc.dtype)
            rms = (x @ self.W_enc[layer].T).pow(2).mean().sqrt().clamp(min=1e-6)
            self.W_enc[layer] /= rms
