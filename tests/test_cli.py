"""The ``transformer-bridge`` command on a tiny model saved to a local folder."""

import pytest
from conftest import char_tokenizer, make_bridge, make_hf

from transformer_bridge.cli import main


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    make_hf("llama").save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def test_hooks_lists_names_with_shapes(folder, capsys):
    main(["hooks", str(folder), "--filter", "blocks.1.attn.hook_"])
    lines = capsys.readouterr().out.strip().splitlines()
    model = make_bridge("llama")
    want = [n for n in model.hook_dict if "blocks.1.attn.hook_" in n]
    assert [line.split()[0] for line in lines[:-1]] == want
    assert lines[want.index("blocks.1.attn.hook_pattern")].endswith(f"[1, {model.cfg.n_heads}, 4, 4]")
    assert lines[-1].startswith(f"{len(want)} of {len(model.hook_dict)} hook points")


def test_hooks_with_an_unmatched_filter_says_so(folder):
    with pytest.raises(SystemExit, match="No hook point name contains 'nope'"):
        main(["hooks", str(folder), "--filter", "nope"])


def test_generate_prints_the_bridge_greedy_text(folder, capsys):
    main(["generate", str(folder), "Hello", "--max-new-tokens", "5"])
    printed = capsys.readouterr().out.rstrip("\n")
    model = make_bridge("llama")
    assert printed == model.generate("Hello", max_new_tokens=5)
    main(["generate", str(folder), "Hello", "--max-new-tokens", "5", "--temperature", "0.9", "--seed", "3"])
    assert capsys.readouterr().out.rstrip("\n") == model.generate("Hello", max_new_tokens=5, temperature=0.9, seed=3)


def test_unknown_command_is_an_argparse_error():
    with pytest.raises(SystemExit):
        main(["explain"])


@pytest.mark.real
def test_prepare_smollm2_prints_the_converted_folder(capsys):
    from transformer_bridge.real_model import is_complete, smollm2_path

    main(["prepare-smollm2"])
    printed = capsys.readouterr().out.strip()
    assert printed == str(smollm2_path()) and is_complete(smollm2_path())
