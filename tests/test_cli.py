"""The gpt2-tf command, run in-process on the bundled test checkpoint and the fixtures."""

import io
import re

import pytest

from gpt2_tf.cli import BANNER, main

from conftest import FIXTURES

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
    assert 'using the bundled test checkpoint' in err and 'python download_model.py 124M' in err
    assert out.count('SAMPLE') == 2 and BANNER.format(1) in out and BANNER.format(2) in out
    again = run(capsys, monkeypatch, tmp_path, 'generate', 'Hello world', '--length', '8',
                '--nsamples', '2', '--batch_size', '2', '--seed', '3', *FAST)[1]
    assert again == out  # the same seed prints the same samples


def test_sample_is_unconditional(capsys, monkeypatch, tmp_path):
    code, out, _ = run(capsys, monkeypatch, tmp_path, 'sample', '--nsamples', '3', '--length', '5', '--seed', '1', *FAST)
    assert code == 0 and [int(n) for n in re.findall(r'SAMPLE (\d+)', out)] == [1, 2, 3]


def test_interactive_mode_reads_prompts_from_stdin(capsys, monkeypatch, tmp_path):
    code, out, _ = run(capsys, monkeypatch, tmp_path, 'generate', '--length', '6', '--seed', '1', *FAST,
                       stdin='First prompt\n\nSecond prompt\n')
    assert code == 0
    assert out.count('Model prompt >>> ') == 4  # two prompts, one empty line, then end of input
    assert 'Prompt should not be empty!' in out
    assert out.count(BANNER.format(1)) == 2 and out.count('=' * 80 + '\n') == 2


def test_model_folder_by_name(capsys, monkeypatch, tmp_path):
    code, out, err = run(capsys, monkeypatch, tmp_path, 'generate', 'Hi', '--models_dir', str(FIXTURES),
                         '--model_name', 'tf1-tiny', '--length', '4', '--temperature', '0', *FAST)
    # "Hi" is id 17250, outside this fixture's 512-token vocabulary.
    assert code == 2 and 'token id 17250 is outside the vocabulary [0, 512)' in err


@pytest.mark.parametrize('argv, message', [
    (['generate', 'x', '--model_name', '355M'], 'no model at checkpoints/355M; download it with: python download_model.py 355M'),
    (['generate', 'x', '--length', '129'], 'length 129 is longer than the window'),
    (['generate', 'x', '--top_k', '-1'], 'top_k must be an integer >= 0'),
    (['generate', 'x', '--nsamples', '3', '--batch_size', '2'], r'nsamples \(3\) must be a multiple of batch_size \(2\)'),
    (['generate', 'x', '--model_dir', '/nonexistent'], 'no model folder at /nonexistent'),
])
def test_errors_are_one_line(capsys, monkeypatch, tmp_path, argv, message):
    code, _, err = run(capsys, monkeypatch, tmp_path, *argv, *FAST)
    assert code == 2
    assert re.search(message, err.strip().splitlines()[-1])
