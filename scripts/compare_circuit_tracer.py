"""Compare this bridge's attribution graphs with circuit-tracer 0.5's, on the same tiny Llama and the same random
transcoders saved to disk.

Two interpreters: this project's venv builds the model, saves it (HF format) and the transcoders (circuit-tracer's
folder format, `TranscoderSet.save`), and computes our graphs; circuit-tracer's own venv (TransformerLens backend,
its pinned transformers) loads the same files with circuit-tracer's loaders, computes its graphs, and compares:
active features, activations, the adjacency (relative to its largest entry), the pruned node sets, and our graph
JSON read by circuit-tracer's own pydantic model of that schema.

    python scripts/compare_circuit_tracer.py --ct-python /work/venvs/ct/bin/python     # both phases
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

SETTINGS = [("plt", "relu"), ("plt", "jumprelu"), ("clt", "relu"), ("clt", "jumprelu")]
PROMPT = [1, 17, 42, 8, 11, 23, 64, 5, 90, 31, 12, 77, 40, 9]
TARGETS = [5, 9, 33]
SIZES = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             rms_norm_eps=1e-5)  # fmt: skip


def ours(work: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import char_tokenizer

    from transformer_bridge import TransformerBridge
    from transformer_bridge.graphs import TranscoderSet, attribute

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**SIZES)).eval()
    tok = char_tokenizer()
    hf.save_pretrained(work / "model")
    tok.save_pretrained(work / "model")
    model = TransformerBridge(hf, tok)
    tokens = torch.tensor(PROMPT)
    with torch.no_grad():
        save_file({"logits": model(tokens[None])[0].contiguous()}, work / "logits.safetensors")
    for seed, (kind, activation) in enumerate(SETTINGS):
        name = f"{kind}-{activation}"
        tc = TranscoderSet.random(model, kind=kind, d_transcoder=48, activation=activation, seed=seed)
        tc.save(work / f"tc-{name}")
        graph = attribute(model, tokens, tc, targets=TARGETS, batch_size=16, zero_skipped_errors=True)
        graph.save(work / f"ours-{name}.safetensors")
        graph.to_json(work / f"ours-{name}.json", slug=f"ours-{name}", tokenizer=tok, d_vocab=99)
        print(f"ours {name}: {graph.n_features} features, {graph.edge_weight.numel()} edges")


def ct_setup(work: Path, sizes: dict = SIZES):
    """circuit-tracer's side of the shared model: the HF Llama saved by ``ours`` as a TransformerLens model's
    config and weights, and the tokenizer."""
    import torch
    from transformer_lens import HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_llama_weights
    from transformers import AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerFast

    hf = LlamaForCausalLM.from_pretrained(work / "model", torch_dtype=torch.float32).eval()
    tok = PreTrainedTokenizerFast(tokenizer_file=str(work / "model" / "tokenizer.json"), bos_token="<bos>",
                                  eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")  # fmt: skip
    tok.save_pretrained(work / "tokenizer-ct")  # TransformerLens reloads its tokenizer by name: save it in this release
    tok = AutoTokenizer.from_pretrained(work / "tokenizer-ct")
    d_head = sizes["hidden_size"] // sizes["num_attention_heads"]
    cfg = HookedTransformerConfig(
        n_layers=sizes["num_hidden_layers"], d_model=sizes["hidden_size"], d_head=d_head,
        n_heads=sizes["num_attention_heads"], d_mlp=sizes["intermediate_size"], d_vocab=sizes["vocab_size"],
        n_ctx=sizes["max_position_embeddings"], act_fn="silu", normalization_type="RMS",
        positional_embedding_type="rotary", rotary_dim=d_head, rotary_base=10000,
        n_key_value_heads=sizes["num_key_value_heads"], gated_mlp=True, final_rms=True, eps=sizes["rms_norm_eps"],
        original_architecture="LlamaForCausalLM", tokenizer_name=str(work / "tokenizer-ct"), model_name="tiny-llama",
        default_prepend_bos=False, dtype=torch.float32, device="cpu",
    )  # fmt: skip
    return cfg, convert_llama_weights(hf, cfg), tok


def ct_model(cfg, weights, tok, folder: Path, kind: str):
    """circuit-tracer's replacement model over the shared weights, with the transcoders in ``folder`` read by its
    own loaders."""
    import torch
    from circuit_tracer.replacement_model.replacement_model_transformerlens import TransformerLensReplacementModel
    from circuit_tracer.transcoder.cross_layer_transcoder import load_clt
    from circuit_tracer.transcoder.single_layer_transcoder import load_transcoder_set

    if kind == "plt":
        paths = {i: str(folder / f"layer_{i}.safetensors") for i in range(cfg.n_layers)}
        tcs = load_transcoder_set(paths, scan=folder.name, feature_input_hook="mlp.hook_in",
                                  feature_output_hook="mlp.hook_out", dtype=torch.float32, device=torch.device("cpu"),
                                  lazy_encoder=False, lazy_decoder=False)  # fmt: skip
    else:
        tcs = load_clt(str(folder), feature_input_hook="mlp.hook_in", feature_output_hook="mlp.hook_out",
                       scan=folder.name, dtype=torch.float32, device=torch.device("cpu"),
                       lazy_decoder=False)  # fmt: skip
    model = TransformerLensReplacementModel.from_config(cfg, tcs, tokenizer=tok)
    # circuit-tracer wraps each MLP and the unembedding in a module of its own
    renamed = {k.replace(".mlp.", ".mlp.old_mlp.").replace("unembed.", "unembed.old_unembed."): v
               for k, v in weights.items()}  # fmt: skip
    missing, unexpected = model.load_state_dict(renamed, strict=False)
    buffers = ("IGNORE", ".mask", "rotary_sin", "rotary_cos")
    if unexpected or not all("transcoders" in k or k.endswith(buffers) for k in missing):
        raise RuntimeError(f"weights did not load: missing {missing}, unexpected {unexpected}")
    return model


def circuit_tracer(work: Path) -> None:
    import torch
    from circuit_tracer import attribute
    from circuit_tracer.frontend.graph_models import Model
    from circuit_tracer.graph import prune_graph
    from safetensors import safe_open

    cfg, weights, tok = ct_setup(work)
    read = lambda path: {k: f.get_tensor(k) for f in [safe_open(str(path), "pt")] for k in f.keys()}  # noqa: E731, SIM118
    ref_logits = read(work / "logits.safetensors")["logits"]
    tokens = torch.tensor(PROMPT)
    results = {}
    for kind, activation in SETTINGS:
        name = f"{kind}-{activation}"
        model = ct_model(cfg, weights, tok, work / f"tc-{name}", kind)
        with torch.no_grad():
            tl_logits = model(tokens[None])[0]
        graph = attribute(tokens, model, attribution_targets=torch.tensor(TARGETS), batch_size=16)
        theirs = graph.adjacency_matrix
        o = read(work / f"ours-{name}.safetensors")
        n = theirs.shape[0]
        dense = torch.zeros(n, n)
        dense[o["edge_index"][0], o["edge_index"][1]] = o["edge_weight"]
        same_features = torch.equal(o["features"], graph.active_features[graph.selected_features].cpu())
        act_err = (o["activations"] - graph.activation_values).abs().max().item() if same_features else float("nan")
        scale = theirs.abs().max().item()
        adj_err = (dense - theirs).abs().max().item() / scale if dense.shape == theirs.shape else float("nan")
        ct_mask = prune_graph(graph, 0.8, 0.98).node_mask
        ours_json = json.loads((work / f"ours-{name}.json").read_text())
        Model.model_validate(ours_json)  # circuit-tracer's own reader of the graph JSON schema
        results[name] = dict(
            hf_vs_transformerlens_logits=(tl_logits - ref_logits).abs().max().item(),
            n_features_ours=len(o["features"]), n_features_ct=len(graph.selected_features),
            same_active_features=same_features, max_activation_diff=act_err, adjacency_max_rel_diff=adj_err,
            adjacency_max_abs=scale, ct_pruned_nodes=int(ct_mask.sum()), json_nodes=len(ours_json["nodes"]),
            json_read_by_circuit_tracer=True,
        )  # fmt: skip
        (work / f"ct-{name}-mask.json").write_text(json.dumps(ct_mask.nonzero()[:, 0].tolist()))
        print(name, results[name])
    (work / "results.json").write_text(json.dumps(results, indent=1))


def pruned_agreement(work: Path) -> dict:
    """Our pruning (sparse) against circuit-tracer's (dense) on the same graphs: the node sets kept."""
    from transformer_bridge.graphs import Graph

    out = {}
    for kind, activation in SETTINGS:
        name = f"{kind}-{activation}"
        graph = Graph.load(work / f"ours-{name}.safetensors")
        ours_nodes = graph.prune(0.8, 0.98).node_mask.nonzero()[:, 0].tolist()
        theirs = json.loads((work / f"ct-{name}-mask.json").read_text())
        out[name] = ours_nodes == theirs
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase", choices=["ours", "ct", "both"], default="both")
    parser.add_argument("--work", default="/tmp/ct_compare")
    parser.add_argument("--ct-python", default="/work/venvs/ct/bin/python")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.phase == "ct":
        circuit_tracer(work)
        return
    ours(work)
    if args.phase == "both":
        subprocess.run([args.ct_python, __file__, "--phase", "ct", "--work", str(work)], check=True)
        results = json.loads((work / "results.json").read_text())
        agree = pruned_agreement(work)
        print("| transcoders | features (ours / circuit-tracer) | same active features | max activation diff "
              "| adjacency max rel. diff | pruned node sets equal | our JSON read by circuit-tracer |")  # fmt: skip
        print("|---|---|---|---|---|---|---|")
        for name, r in results.items():
            print(f"| {name} | {r['n_features_ours']} / {r['n_features_ct']} | {r['same_active_features']} | "
                  f"{r['max_activation_diff']:.1e} | {r['adjacency_max_rel_diff']:.1e} | {agree[name]} | "
                  f"{r['json_read_by_circuit_tracer']} |")  # fmt: skip


if __name__ == "__main__":
    main()
