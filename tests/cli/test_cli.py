"""The ``transformer-bridge`` command on a tiny model saved to a local folder: hooks, generate with every option as a
flag, the interactive loop (scripted on stdin; Ctrl-C), and the saved activation cache."""

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import char_tokenizer, make_bridge, make_hf

from transformer_bridge import ActivationCache
from transformer_bridge.cli.main import main
from transformer_bridge.cli.options import CLI_OPTIONS, flag, parse_setting
from transformer_bridge.cli.repl import run_repl
from transformer_bridge.generation.declare import OPTIONS


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


# -- generate: every option a flag, the interactive loop, the saved cache ----------------------------------------
ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "transformer_bridge", *args], input=stdin, capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=ROOT)  # fmt: skip


def test_every_declared_command_line_option_is_a_flag_of_generate():
    help_text = _cli("generate", "--help").stdout
    flags = [flag(o) for o in CLI_OPTIONS]
    missing = [f for f in flags if f not in help_text]
    assert not missing, missing
    wanted = ["--top-k", "--top-p", "--min-p", "--repetition-penalty", "--num-beams", "--compile", "--device",
              "--prompt-lookup-num-tokens", "--dtype", "--interactive", "--cache", "--names-filter"]  # fmt: skip
    assert [w for w in wanted if w not in help_text] == []
    # Every option that takes plain values has a command-line form; the rest take Python objects.
    objects = {"input", "inputs", "input_ids", "attention_mask", "token_type_ids", "generation_config",
               "use_past_kv_cache", "logits_processor", "generator", "tokenizer", "stopping_criteria", "streamer",
               "return_dict", "return_dict_in_generate", "top_logprobs", "output_logits", "output_scores",
               "return_cache", "return_input_tokens", "device", "padding_side", "controller", "assistant_model",
               "num_assistant_tokens"}  # fmt: skip
    assert {o.name for o in OPTIONS if o.cli is None} == objects


def test_generate_flags_reach_generate(folder):
    args = ["--max-new-tokens", "6", "--temperature", "0.8", "--top-k", "7", "--top-p", "0.9", "--seed", "4",
            "--repetition-penalty", "1.3", "--suppress-tokens", "5", "6", "--logit-bias", '{"7": -2.5}']  # fmt: skip
    out = _cli("generate", str(folder), "Hello", *args)
    assert out.returncode == 0, out.stderr
    model = make_bridge("llama")
    expected = model.generate("Hello", max_new_tokens=6, temperature=0.8, top_k=7, top_p=0.9, seed=4,
                              repetition_penalty=1.3, suppress_tokens=[5, 6], logit_bias={7: -2.5})  # fmt: skip
    assert out.stdout.rstrip("\n") == expected
    beams = _cli("generate", str(folder), "Hello", "--max-new-tokens", "4", "--num-beams", "3", "--no-do-sample")
    assert beams.stdout.rstrip("\n") == model.generate("Hello", max_new_tokens=4, num_beams=3)
    bad = _cli("generate", str(folder), "Hello", "--top-p", "1.5")
    assert bad.returncode != 0 and "`top_p` must be a float in (0, 1], got 1.5" in bad.stderr


def test_cache_flag_saves_what_run_with_cache_gives(folder, tmp_path):
    out_file = tmp_path / "acts.safetensors"
    out = _cli("generate", str(folder), "Hello", "--max-new-tokens", "5", "--cache", str(out_file),
               "--names-filter", "blocks.*.hook_resid_post,pattern")  # fmt: skip
    assert out.returncode == 0, out.stderr
    model = make_bridge("llama")
    tokens = model.generate("Hello", max_new_tokens=5, return_type="tokens")
    names = [n for n in model.hook_dict if n.endswith("hook_resid_post") or n.endswith("hook_pattern")]
    _, expected = model.run_with_cache(tokens, names_filter=names)
    saved = ActivationCache.load(out_file)
    assert sorted(saved.keys()) == sorted(expected.keys())
    for name in names:
        assert torch.equal(saved[name], expected[name]), name
    assert "saved" in out.stderr
    missing = _cli("generate", str(folder), "Hello", "--names-filter", "resid_post")
    assert missing.returncode != 0 and "add --cache" in missing.stderr


def test_interactive_session_on_stdin(folder):
    session = "Hello\n:set temperature 0.9\n:set seed 3\nHi\n:options\n:set top_q 3\n:unset temperature\nHi\n:quit\n"
    out = _cli("generate", str(folder), "--interactive", "--max-new-tokens", "5", stdin=session)
    assert out.returncode == 0, out.stderr
    model = make_bridge("llama")
    text = out.stdout
    greedy_hello = model.generate("Hello", max_new_tokens=5)
    sampled_hi = model.generate("Hi", max_new_tokens=5, temperature=0.9, seed=3)
    greedy_hi = model.generate("Hi", max_new_tokens=5, seed=3)
    assert text.index(greedy_hello) < text.index(sampled_hi) < text.rindex(greedy_hi)
    assert "temperature=0.9" in text and "seed=3" in text
    assert "unknown option 'top_q'. Did you mean 'top_p'?" in text


def test_interactive_loop_stops_a_generation_on_ctrl_c_and_goes_on():
    """SIGINT during a generation (sent from a hook at decode step 3) stops that generation only."""
    model = make_bridge("llama")

    def interrupt(x, hook):
        if hook.ctx.phase == "decode" and hook.ctx.step == 3 and torch.all(hook.ctx.positions > 5):
            os.kill(os.getpid(), signal.SIGINT)

    out = io.StringIO()
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN in a background job, Python's handler otherwise
    with model.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", interrupt)]):
        run_repl(model, {"max_new_tokens": 20, "stop_at_eos": False}, io.StringIO("Hello there\nHi\n"), out)
    text = out.getvalue()
    assert "[stopped]" in text
    rest = text.split("[stopped]", 1)[1]
    assert model.generate("Hi", max_new_tokens=20, stop_at_eos=False) in rest  # the loop went on
    assert signal.getsignal(signal.SIGINT) is before  # the loop's handler is gone


def test_parse_setting_uses_the_flags_types():
    assert parse_setting("top_k 5") == ("top_k", 5)
    assert parse_setting("top-p=0.5") == ("top_p", 0.5)
    assert parse_setting("suppress_tokens 3 4") == ("suppress_tokens", [3, 4])
    assert parse_setting('logit_bias {"3": -1}') == ("logit_bias", {3: -1})
    assert parse_setting("do_sample false") == ("do_sample", False)
    assert parse_setting("temperature") == ("temperature", None)
    with pytest.raises(ValueError, match="`top_k` takes int"):
        parse_setting("top_k many")


@pytest.mark.real
def test_ctrl_c_in_a_real_subprocess_stops_the_generation_and_the_loop_goes_on():
    proc = subprocess.Popen(
        [sys.executable, "-m", "transformer_bridge", "generate", "smollm2", "--interactive",
         "--max-new-tokens", "400", "--no-stop-at-eos"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        proc.stdin.write("Once upon a time\n")
        proc.stdin.flush()
        time.sleep(20)  # loading, then generating
        proc.send_signal(signal.SIGINT)
        time.sleep(2)
        proc.stdin.write(":options\n:quit\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "[stopped]" in out and "max_new_tokens=400" in out


# -- checks before any model is loaded, the BOS default, a prompt with --interactive -----------------------------
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--cache", "/nonexistent/x.safetensors"],
            r"--cache '/nonexistent/x.safetensors': no such folder '/nonexistent'",
        ),
        (["--cache", "."], r"--cache '\.' is a folder; give a file name in it"),
        (["--min-new-tokens", "5", "--max-new-tokens", "2"], r"--min-new-tokens 5 is more than --max-new-tokens 2"),
        (["--interactive", "--cache", "x.safetensors"], r"does not go with --interactive"),
    ],
)
def test_flags_are_checked_before_the_model_is_loaded(flags, message):
    # The model folder does not exist either: the flags are refused first, before anything is loaded.
    with pytest.raises(SystemExit, match=message):
        main(["generate", "/nonexistent/model", "Hello", *flags])


def test_a_prompt_given_with_interactive_is_the_first_turn(folder, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n:quit\n"))
    main(["generate", str(folder), "Hello", "--interactive", "--max-new-tokens", "4"])
    out = capsys.readouterr().out
    model = make_bridge("llama")
    first, second = model.generate("Hello", max_new_tokens=4), model.generate("Hi", max_new_tokens=4)
    assert f">>> Hello\n{first}\n" in out and f">>> {second}\n" in out


def test_generate_help_states_the_bos_default():
    help_text = " ".join(_cli("generate", "--help").stdout.split())
    assert "smollm2" in help_text and "<|im_start|>" in help_text and "--no-prepend-bos" in help_text


@pytest.mark.real
def test_smollm2_text_gets_no_bos_by_default_as_the_readme_advises(smollm2, capsys):
    prompt = "Once upon a time"  # a prompt whose greedy completion differs with and without the BOS
    raw, chat = (smollm2.generate(prompt, max_new_tokens=8, prepend_bos=bos) for bos in (False, True))
    assert raw != chat
    main(["generate", "smollm2", prompt, "--max-new-tokens", "8"])
    assert capsys.readouterr().out.rstrip("\n") == raw.rstrip("\n")
    main(["generate", "smollm2", prompt, "--max-new-tokens", "8", "--prepend-bos"])
    assert capsys.readouterr().out.rstrip("\n") == chat.rstrip("\n")


def test_help_answers_at_once_without_torch():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    probe = ("import sys, transformer_bridge.cli.main as m; m.parser().format_help(); "
             "print(sorted(k for k in sys.modules if k.split('.')[0] in ('torch', 'transformers')))")  # fmt: skip
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=ROOT)
    assert loaded.returncode == 0 and loaded.stdout.strip() == "[]", loaded.stdout + loaded.stderr
    for args in (["--help"], ["generate", "--help"]):
        start = time.perf_counter()
        out = _cli(*args)
        seconds = time.perf_counter() - start
        assert out.returncode == 0 and "usage: transformer-bridge" in out.stdout, out.stderr
        assert seconds < 1.5, f"`python -m transformer_bridge {' '.join(args)}` took {seconds:.2f} s"
