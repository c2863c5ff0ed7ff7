"""int8 weights: int8 variables with per-channel scales, quantized at load, against the float32 original graph.

The bound: int8 may not stray from the float32 graph by much more than rounding the weights alone does.
That reference is computed here with numpy (each matrix quantized and dequantized per output channel, then
the float32 graph run on the result), so it shares no code with the int8 path."""

import numpy as np
import pytest
import tensorflow as tf

import gpt2_tf
from gpt2_tf import HParams, kernels, precision
from gpt2_tf.checkpoint import CheckpointError
from gpt2_tf.decoding import empty_cache
from gpt2_tf.tf1_reference import Reference

from conftest import FIXTURES
from test_precision import fidelity

MATRICES = ('attn/c_attn/w', 'attn/c_proj/w', 'mlp/c_fc/w', 'mlp/c_proj/w')
SHAPES = [HParams(n_vocab=500, n_ctx=64, n_embd=64, n_head=4, n_layer=2),
          HParams(n_vocab=800, n_ctx=48, n_embd=96, n_head=6, n_layer=4)]


def is_matrix(name: str) -> bool:
    return name == 'model/wte' or name.endswith(MATRICES)


def rounded(value: np.ndarray, name: str) -> np.ndarray:
    """value with each output channel rounded to 255 levels of max|channel| / 127, back in float32."""
    v = value.astype(np.float64)
    if name == 'model/wte':  # a scale per row (token), serving the lookup and the tied logits
        step = np.abs(v).max(axis=1, keepdims=True) / 127
    else:  # conv1d w [1, nx, nf]: a scale per output column
        step = np.abs(v).max(axis=(0, 1), keepdims=True) / 127
    step[step == 0] = 1
    return (np.round(v / step) * step).astype(np.float32)


def weight_rounding_only(folder):
    """The float32 model with only its weights rounded per output channel (numpy, float32 arithmetic)."""
    model = gpt2_tf.load_model(folder)
    for name, variable in model.variables_by_name().items():
        if is_matrix(name):
            variable.assign(rounded(variable.numpy(), name))
    return model


def assert_within_the_rounding_bound(int8_logits, rounded_logits, reference):
    diff, agree, kl = fidelity(int8_logits, reference)
    bound_diff, bound_agree, bound_kl = fidelity(rounded_logits, reference)
    # The bound: 2.5x the max relative difference, 5x the mean KL, argmax agreement within 0.02.
    assert diff <= 2.5 * bound_diff, (diff, bound_diff)
    assert kl <= 5 * bound_kl, (kl, bound_kl)
    assert agree >= bound_agree - 0.02, (agree, bound_agree)
    return (diff, agree, kl), (bound_diff, bound_agree, bound_kl)


def test_matrices_are_int8_variables_with_a_scale_per_output_channel():
    model = gpt2_tf.load_model(FIXTURES / 'tf1-tiny', dtype='int8')
    variables = model.variables_by_name()
    hp = model.hparams
    int8 = {name for name, v in variables.items() if v.dtype == tf.int8}
    assert int8 == {n for n in variables if is_matrix(n)} and len(int8) == 1 + 4 * hp.n_layer
    assert variables['model/wte_scale'].shape == [hp.n_vocab]
    assert variables['model/h0/mlp/c_fc/w_scale'].shape == [4 * hp.n_embd]
    rest = {name for name, v in variables.items() if v.dtype == tf.float32}
    assert rest == set(variables) - int8  # norms, biases, wpe and the scales
    assert all(v.dtype == tf.int8 for v in model.variables if v.name.split(':')[0] in int8)  # in model.variables


def test_quantization_is_symmetric_per_channel_round_to_nearest():
    float32 = gpt2_tf.load_model(FIXTURES / 'tf1-tiny').variables_by_name()
    int8 = gpt2_tf.load_model(FIXTURES / 'tf1-tiny', dtype='int8').variables_by_name()
    for name in filter(is_matrix, float32):
        w = float32[name].numpy().astype(np.float64)
        scale = int8[name + '_scale'].numpy().astype(np.float64)
        expected_scale = np.abs(w).max(axis=1 if name == 'model/wte' else (0, 1)) / 127
        np.testing.assert_allclose(scale, expected_scale, rtol=1e-6, err_msg=name)  # float32's rounding
        step = scale[:, None] if name == 'model/wte' else scale
        q = int8[name].numpy().astype(np.int32)
        assert np.abs(q).max() == 127, name  # the largest weight of some channel maps to +-127
        assert np.abs(q - w / step).max() <= 0.5 + 1e-4, name  # the nearest level


def test_a_subnormal_channel_rounds_to_zero_and_damaged_weights_are_refused():
    tiny = np.finfo(np.float32).smallest_subnormal
    w = np.array([[190 * tiny, 1.0, 0.0], [-36 * tiny, -0.5, 0.0], [tiny, 0.25, 0.0]], np.float32)
    with np.errstate(divide='raise', invalid='raise', over='raise'):  # no division by a zero scale
        q, scale = precision.quantize(w, rows=False)
    assert (q[:, 0] == 0).all() and scale[2] == 1  # within half a step of 0 (no 190 wrapped to -66); a zero channel
    assert (np.abs(q.astype(np.float64) * scale - w).max(axis=0) <= scale / 2).all()
    for bad in (np.nan, np.inf):
        w[1, 1] = bad
        with pytest.raises(gpt2_tf.GPT2Error, match='model/h0/mlp/c_fc/w holds NaN or infinite values, which int8 '
                                                    'cannot hold: the checkpoint is damaged'):
            precision.quantize(w, rows=False, name='model/h0/mlp/c_fc/w')


def test_wide_matrices_are_held_in_panels_of_128_channels(random_checkpoint):
    hparams = SHAPES[0]  # c_fc has 256 output channels: two panels; the others are narrower or not a multiple
    folder = random_checkpoint(hparams, seed=3, scale=0.1)
    float32 = gpt2_tf.load_model(folder).variables_by_name()
    int8 = gpt2_tf.load_model(folder, dtype='int8').variables_by_name()
    for name in filter(is_matrix, float32):
        w = float32[name].numpy()
        step = int8[name + '_scale'].numpy().astype(np.float64)
        expected = np.round(w / (step[:, None] if name == 'model/wte' else step)).astype(np.int8)
        if name.endswith('mlp/c_fc/w'):  # [1, nx, 256] stored as [2, nx, 128] in the same shape
            nx = w.shape[1]
            expected = np.ascontiguousarray(expected.reshape(nx, 2, 128).transpose(1, 0, 2)).reshape(w.shape)
        np.testing.assert_array_equal(int8[name].numpy(), expected, err_msg=name)
        np.testing.assert_array_equal(precision.unpacked(int8[name]),
                                      np.round(w / (step[:, None] if name == 'model/wte' else step)), err_msg=name)


@pytest.mark.parametrize('fixture', ['tf1-tiny', 'tf1-tiny-hot'])
def test_int8_logits_on_the_fixtures(fixture):
    ref = np.load(FIXTURES / fixture / 'reference.npz')
    int8 = gpt2_tf.load_model(FIXTURES / fixture, dtype='int8')(ref['tokens'])['logits'].numpy()
    bound = weight_rounding_only(FIXTURES / fixture)(ref['tokens'])['logits'].numpy()
    if fixture == 'tf1-tiny-hot':  # saturated softmax on purpose: only the logits' scale is comparable
        diff, bound_diff = (fidelity(x, ref['logits'])[0] for x in (int8, bound))
        assert diff <= 2.5 * bound_diff, (diff, bound_diff)
    else:
        assert_within_the_rounding_bound(int8, bound, ref['logits'])


@pytest.mark.parametrize('hparams', SHAPES, ids=['2-layer', '4-layer'])
def test_int8_logits_on_random_checkpoints(random_checkpoint, hparams):
    folder = random_checkpoint(hparams, seed=3, scale=0.1)
    tokens = np.random.default_rng(0).integers(0, hparams.n_vocab, (4, hparams.n_ctx)).astype(np.int32)
    reference = Reference(hparams, str(folder / 'model.ckpt'))(tokens)['logits']
    int8 = gpt2_tf.load_model(folder, dtype='int8')(tokens)['logits']
    assert int8.dtype == tf.float32
    bound = weight_rounding_only(folder)(tokens)['logits'].numpy()
    assert_within_the_rounding_bound(int8.numpy(), bound, reference)


@pytest.mark.slow
def test_int8_logits_on_a_124m_shaped_checkpoint(random_checkpoint):
    hparams = HParams.named('124M')
    folder = random_checkpoint(hparams, scale=0.02)
    tokens = np.random.default_rng(0).integers(0, hparams.n_vocab, (2, 64)).astype(np.int32)
    reference = Reference(hparams, str(folder / 'model.ckpt'))(tokens)['logits']
    int8 = gpt2_tf.load_model(folder, dtype='int8')(tokens)['logits'].numpy()
    bound = weight_rounding_only(folder)(tokens)['logits'].numpy()
    measured, rounding = assert_within_the_rounding_bound(int8, bound, reference)
    print(f'\n124M-shaped int8 (diff, agreement, KL) {measured}; weights rounded alone {rounding}')


def test_the_kernel_and_the_tensorflow_ops_give_the_same_model():
    if not kernels.available():
        pytest.skip(kernels.unavailable_reason())
    tokens = np.load(FIXTURES / 'tf1-tiny' / 'reference.npz')['tokens']
    kernel = gpt2_tf.load_model(FIXTURES / 'tf1-tiny', dtype='int8')(tokens)['logits'].numpy()
    with kernels.tensorflow_ops():
        ops = gpt2_tf.load_model(FIXTURES / 'tf1-tiny', dtype='int8')(tokens)['logits'].numpy()
    # float32 sums in another order: a few ulps of the largest logit.
    np.testing.assert_allclose(kernel, ops, rtol=0, atol=2e-5 * max(1, np.abs(ops).max()))


def test_the_tensorflow_ops_keep_int8_constants_and_no_custom_op():
    model = gpt2_tf.load_model(FIXTURES / 'tf1-tiny', dtype='int8')
    with kernels.tensorflow_ops():
        graph = tf.function(lambda x: model.forward(x)['logits']).get_concrete_function(
            tf.TensorSpec([1, 4], tf.int32)).graph
    ops = {op.type for op in graph.get_operations()}
    assert 'Gpt2Int8MatMul' not in ops
    read = [op for op in graph.get_operations() if op.type == 'ReadVariableOp' and op.get_attr('dtype') == tf.int8]
    assert len(read) == 2 + 4 * model.hparams.n_layer  # read as int8, cast in the graph; wte for lookup and logits


def test_decoding_keeps_a_float32_cache_and_matches_the_forward_pass():
    model = gpt2_tf.load_model(FIXTURES / 'tf1-tiny', dtype='int8')
    assert empty_cache(model, 2, 16)[0].dtype == tf.float32
    tokens = np.load(FIXTURES / 'tf1-tiny' / 'reference.npz')['tokens']
    greedy = np.asarray(gpt2_tf.sample_sequence(model, 8, context=tokens[:, :5], top_k=1))
    x = tokens[:, :5]
    for _ in range(8):  # the same greedy tokens from full forward passes
        x = np.concatenate([x, model(x)['logits'].numpy()[:, -1:].argmax(-1).astype(x.dtype)], axis=1)
    np.testing.assert_array_equal(greedy, x)


def test_saving_an_int8_model_is_refused(tmp_path):
    model = gpt2_tf.load_model(FIXTURES / 'tf1-tiny', dtype='int8')
    with pytest.raises(CheckpointError, match='int8 model cannot be saved: the original format holds float32'):
        gpt2_tf.save_checkpoint(model, tmp_path)
    assert not list(tmp_path.iterdir())


def test_int8_decodes_under_xla_by_default_with_the_same_tokens(random_checkpoint):
    # Where the kernel compiles under XLA (its custom call), int8 decoding runs there; the tokens are those of
    # the plain tf.function: greedy, seeded top_k, and a prompt long enough for the GEMM path (64+ rows).
    from gpt2_tf import compiled, kernels

    if not kernels.xla_available():
        pytest.skip(kernels.unavailable_reason() or 'the kernel was built without XLA')
    hparams = HParams(n_vocab=300, n_ctx=128, n_embd=256, n_head=4, n_layer=2)
    model = gpt2_tf.load_model(random_checkpoint(hparams, seed=5), dtype='int8')
    assert compiled.default_mode(model) == 'xla'
    rows = np.random.default_rng(0).integers(0, 300, (3, 70)).astype(np.int32)
    for context, options in [(rows[:, :9], dict(top_k=1)), (rows[:, :9], dict(top_k=40, seed=3)),
                             (rows, dict(top_k=1))]:
        np.testing.assert_array_equal(gpt2_tf.sample_sequence(model, 12, context=context, **options),
                                      gpt2_tf.sample_sequence(model, 12, context=context, mode='function', **options))


def test_int8_keeps_out_of_xla_where_its_persistent_cache_is_on(monkeypatch):
    # XLA code read back from the persistent cache into another process crashes at the kernel's call.
    from gpt2_tf import compiled, sample
    from gpt2_tf.validate import GPT2Error

    if not kernels.available():
        pytest.skip(kernels.unavailable_reason())
    model = gpt2_tf.load_model(FIXTURES / 'tf1-tiny', dtype='int8')
    monkeypatch.setenv('TF_XLA_FLAGS', '--tf_xla_persistent_cache_directory=/tmp/any')
    assert compiled.default_mode(model) == 'function'
    with pytest.raises(GPT2Error, match="mode='xla' for an int8 model with XLA's persistent cache on"):
        compiled.shared(sample.begin, model, 'xla')
    with pytest.raises(GPT2Error, match="jit_compile=True for an int8 model with XLA's persistent cache on"):
        gpt2_tf.load_model(FIXTURES / 'tf1-tiny', dtype='int8', jit_compile=True)
    assert gpt2_tf.load_model(FIXTURES / 'tf1-tiny', jit_compile=True).dtype == 'float32'  # no int8 kernel to call


def test_the_command_line_decodes_int8_twice_over_its_xla_cache(tmp_path):
    import os
    import subprocess
    import sys

    env = dict(os.environ, GPT2_TF_XLA_CACHE=str(tmp_path / 'xla'))
    for _ in range(2):  # the second run reads what the first one cached
        done = subprocess.run([sys.executable, '-m', 'gpt2_tf', 'generate', '--model_dir', 'test', '--dtype', 'int8',
                               '--length', '4', '--seed', '0', '--quiet', 'Hello'], capture_output=True, text=True,
                              env=env, cwd=FIXTURES.parent.parent, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]


def test_the_command_line_decodes_int8_without_onednn_unless_asked():
    import os
    import subprocess
    import sys

    oneDNN_on = 'oneDNN custom operations are on'  # TensorFlow's start-up line, shown by --verbose

    def start_up_lines(*args, **env):
        done = subprocess.run([sys.executable, '-m', 'gpt2_tf', *args, '--model_dir', 'test', '--dtype', 'int8',
                               '--verbose'], capture_output=True, text=True, cwd=FIXTURES.parent.parent, timeout=300,
                              env={k: v for k, v in os.environ.items() if k != 'TF_ENABLE_ONEDNN_OPTS'} | env)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stderr

    assert oneDNN_on not in start_up_lines('generate', '--length', '2', '--seed', '0', 'Hello')
    assert oneDNN_on in start_up_lines('generate', '--length', '2', '--seed', '0', 'Hello', TF_ENABLE_ONEDNN_OPTS='1')
