"""The gpt2-tf command: in-process for what it prints, and as the real entry point in a subprocess
(and a pseudo-terminal) for what a user sees on stderr."""

import fcntl
import io
import json
import os
import pathlib
import pty
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time

import pytest

from gpt2_tf import quiet
from gpt2_tf.cli import BANNER, main
from gpt2_tf.cli.generation import session_seed

from conftest import FIXTURES, default_sigint

ROOT = pathlib.Path(__file__).parent.parent
GPT2_TF = [sys.executable, '-m', 'gpt2_tf.cli']
FAST = ['--mode', 'function', '--quiet']


def run(capsys, monkeypatch, tmp_path, *argv, stdin=None):
    monkeypatch.chdir(tmp_path)  # no checkpoints/ here
    if stdin is not None:
        monkeypatch.setattr('sys.stdin', io.StringIO(stdin))
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_falls_back_to_the_bundled_checkpoint_and_says_so(capsys, monkeypatch, tmp_path):
    code, out, err = run(capsys, monkeypatch, tmp_path, 'generate', 'Hello world', '--length', '8',
                         '--nsamples', '2', '--batch_size', '2', '--seed', '3', *FAST)
    assert code == 0
    assert 'using the bundled test checkpoint' in err and 'python -m gpt2_tf.download 124M' in err
    assert out.count('SAMPLE') == 2 and BANNER.format(1) in out and BANNER.format(2) in out
    again = run(capsys, monkeypatch, tmp_path, 'generate', 'Hello world', '--length', '8',
                '--nsamples', '2', '--batch_size', '2', '--seed', '3', *FAST)[1]
    assert again == out  # the same seed prints the same samples


def test_sample_is_unconditional(capsys, monkeypatch, tmp_path):
    code, out, _ = run(capsys, monkeypatch, tmp_path, 'sample', '--nsamples', '3', '--length', '5', '--seed', '1', *FAST)
    assert code == 0 and [int(n) for n in re.findall(r'SAMPLE (\d+)', out)] == [1, 2, 3]
    code, out, _ = run(capsys, monkeypatch, tmp_path, 'sample', '--nsamples', '4', '--batch_size', '2', '--length', '5',
                       '--seed', '1', *FAST)
    assert code == 0 and [int(n) for n in re.findall(r'SAMPLE (\d+)', out)] == [1, 2, 3, 4]  # not the original's 2, 4


def test_interactive_mode_reads_prompts_from_stdin(capsys, monkeypatch, tmp_path):
    code, out, err = run(capsys, monkeypatch, tmp_path, 'generate', '--length', '6', '--seed', '1', *FAST,
                         stdin='First prompt\n\nSecond prompt\n' + 'word ' * 130 + '\n')
    assert code == 0
    # stdout is not a terminal here: the prompts and refusals go to stderr, the samples alone to stdout
    assert err.count('Model prompt >>> ') == 5  # two prompts, an empty one, a long one, then end of input
    assert 'Prompt should not be empty!' in err
    assert ('the prompt: 131 tokens + length 6 exceeds the window by 8 (needs prompt + length - 1 <= n_ctx = 128): '
            'shorten the prompt or ask for fewer new tokens' in err)
    assert out.count(BANNER.format(1)) == 2 and out.count('=' * 80 + '\n') == 2 and 'Model prompt' not in out


def test_interactive_mode_draws_new_samples_for_each_prompt_from_seed_plus_its_number(capsys, monkeypatch, tmp_path):
    options = ('--length', '6', '--nsamples', '2', '--batch_size', '1', *FAST)
    code, out, _ = run(capsys, monkeypatch, tmp_path, 'generate', '--seed', '7', *options, stdin='Same\n\nSame\n')
    assert code == 0
    first, second = out.split('=' * 80 + '\n')[:2]
    assert first != second  # the original sets its seed once a session: a prompt typed again draws anew
    alone = [run(capsys, monkeypatch, tmp_path, 'generate', 'Same', '--seed', seed, *options)[1] for seed in '78']
    assert (first, second) == tuple(alone)  # prompt k draws as generate --seed 7+k (the empty one is not counted)
    assert session_seed(2 ** 63 - 1, 1) == -2 ** 63 and session_seed(-5, 2) == -3  # wrapped into int64


def test_interactive_mode_asks_again_for_a_prompt_outside_the_vocabulary(capsys, monkeypatch, tmp_path):
    code, out, err = run(capsys, monkeypatch, tmp_path, 'generate', '--model_dir', str(FIXTURES / 'tf1-tiny'),
                         '--length', '3', '--seed', '1', *FAST, stdin='Hi\n!!\n')  # 'Hi' is id 17250; '!!' 3228
    assert code == 0 and err.count('Model prompt >>> ') == 3, err
    assert "the prompt's token id 17250 is outside the vocabulary [0, 512)" in err
    assert "the prompt's token id 3228 is outside the vocabulary [0, 512)" in err and BANNER.format(1) not in out


def test_interactive_mode_asks_again_for_a_prompt_that_is_not_utf8(tmp_path):
    done = subprocess.run([*GPT2_TF, 'generate', '--length', '2', '--seed', '1', '--mode', 'function', '--quiet'],
                          input=b'caf\xe9\nHello\n', capture_output=True, cwd=tmp_path, timeout=300,
                          env=subprocess_env(PYTHONIOENCODING='utf-8:strict'))
    err = done.stderr.decode()
    assert done.returncode == 0 and 'Prompt is not UTF-8 text: type it again.' in err, err[-2000:]
    assert done.stdout.decode().count(BANNER.format(1)) == 1  # the next prompt ran


def test_a_stdout_that_cannot_encode_the_text_is_one_line(tmp_path):
    done = subprocess.run([*GPT2_TF, 'generate', 'Hello', '--model_name', 'test', '--length', '2', '--seed', '1',
                           '--mode', 'function', '--quiet', '--logit_bias', '2634:100'],  # always 'é'
                          capture_output=True, cwd=tmp_path, timeout=300, env=subprocess_env(PYTHONIOENCODING='ascii'))
    err = done.stderr.decode().strip()
    assert done.returncode == 2 and len(err.splitlines()) == 1, err[-2000:]
    assert err == "gpt2-tf: error: stdout's encoding (ascii) cannot write the samples' text: set PYTHONIOENCODING=utf-8"


def test_model_folder_by_name(capsys, monkeypatch, tmp_path):
    code, out, err = run(capsys, monkeypatch, tmp_path, 'generate', 'Hi', '--models_dir', str(FIXTURES),
                         '--model_name', 'tf1-tiny', '--length', '4', '--temperature', '0', *FAST)
    # "Hi" is id 17250, outside this fixture's 512-token vocabulary.
    assert code == 2 and "the prompt's token id 17250 is outside the vocabulary [0, 512)" in err


@pytest.mark.parametrize('argv, message', [
    (['generate', 'x', '--model_name', '355M'], 'no model at checkpoints/355M; download it with: python -m gpt2_tf.download 355M'),
    (['generate', 'x', '--model_name', '125M'], "'125M' is not a published model"),
    (['generate', 'x', '--models_dir', '/nonexistent'], '--models_dir /nonexistent is not a folder'),
    (['generate', 'x', '--model_dir', '/nonexistent'], 'no model folder at /nonexistent'),
    (['generate', 'x', '--length', '129'], 'length 129 is longer than the window'),
    (['generate', 'x' * 400, '--length', '100'], r'the prompt: 50 tokens \+ length 100 exceeds the window by 21'),
    (['generate', ''], 'the prompt is empty'),
    (['generate', 'ab\udcffcd'], r'the prompt is not UTF-8 text \(byte 0xff at character 2\): give it in UTF-8'),
    (['explore', 'test', '--prompt', 'ab\udcffcd'], r'--prompt is not UTF-8 text \(byte 0xff at character 2\)'),
    (['generate', 'x', '--top_k', '-1'], 'top_k must be an integer >= 0'),
    (['generate', 'x', '--top_p', '1.5'], r'top_p must be in \[0, 1\]'),
    (['generate', 'x', '--temperature', '3'], r'temperature must be in \[0, 2\]'),
    (['generate', 'x', '--batch_size', '0'], '--batch_size must be at least 1'),
    (['generate', 'x', '--nsamples', '0'], '--nsamples must be at least 1 for generate'),
    (['generate', 'x', '--nsamples', '-1'], '--nsamples must be >= 0'),
    (['generate', 'x', '--nsamples', '3', '--batch_size', '2'], r'--nsamples \(3\) must be a multiple of --batch_size \(2\)'),
    (['sample', '--nsamples', '3', '--batch_size', '2'], r'--nsamples \(3\) must be a multiple of --batch_size \(2\)'),
    (['generate', 'x', '--seed', '99999999999999999999'], 'seed 99999999999999999999 is out of range'),
    (['sample', '--length', '200'], 'length 200 is longer than the window: at most n_ctx = 128'),
    (['sample', '--model_dir', str(FIXTURES / 'tf1-tiny')], r"unconditional samples start from <\|endoftext\|>, "
     r"which is token 50256, outside the model's vocabulary \[0, 512\): give a prompt with generate"),
    (['inspect', str(ROOT / 'README.md')], 'README.md is a file: give a model folder'),
    (['compare', str(FIXTURES / 'tf1-tiny'), '--tokens', '99999'], r'token id 99999 is outside the vocabulary \[0, 512\)'),
    (['compare', str(FIXTURES / 'tf1-tiny'), '--tokens', '-1 5'], 'token id -1 is outside'),
    (['compare', str(FIXTURES / 'tf1-tiny'), '--tokens', ''], '--tokens is empty'),
    (['compare', str(FIXTURES / 'tf1-tiny'), '--tokens', ' '.join(['1'] * 33)], 'sequence too long: 0 past \\+ 33'),
    (['compare', str(FIXTURES / 'tf1-tiny'), '--tokens', 'a b'], '--tokens takes token ids'),
    (['serve', '--max-batch', '0'], '--max-batch must be at least 1, got 0'),
    (['serve', '--queue-size', '-2'], '--queue-size must be at least 1, got -2'),
    (['serve', '--api-key', ''], '--api-key is empty: give a key, or leave --api-key out to serve without one'),
    (['serve', '--api-key', 'KEY '], '--api-key starts or ends with whitespace'),
    (['serve', '--timeout-graceful-shutdown', 'nan'], '--timeout-graceful-shutdown must be a number of seconds >= 0, '
                                                      'got nan'),
    (['serve', '--timeout-graceful-shutdown', '-1'], '--timeout-graceful-shutdown must be .* got -1$'),
    (['generate', 'x', '--adapter', '/nonexistent'], '--adapter /nonexistent: no adapter_config.json there'),
    (['generate', 'x', '--model_dir', 'test', '--model_name', 'nope'], '--model_dir names the model folder itself: '
     'give it or --model_name, not both'),
    (['sample', '--model_dir', 'test', '--models_dir', '/nonexistent'], 'give it or --models_dir, not both'),
])
def test_errors_are_one_line_and_come_before_tensorflow_loads(capsys, monkeypatch, tmp_path, argv, message):
    monkeypatch.setattr(quiet, 'tensorflow', lambda **_: pytest.fail('TensorFlow loaded before the check'))
    code, _, err = run(capsys, monkeypatch, tmp_path, *argv,
                       *([] if argv[0] in ('inspect', 'compare', 'explore') else FAST))
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert re.search(message, err.strip())


@pytest.mark.parametrize('argv', [
    ['generate', 'x', *FAST], ['sample', *FAST], ['score', 'text.txt'], ['finetune', 'text.txt'],
    ['explore', 'test', '--prompt', 'x'], ['inspect', 'test'], ['compare', str(FIXTURES / 'tf1-tiny'), '--tokens', '1'],
    ['export', 'test', 'out'], ['serve'],
])
def test_every_command_refuses_a_kernels_switch_neither_on_nor_off_before_tensorflow_loads(capsys, monkeypatch,
                                                                                           tmp_path, argv):
    # score once ran to the end with it: only the commands that decode reached the kernels, which refused it.
    monkeypatch.setattr(quiet, 'tensorflow', lambda **_: pytest.fail('TensorFlow loaded before the check'))
    monkeypatch.setenv('GPT2_TF_KERNELS', 'bogus')
    (tmp_path / 'text.txt').write_text('Some text to score.')
    code, _, err = run(capsys, monkeypatch, tmp_path, *argv)
    assert code == 2
    assert err.splitlines() == ["gpt2-tf: error: GPT2_TF_KERNELS='bogus' is neither off (off, 0, false, no, none) "
                                "nor on (on, 1, true, yes): set one, or unset it"]


def test_every_command_taking_model_dir_takes_model_dash_dir_too():
    from gpt2_tf.cli import parser

    commands = next(a for a in parser()._actions if a.dest == 'command').choices
    spellings = {name: a.option_strings for name, command in commands.items() for a in command._actions
                 if '--model_dir' in a.option_strings}
    assert 'encode' in spellings and all('--model-dir' in s for s in spellings.values()), spellings
    assert parser().parse_args(['encode', 'in.txt', 'out.bin', '--model-dir', 'folder']).model_dir == 'folder'


def test_a_vocabulary_without_end_of_text_refuses_what_needs_it_in_one_line(capsys, monkeypatch, tmp_path):
    from gpt2_tf.encoder import bytes_to_unicode

    folder = tmp_path / 'model'
    shutil.copytree(FIXTURES / 'tf1-tiny', folder)
    (folder / 'encoder.json').write_text(json.dumps({c: i for i, c in enumerate(bytes_to_unicode().values())}))
    (folder / 'vocab.bpe').write_text('#version: 0.2\n')
    (tmp_path / 'text.txt').write_text('Hello there')
    loads = quiet.tensorflow
    monkeypatch.setattr(quiet, 'tensorflow', lambda **_: pytest.fail('TensorFlow loaded before the check'))
    for argv, message in ((['sample', '--model_dir', str(folder)], 'which this vocabulary does not have'),
                          (['score', str(tmp_path / 'text.txt'), '--bos', '--model_dir', str(folder)],
                           '--bos puts <|endoftext|> before the text, and this vocabulary has none')):
        code, _, err = run(capsys, monkeypatch, tmp_path, *argv, '--quiet')
        assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
    monkeypatch.setattr(quiet, 'tensorflow', loads)
    code, out, err = run(capsys, monkeypatch, tmp_path, 'score', str(tmp_path / 'text.txt'), '--model_dir', str(folder),
                         '--quiet')  # scoring without --bos needs no <|endoftext|>
    assert code == 0 and '10 tokens, mean NLL' in out, err


def test_a_missing_gpu_is_an_error(capsys, monkeypatch, tmp_path):
    import tensorflow as tf

    if tf.config.list_logical_devices('GPU'):
        pytest.skip('this machine has a GPU')
    code, _, err = run(capsys, monkeypatch, tmp_path, 'generate', 'x', '--device', '/GPU:0', *FAST)
    assert code == 2 and 'no /GPU:0 visible' in err and 'drop the device (--device)' in err


def test_incomplete_downloads_are_named_with_the_command_that_resumes_them(capsys, monkeypatch, tmp_path):
    (tmp_path / 'checkpoints' / '124M.partial').mkdir(parents=True)
    code, out, err = run(capsys, monkeypatch, tmp_path, 'generate', 'Hi', '--length', '3', *FAST)
    assert code == 0 and out.count('SAMPLE') == 1
    assert 'the download of 124M is incomplete' in err and 'python -m gpt2_tf.download 124M' in err
    assert 'bundled test checkpoint' in err and len(err.strip().splitlines()) == 1
    code, _, err = run(capsys, monkeypatch, tmp_path, 'generate', 'Hi', '--model_name', '124M', *FAST)
    assert code == 2 and 'incomplete: run `python -m gpt2_tf.download 124M` again to resume it' in err
    # A folder that an older downloader left half-written.
    shutil.copytree(FIXTURES / 'tf1-tiny', tmp_path / 'checkpoints' / '355M')
    (tmp_path / 'checkpoints' / '355M' / 'model.ckpt.index').unlink()
    (tmp_path / 'checkpoints' / '355M' / 'model.ckpt.index.part').write_bytes(b'')
    code, _, err = run(capsys, monkeypatch, tmp_path, 'generate', 'Hi', '--model_name', '355M', *FAST)
    assert code == 2 and 'the download in checkpoints/355M is incomplete' in err


# --- the real entry point ------------------------------------------------------------------------

def subprocess_env(**extra):
    env = dict(os.environ)
    env.pop('TF_CPP_MIN_LOG_LEVEL', None)  # what a user's shell has: nothing set
    return {**env, **extra}


def test_stderr_holds_only_the_projects_own_lines(tmp_path):
    done = subprocess.run([*GPT2_TF, 'generate', 'Hello', '--length', '4', '--seed', '1'], cwd=tmp_path,
                          capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith('gpt2-tf: no model at checkpoints/124M'), lines
    assert BANNER.format(1) in done.stdout  # piped: no progress bar either
    failed = subprocess.run([*GPT2_TF, 'compare', str(FIXTURES / 'tf1-tiny'), '--tokens', '99999'], cwd=tmp_path,
                            capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert failed.returncode == 2
    assert failed.stderr.splitlines() == ["gpt2-tf: error: token id 99999 is outside the vocabulary [0, 512): give "
                                          "ids below 512, from this model's own vocabulary"]


def test_verbose_shows_tensorflows_start_up_lines(tmp_path):
    done = subprocess.run([*GPT2_TF, 'inspect', str(FIXTURES / 'tf1-tiny'), '--verbose'], cwd=tmp_path,
                          capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert done.returncode == 0
    assert 'oneDNN' in done.stderr or 'cuda' in done.stderr.lower()  # what the quiet start hides


def pty_session(argv, cwd, respond, *, timeout=180):
    """Runs argv on a pseudo-terminal; after each read (or half a second of quiet), respond(output, quiet) returns
    bytes to type or None. Returns (output as text, exit status)."""
    pid, fd = pty.fork()
    if pid == 0:
        os.chdir(cwd)
        default_sigint()
        os.execvpe(argv[0], argv, subprocess_env())
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack('HHHH', 24, 120, 0, 0))  # a terminal's size, as a user's has
    output, deadline = b'', time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            output += chunk
        typed = respond(output, not ready)
        if typed:
            os.write(fd, typed)
    if time.monotonic() >= deadline:  # the test fails on what it saw, rather than waiting on the child for ever
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return output.decode('utf-8', errors='replace'), status


def terminal_session(argv, keys, cwd, *, timeout=180):
    """Runs argv on a pseudo-terminal, typing each of keys once the previous output settles; returns the output."""
    pending = list(keys)

    def respond(output, quiet):
        return pending.pop(0) if quiet and pending and output.endswith(b'>>> ') else None

    return pty_session(argv, cwd, respond, timeout=timeout)[0]


@pytest.mark.slow
def test_interactive_mode_on_a_terminal_has_line_editing(tmp_path):
    # A left arrow on an empty line: with line editing it moves nothing and the line stays empty;
    # without it, the escape code would become the prompt and a sample would follow.
    out = terminal_session([*GPT2_TF, 'generate', '--length', '4', '--seed', '1', '--mode', 'function'],
                           [b'\x1b[D\r', b'Hello\r', b'\x04'], tmp_path)
    assert out.count('Model prompt >>> ') == 3
    assert 'Prompt should not be empty!' in out
    assert out.count(BANNER.format(1)) == 1


@pytest.mark.slow
def test_progress_shows_tokens_per_second_on_a_terminal(tmp_path):
    out = terminal_session([*GPT2_TF, 'generate', 'Hello', '--length', '64', '--chunk', '8', '--seed', '1',
                            '--mode', 'function'], [], tmp_path)
    assert re.search(r'generating: .*\d+/64.*tok/s', out), out[-500:]
    quiet_out = terminal_session([*GPT2_TF, 'generate', 'Hello', '--length', '64', '--seed', '1', '--quiet',
                                  '--mode', 'function'], [], tmp_path)
    assert 'tok/s' not in quiet_out


def test_generate_and_score_in_bfloat16(capsys, monkeypatch, tmp_path):
    code, out, _ = run(capsys, monkeypatch, tmp_path, 'generate', 'Hello', '--length', '4', '--dtype', 'bfloat16',
                       *FAST)
    assert code == 0 and out.count('SAMPLE') == 1
    (tmp_path / 'text.txt').write_text('Hello there, how are you today?')
    code, out, _ = run(capsys, monkeypatch, tmp_path, 'score', 'text.txt', '--dtype', 'bfloat16', '--quiet')
    assert code == 0 and 'perplexity' in out


# --- messages and help ---------------------------------------------------------------------------------

def test_a_mistyped_flag_shows_the_subcommands_usage_and_the_closest_flag(tmp_path):
    done = subprocess.run([*GPT2_TF, 'generate', 'Hello', '--temprature', '0.5'], cwd=tmp_path, capture_output=True,
                          text=True, env=subprocess_env(), timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith('usage: gpt2-tf generate ')
    assert done.stderr.splitlines()[-1] == ('gpt2-tf generate: error: unrecognized arguments: --temprature '
                                            '(did you mean --temperature?) 0.5')
    done = subprocess.run([*GPT2_TF, 'finetune', 'x.txt', '--learning-rat', '1'], cwd=tmp_path, capture_output=True,
                          text=True, env=subprocess_env(), timeout=60)
    assert done.returncode == 2 and done.stderr.startswith('usage: gpt2-tf finetune ')
    assert '(did you mean --learning_rate?)' in done.stderr.splitlines()[-1]


@pytest.mark.parametrize('argv, message', [
    (['--temperature', '3'], 'temperature must be in [0, 2] (0 is greedy), got 3'),
    (['--top_p=1.50'], 'top_p must be in [0, 1] (1: no truncation), got 1.50'),
    (['--temperature', '-0.25'], 'temperature must be in [0, 2] (0 is greedy), got -0.25'),
    (['--temperature', '1e400'], 'temperature must be in [0, 2] (0 is greedy), got 1e400'),  # inf to Python
    (['--logit_bias', '5:500'], 'logit_bias for token 5 must be a number in [-100, 100] (-100 bans, 100 forces), '
                                'got 500'),
])
def test_numbers_in_messages_are_as_typed_and_range_errors_exit_2(tmp_path, argv, message):
    done = subprocess.run([*GPT2_TF, 'generate', 'Hello', *argv], cwd=tmp_path, capture_output=True, text=True,
                          env=subprocess_env(), timeout=60)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f'gpt2-tf: error: {message}']


def test_every_options_help_names_its_default():
    from gpt2_tf.cli import parser

    commands = next(a for a in parser()._actions if a.dest == 'command').choices
    missing = [f'{name} {action.option_strings[0]}' for name, command in commands.items()
               for action in command._actions if action.option_strings and action.dest != 'help'
               and 'default' not in (action.help or '')]
    assert missing == []
    done = subprocess.run([*GPT2_TF, 'serve', '--help'], capture_output=True, text=True, env=subprocess_env(),
                          timeout=60)
    assert re.search(r'--port PORT\s+port to listen on \(default: 8000\)', done.stdout), done.stdout


def test_finetunes_flags_are_the_configs_fields_with_its_defaults():
    import dataclasses

    from gpt2_tf.cli import parser
    from gpt2_tf.train_config import FinetuneConfig

    commands = next(a for a in parser()._actions if a.dest == 'command').choices
    finetune = {a.dest: a for a in commands['finetune']._actions}
    for field in dataclasses.fields(FinetuneConfig):
        assert finetune[field.name].default == field.default, field.name
        assert 'default' in finetune[field.name].help, field.name


def test_choices_are_the_modules_own():
    from gpt2_tf import compiled, kernels, precision
    from gpt2_tf.cli import common, parser

    assert common.DTYPES == precision.DTYPES and common.MODES == compiled.MODES
    assert kernels.SWITCH_ENV == quiet.KERNELS_ENV  # one name, which the command line checks without TensorFlow
    commands = next(a for a in parser()._actions if a.dest == 'command').choices
    for name in ('generate', 'sample', 'score', 'serve', 'export', 'explore'):
        actions = {a.dest: a for a in commands[name]._actions}
        assert tuple(actions['dtype'].choices) == precision.DTYPES, name
        if 'mode' in actions:
            assert tuple(actions['mode'].choices) == compiled.MODES, name


def test_only_the_projects_errors_are_one_line(capsys, monkeypatch, tmp_path):
    from gpt2_tf.cli import generation
    from gpt2_tf.validate import GPT2Error

    monkeypatch.setattr(generation, 'checked_options', lambda args: (_ for _ in ()).throw(GPT2Error('named')))
    assert main(['generate', 'x']) == 2 and capsys.readouterr().err == 'gpt2-tf: error: named\n'
    monkeypatch.setattr(generation, 'checked_options', lambda args: (_ for _ in ()).throw(ValueError('a bug')))
    with pytest.raises(ValueError, match='a bug'):  # a bug keeps its traceback
        main(['generate', 'x'])


# --- interrupts ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_ctrl_c_during_an_interactive_generation_returns_to_the_prompt(tmp_path):
    argv = [*GPT2_TF, 'generate', '--length', '100', '--nsamples', '1000', '--chunk', '1', '--seed', '1',
            '--mode', 'function', '--quiet']
    sent = []

    def respond(output, quiet):
        if not sent and output.endswith(b'>>> '):
            sent.append('prompt')
            return b'Hello\r'
        if sent == ['prompt'] and output.count(b'SAMPLE') >= 2:  # mid-way through a thousand samples
            sent.append('ctrl-c')
            return b'\x03'
        if sent == ['prompt', 'ctrl-c'] and output.endswith(b'>>> '):
            sent.append('ctrl-d')
            return b'\x04'
        return None

    text, status = pty_session(argv, tmp_path, respond, timeout=240)
    assert sent == ['prompt', 'ctrl-c', 'ctrl-d'], text[-2000:]
    assert text.count('Model prompt >>> ') == 2 and 'interrupted' in text and text.count('SAMPLE') < 1000
    assert os.waitstatus_to_exitcode(status) == 0  # Ctrl-D at the prompt: a normal end


@pytest.mark.slow
def test_an_interrupted_finetune_saves_and_exits_130(tmp_path):
    import signal

    (tmp_path / 'corpus.txt').write_text('It was a bright cold day in April, and the clocks were striking. ' * 200)
    process = subprocess.Popen([*GPT2_TF, 'finetune', 'corpus.txt', '--model_name', 'test', '--sample_every', '0',
                                '--print_every', '1'], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=subprocess_env(), preexec_fn=default_sigint)
    lines = []
    while len(lines) < 2:  # two steps done
        line = process.stdout.readline()
        assert line, process.stderr.read()
        if 'loss=' in line:
            lines.append(line)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=180)
    assert process.returncode == 130, err
    assert 'interrupted' in out + err and (tmp_path / 'checkpoint' / 'run1' / 'checkpoint').exists()
    assert err.strip().splitlines()[-1].startswith('gpt2-tf: interrupted at step')


CTRL_C_AT_START = """
import builtins, sys
real = builtins.__import__

def interrupted(name, *args, **kwargs):
    if name == 'numpy':  # what gpt2_tf.cli imports first: Ctrl-C there
        raise KeyboardInterrupt
    return real(name, *args, **kwargs)

builtins.__import__ = interrupted
from gpt2_tf.console import main
sys.exit(main())
"""


def test_ctrl_c_while_the_command_line_loads_exits_130_without_a_traceback():
    done = subprocess.run([sys.executable, '-c', CTRL_C_AT_START, 'generate', 'x'], capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stderr) == (130, '')
