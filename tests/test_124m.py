"""A checkpoint of the 124M model's shapes, written by the TF1 Saver with random values."""

import time

import numpy as np
import pytest

import gpt2_tf
from gpt2_tf import HParams
from gpt2_tf.checkpoint import checkpoint_shapes
from gpt2_tf.tf1_reference import Reference

from conftest import assert_close

pytestmark = pytest.mark.slow

HPARAMS = HParams.named('124M')


@pytest.fixture(scope='module')
def folder(random_checkpoint):
    return random_checkpoint(HPARAMS, scale=0.02)


def test_124m_names_shapes_and_parameter_count(folder):
    start = time.perf_counter()
    model = gpt2_tf.load_model(folder)
    print(f'\n124M-shaped checkpoint loaded in {time.perf_counter() - start:.2f} s')
    shapes = checkpoint_shapes(folder)
    assert len(shapes) == 148
    assert {n: tuple(v.shape.as_list()) for n, v in model.variables_by_name().items()} == shapes
    assert shapes['model/h11/mlp/c_fc/w'] == (1, 768, 3072)
    assert sum(int(np.prod(s)) for s in shapes.values()) == 124_439_808
    assert sum(int(np.prod(v.shape)) for v in model.variables) == 124_439_808


def test_124m_logits_match_tf1(folder):
    model = gpt2_tf.load_model(folder)
    graph = Reference(HPARAMS, str(folder / 'model.ckpt'))
    tokens = np.random.default_rng(0).integers(0, HPARAMS.n_vocab, size=(2, 64), dtype=np.int32)
    ours, theirs = model(tokens), graph(tokens)
    assert_close(ours['logits'], theirs['logits'], '124M logits')
    assert_close(ours['present'], theirs['present'], '124M present')
