"""Sites: how each kind of HF module serves the bridge's hook points. A site is one torch hook on one HF module
(`torch_hook`), attached only while a point it serves has a function, so an unhooked model runs HF's own code.
`build` wires every point of a model from its adapter; the kinds of module have a module each: norms (`norms`),
attention through HF's attention registry (`attention`), mixture-of-experts (`moe`), multi-head latent
attention (`mla`), state-space and convolution mixers (`mixers`, `ssm`), TransformerLens' split-input points
(`split_inputs`); `module_paths` resolves an adapter's dotted paths and `checks` verifies after a forward that
every hooked site ran.

Open this folder to serve a new kind of HF module. It may import `hooks`, `adapters`, `distributed`,
`versions` and `checks`, never the core bridge, caches or anything above them.
"""
