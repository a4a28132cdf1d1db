"""Training per-layer transcoders on the activation store: the two points of a layer come back row-aligned, and
training lowers the reconstruction error of random transcoders; the result saves in circuit-tracer's format."""

import torch
from conftest import make_bridge

from transformer_bridge import harvest
from transformer_bridge.graphs import TranscoderSet
from transformer_bridge.graphs.train import _loss, harvest_points, train_transcoders


def test_training_lowers_the_error_and_saves(tmp_path):
    model = make_bridge("llama")
    docs = [torch.randint(4, 99, (48,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(24)]
    init = TranscoderSet.random(model, d_transcoder=48, seed=0)
    store = harvest(model, docs, harvest_points(init), tmp_path / "acts", context_length=48, progress=False)
    x = next(store.batches(init.input_point(1), batch_size=64, seed=3))
    y = next(store.batches(init.output_point(1), batch_size=64, seed=3))
    assert x.shape == y.shape == (64, 32)
    inputs, outputs = store.read(init.input_point(1))[:512].float(), store.read(init.output_point(1))[:512].float()
    with torch.no_grad():
        before = float(_loss(init, 1, inputs, outputs)[0])
    tc, log = train_transcoders(store, init, steps=150, batch_size=128, lr=3e-3, l1=1e-3)
    with torch.no_grad():
        after = float(_loss(tc, 1, inputs, outputs)[0])
    assert after < 0.5 * before and log[1]["l0"] > 0
    tc.save(tmp_path / "tc")
    back = TranscoderSet.load(tmp_path / "tc")
    torch.testing.assert_close(back.W_dec, tc.W_dec.detach())
