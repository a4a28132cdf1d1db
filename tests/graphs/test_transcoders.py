"""TranscoderSet: seeded random construction, circuit-tracer's folder format round trip, SAELens folders, errors."""

import json

import pytest
import torch
from conftest import make_bridge
from safetensors.torch import save_file

from transformer_bridge.graphs import TranscoderSet


@pytest.fixture(scope="module")
def llama():
    return make_bridge("llama")


@pytest.mark.parametrize("kind", ["plt", "clt"])
@pytest.mark.parametrize("activation", ["relu", "jumprelu", "topk"])
def test_save_load_round_trip(llama, tmp_path, kind, activation):
    tc = TranscoderSet.random(llama, kind=kind, d_transcoder=24, activation=activation, skip=True, seed=3)
    tc.save(tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    expected = ["layer_0.safetensors", "layer_1.safetensors"] if kind == "plt" else [
        "W_dec_0.safetensors", "W_dec_1.safetensors", "W_enc_0.safetensors", "W_enc_1.safetensors"]  # fmt: skip
    assert files == sorted(["config.yaml", *expected])
    back = TranscoderSet.load(tmp_path)
    assert (back.kind, back.activation, back.top_k, back.input_hook, back.output_hook) == (
        tc.kind, tc.activation, tc.top_k, tc.input_hook, tc.output_hook)  # fmt: skip
    for name, value in tc.state_dict().items():
        assert torch.equal(value, back.state_dict()[name]), name


def test_random_is_seeded_and_fires_at_its_density(llama):
    a = TranscoderSet.random(llama, d_transcoder=200, seed=0, density=0.05)
    b = TranscoderSet.random(llama, d_transcoder=200, seed=0, density=0.05)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=False))
    tokens = torch.randint(4, 99, (1, 40), generator=torch.Generator().manual_seed(5))
    _, cache = llama.run_with_cache(tokens, names_filter=a.input_point(1))
    density = (a.encode(cache[a.input_point(1)], 1) > 0).float().mean()
    assert 0.01 < density < 0.15
    topk = TranscoderSet.random(llama, d_transcoder=50, activation="topk", top_k=4, seed=0)
    assert ((topk.encode(cache[a.input_point(1)], 1) > 0).sum(-1) <= 4).all()


def test_cross_layer_decoders_write_forward_only(llama):
    tc = TranscoderSet.random(llama, kind="clt", d_transcoder=8, seed=0)
    assert tc.decoder(1, 0).abs().sum() == 0 and tc.decoder(0, 1).abs().sum() > 0
    assert list(tc.writes_to(0)) == [0, 1] and list(tc.writes_to(1)) == [1]


def test_saelens_folders(llama, tmp_path):
    ref = TranscoderSet.random(llama, d_transcoder=16, activation="jumprelu", skip=True, seed=1,
                               input_hook="ln2.hook_normalized")  # fmt: skip
    folders = []
    for layer in range(2):
        folder = tmp_path / f"layer{layer}"
        folder.mkdir()
        cfg = {"architecture": "jumprelu_skip_transcoder", "d_in": 32, "d_sae": 16, "d_out": 32,
               "metadata": {"hook_name": f"blocks.{layer}.ln2.hook_normalized",
                            "hook_name_out": f"blocks.{layer}.hook_mlp_out"}}  # fmt: skip
        (folder / "cfg.json").write_text(json.dumps(cfg))
        save_file({"W_enc": ref.W_enc[layer].T.contiguous(), "b_enc": ref.b_enc[layer], "W_dec": ref.W_dec[layer],
                   "b_dec": ref.b_dec[layer], "threshold": ref.threshold[layer],
                   "W_skip": ref.W_skip[layer].T.contiguous()}, folder / "sae_weights.safetensors")  # fmt: skip
        folders.append(folder)
    tc = TranscoderSet.from_saelens(folders)
    assert (tc.activation, tc.input_hook, tc.output_hook) == ("jumprelu", "ln2.hook_normalized", "hook_mlp_out")
    x = torch.randn(5, 32)
    torch.testing.assert_close(tc.encode(x, 1), ref.encode(x, 1))
    torch.testing.assert_close(tc.skip(x, 0), ref.skip(x, 0))


def test_errors_name_the_parameter(llama, tmp_path):
    with pytest.raises(ValueError, match="`kind`"):
        TranscoderSet.random(llama, kind="dense")
    with pytest.raises(ValueError, match="not a hook point"):
        TranscoderSet.random(llama, input_hook="mlp.hook_nowhere")
    with pytest.raises(FileNotFoundError, match=r"config\.yaml"):
        TranscoderSet.load(tmp_path)
    with pytest.raises(ValueError, match=r"`top_k`"):
        TranscoderSet(torch.zeros(1, 2, 3), torch.zeros(1, 2), torch.zeros(1, 2, 3), torch.zeros(1, 3), top_k=3)


def test_circuit_tracer_point_names_load_as_the_bridges(llama, tmp_path):
    tc = TranscoderSet.random(llama, d_transcoder=8, seed=0)
    tc.save(tmp_path)
    config = (tmp_path / "config.yaml").read_text().replace("hook_mlp_out", "mlp.hook_out")
    (tmp_path / "config.yaml").write_text(config)
    assert TranscoderSet.load(tmp_path).output_hook == "hook_mlp_out"
