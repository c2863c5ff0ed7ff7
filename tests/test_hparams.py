import json

import pytest

from gpt2_tf import HParams
from gpt2_tf.hparams import PUBLISHED


def test_from_json_reads_published_layout(tmp_path):
    path = tmp_path / 'hparams.json'
    path.write_text(json.dumps({'n_vocab': 50257, 'n_ctx': 1024, 'n_embd': 768, 'n_head': 12, 'n_layer': 12}))
    assert HParams.from_json(path) == HParams.named('124M')


def test_published_sizes_by_name():
    assert set(PUBLISHED) == {'124M', '355M', '774M', '1558M'}
    assert HParams.named('117M') == HParams.named('124M')
    assert HParams.named('345M') == HParams.named('355M')
    assert HParams.named('1558M').n_head == 25 and HParams.named('774M').n_layer == 36
    with pytest.raises(ValueError, match="unknown model size '7B'"):
        HParams.named('7B')


def test_frozen():
    with pytest.raises(Exception):
        HParams.named('124M').n_layer = 3


@pytest.mark.parametrize('values, message', [
    ({'n_vocab': 10, 'n_ctx': 8, 'n_embd': 8, 'n_head': 2}, r"missing key\(s\) \['n_layer'\]"),
    ({'n_vocab': 10, 'n_ctx': 8, 'n_embd': 8, 'n_head': 2, 'n_layer': 1, 'n_mlp': 3}, r"unknown key\(s\) \['n_mlp'\]"),
    ({'n_vocab': 10, 'n_ctx': 0, 'n_embd': 8, 'n_head': 2, 'n_layer': 1}, 'n_ctx must be positive, got 0'),
    ({'n_vocab': 10, 'n_ctx': 8, 'n_embd': 8, 'n_head': 3, 'n_layer': 1}, r'n_embd \(8\) must be divisible by n_head \(3\)'),
    ({'n_vocab': 10, 'n_ctx': 8, 'n_embd': 8.0, 'n_head': 2, 'n_layer': 1}, 'n_embd must be an integer'),
    ({'n_vocab': True, 'n_ctx': 8, 'n_embd': 8, 'n_head': 2, 'n_layer': 1}, 'n_vocab must be an integer'),
])
def test_bad_hparams_name_the_problem(tmp_path, values, message):
    path = tmp_path / 'hparams.json'
    path.write_text(json.dumps(values))
    with pytest.raises(ValueError, match=message):
        HParams.from_json(path)


def test_bad_json_names_the_file(tmp_path):
    path = tmp_path / 'hparams.json'
    path.write_text('{"n_vocab": ')
    with pytest.raises(ValueError, match='hparams.json: not valid JSON'):
        HParams.from_json(path)
    path.write_bytes(b'\x89PNG\r\n\x1a\n\0\0\xff')  # a binary file: not UTF-8 either
    with pytest.raises(ValueError, match=r"hparams.json: not valid JSON \('utf-8' codec can't decode"):
        HParams.from_json(path)
    with pytest.raises(FileNotFoundError, match='no hparams.json'):
        HParams.from_json(tmp_path / 'missing' / 'hparams.json')
