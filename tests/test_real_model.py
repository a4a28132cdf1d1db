"""SmolLM2-135M-Instruct through the bridge: exact logits, the expected completion, hooks within tolerance."""

import pytest
import torch

pytestmark = pytest.mark.real

PROMPT = "The capital of France is"


def test_logits_bitwise_equal_hf(smollm2):
    tokens, _ = smollm2.to_tokens_and_mask(PROMPT, padding_side="left")
    with torch.no_grad():
        assert torch.equal(smollm2(PROMPT), smollm2.hf_model(tokens).logits)


def test_greedy_continues_with_paris(smollm2):
    tokens, _ = smollm2.to_tokens_and_mask(PROMPT, padding_side="left")
    with torch.no_grad():
        for _ in range(3):
            nxt = smollm2(tokens)[0, -1].argmax()
            tokens = torch.cat([tokens, nxt.view(1, 1)], dim=1)
    assert smollm2.to_string(tokens[0]).startswith(PROMPT + " Paris")


def test_all_hooks_within_tolerance_and_cache_once(smollm2):
    tokens, _ = smollm2.to_tokens_and_mask(PROMPT, padding_side="left")
    with torch.no_grad():
        ref = smollm2.hf_model(tokens).logits
    logits, cache = smollm2.run_with_cache(PROMPT)
    # Reading hooks leave every output to HF's own kernels: caching everything is bitwise exact.
    assert torch.equal(logits, ref)
    n = smollm2.cfg.n_layers
    # tokens, embed, ln_final (2), unembed in / out + 23 per block; a full cache leaves each block's head results out
    # (computed on demand, use_attn_result=False as in TransformerLens)
    assert len(smollm2.hook_dict) == 6 + 23 * n and len(cache) == 6 + 22 * n
    # Editing hooks (a clone counts as an edit) take the explicit attention path.
    with torch.no_grad():
        edited = smollm2.run_with_hooks(PROMPT, fwd_hooks=[(lambda n: True, lambda x, hook: x.clone())])
    assert (edited - ref).abs().max() <= 1e-4
    # resid_post[l] and resid_pre[l+1] are one tensor (n - 1 pairs), and so are hook_embed and resid_pre[0].
    distinct = {t.untyped_storage().data_ptr() for t in cache.values()}
    assert len(distinct) == len(cache) - n


def test_padded_batch_rows_match_single(smollm2):
    """Texts are laid out as `to_tokens` lays them out (right padding): each row's real positions are the row alone."""
    prompts = [PROMPT, "Hello"]
    _, mask = smollm2.to_tokens_and_mask(prompts)
    with torch.no_grad():
        batch = smollm2(prompts)
        for i, p in enumerate(prompts):
            alone = smollm2(p)[0]
            torch.testing.assert_close(batch[i][mask[i].bool()], alone, atol=1e-4, rtol=1e-4)


def test_the_demo_runs_and_says_what_the_readme_promises(smollm2, capsys, tmp_path, monkeypatch):
    """`make demo`'s script end to end: exact logits, steering flips Paris to London, a token explained."""
    import importlib.util
    from pathlib import Path

    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))
    spec = importlib.util.spec_from_file_location("demo", Path(__file__).parents[1] / "examples" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    demo.main()
    out = capsys.readouterr().out
    assert "bitwise equal to HF: True" in out
    assert "alpha=0.4: 'The capital of France is London." in out
    assert "Why ' Paris'?" in out and "attnlrp, top input tokens: 'iffel'" in out
    assert (tmp_path / "transformer_bridge_attnlrp.png").stat().st_size > 10_000
