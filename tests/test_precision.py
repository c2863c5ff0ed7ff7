"""Reduced precision: bfloat16 and float16 weights against the float32 TF1 graph, within stated bounds."""

import numpy as np
import pytest
import tensorflow as tf

import gpt2_tf
from gpt2_tf import HParams
from gpt2_tf.decoding import empty_cache
from gpt2_tf.tf1_reference import Reference
from gpt2_tf.train import Trainer

from conftest import FIXTURES

# What each dtype must keep, measured against the float32 original graph (README, "Reduced precision"):
# max |logit difference| / max(1, max |logit|), next-token argmax agreement, mean KL(float32 || reduced).
BOUNDS = {'bfloat16': (6e-2, 0.95, 2e-3), 'float16': (1e-2, 0.98, 3e-4)}
SHAPES = [HParams(n_vocab=500, n_ctx=64, n_embd=64, n_head=4, n_layer=2),
          HParams(n_vocab=800, n_ctx=48, n_embd=96, n_head=6, n_layer=4)]


def fidelity(logits, reference) -> tuple:
    ref = reference.astype(np.float64)
    diff = float(np.abs(logits - ref).max()) / max(1.0, float(np.abs(ref).max()))
    agree = float((logits.argmax(-1) == ref.argmax(-1)).mean())
    log_p = ref - np.log(np.exp(ref - ref.max(-1, keepdims=True)).sum(-1, keepdims=True)) - ref.max(-1, keepdims=True)
    x = logits.astype(np.float64)
    log_q = x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)
    kl = float((np.exp(log_p) * (log_p - log_q)).sum(-1).mean())
    return diff, agree, kl


@pytest.mark.parametrize('dtype', ['bfloat16', 'float16'])
@pytest.mark.parametrize('hparams', SHAPES, ids=['2-layer', '4-layer'])
def test_reduced_precision_stays_within_its_bounds(random_checkpoint, hparams, dtype):
    folder = random_checkpoint(hparams, seed=3, scale=0.1)
    tokens = np.random.default_rng(0).integers(0, hparams.n_vocab, (4, hparams.n_ctx)).astype(np.int32)
    reference = Reference(hparams, str(folder / 'model.ckpt'))(tokens)['logits']
    model = gpt2_tf.load_model(folder, dtype=dtype)
    assert all(v.dtype == dtype for v in model.variables)  # held in the reduced dtype: half the memory
    out = model(tokens)
    assert out['logits'].dtype == tf.float32  # logits stay float32
    diff, agree, kl = fidelity(out['logits'].numpy(), reference)
    max_diff, min_agree, max_kl = BOUNDS[dtype]
    assert diff <= max_diff and agree >= min_agree and kl <= max_kl, (diff, agree, kl)


@pytest.mark.parametrize('dtype', ['bfloat16', 'float16'])
def test_reduced_precision_on_the_fixtures(fixture_dir, dtype):
    ref = np.load(fixture_dir / 'reference.npz')
    logits = gpt2_tf.load_model(fixture_dir, dtype=dtype)(ref['tokens'])['logits'].numpy()
    diff, agree, kl = fidelity(logits, ref['logits'])
    max_diff, min_agree, max_kl = BOUNDS[dtype]
    if fixture_dir.name == 'tf1-tiny-hot':  # saturated softmax on purpose: only the logits' scale is comparable
        assert diff <= max_diff, diff
    else:
        assert diff <= max_diff and agree >= min_agree and kl <= max_kl, (diff, agree, kl)


# Mean |log p - log p_float32| over every token, on logits near -100 (GPT-2's sit there): bfloat16's spacing there
# is 0.5, so logits rounded to it moved log-probs by 0.17 nats on average, float16's by 0.021.
NEAR_MINUS_100 = {'bfloat16': 0.08, 'float16': 0.01}


def log_softmax(x):
    x = x.astype(np.float64)
    return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))


@pytest.mark.parametrize('dtype', ['bfloat16', 'float16'])
def test_log_probs_hold_where_the_logits_sit_near_minus_100(random_checkpoint, tmp_path, dtype):
    hparams = SHAPES[0]
    model = gpt2_tf.load_model(random_checkpoint(hparams, seed=3, scale=0.1))
    u = np.random.default_rng(1).normal(size=hparams.n_embd).astype(np.float32)
    u /= np.linalg.norm(u)
    model.wte.assign(model.wte + u)  # every token's embedding shares u, and ln_f's bias b has b . u = -100
    model.ln_f.b.assign(-100 * u)
    gpt2_tf.save_checkpoint(model, tmp_path / 'shifted')
    tokens = np.random.default_rng(0).integers(0, hparams.n_vocab, (4, hparams.n_ctx)).astype(np.int32)
    reference = Reference(hparams, str(tmp_path / 'shifted' / 'model.ckpt'))(tokens)['logits']
    assert -130 < reference.min() and reference.max() < -60
    logits = gpt2_tf.load_model(tmp_path / 'shifted', dtype=dtype)(tokens)['logits'].numpy()
    moved = np.abs(log_softmax(logits) - log_softmax(reference)).mean()
    assert moved <= NEAR_MINUS_100[dtype], moved


def test_a_weight_past_float16s_range_is_refused_at_load(tmp_path):
    model = gpt2_tf.load_model(FIXTURES / 'tf1-tiny')
    model.h[1].mlp.c_fc.w.assign(tf.tensor_scatter_nd_update(model.h[1].mlp.c_fc.w, [[0, 3, 5]], [-1e5]))
    gpt2_tf.save_checkpoint(model, tmp_path / 'big')
    with pytest.raises(gpt2_tf.GPT2Error, match=r"model/h1/mlp/c_fc/w holds 1e\+05, past float16's range \(65504\): "
                                                r'load it in bfloat16 or float32'):
        gpt2_tf.load_model(tmp_path / 'big', dtype='float16')
    assert gpt2_tf.load_model(tmp_path / 'big', dtype='bfloat16').h[1].mlp.c_fc.w.dtype == tf.bfloat16


def test_float32_is_exactly_the_default():
    ref = np.load(FIXTURES / 'tf1-tiny' / 'reference.npz')
    default = gpt2_tf.load_model(FIXTURES / 'tf1-tiny')(ref['tokens'])['logits'].numpy()
    explicit = gpt2_tf.load_model(FIXTURES / 'tf1-tiny', dtype='float32')(ref['tokens'])['logits'].numpy()
    np.testing.assert_array_equal(default, explicit)


def test_the_cache_is_reduced_and_past_in_float32_is_accepted():
    model = gpt2_tf.load_model(FIXTURES / 'tf1-tiny', dtype='bfloat16')
    assert empty_cache(model, 2, 16)[0].dtype == tf.bfloat16
    tokens = np.load(FIXTURES / 'tf1-tiny' / 'reference.npz')['tokens']
    first = model(tokens[:, :5])
    assert first['present'].dtype == tf.float32
    model(tokens[:, 5:8], past=first['present'].numpy())  # a float32 past is cast
    greedy = gpt2_tf.sample_sequence(model, 10, context=tokens[:, :5], top_k=1)
    assert greedy.shape == (3, 15)


def test_saving_a_reduced_model_writes_float32(tmp_path):
    model = gpt2_tf.load_model(FIXTURES / 'tf1-tiny', dtype='bfloat16')
    gpt2_tf.save_checkpoint(model, tmp_path)
    reader = tf.train.load_checkpoint(str(tmp_path / 'model.ckpt'))
    assert set(reader.get_variable_to_dtype_map().values()) == {tf.float32}
    again = gpt2_tf.load_model(tmp_path)
    np.testing.assert_array_equal(again.variables_by_name()['model/wte'].numpy(),
                                  model.variables_by_name()['model/wte'].numpy().astype(np.float32))


def test_fine_tuning_stays_float32_and_bad_dtypes_are_refused():
    with pytest.raises(ValueError, match='fine-tuning needs float32 weights'):
        Trainer(gpt2_tf.load_model(FIXTURES / 'tf1-tiny', dtype='bfloat16'))
    with pytest.raises(ValueError, match="dtype must be one of \\('float32', 'bfloat16', 'float16', 'int8'\\)"):
        gpt2_tf.load_model(FIXTURES / 'tf1-tiny', dtype='int4')
