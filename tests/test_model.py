"""The model against the original TF1 graph: fixtures written by it, and the TF1 reference on random checkpoints."""

import contextlib
import pathlib

import numpy as np
import pytest
import tensorflow as tf

import gpt2_tf
from gpt2_tf import HParams, Model
from gpt2_tf import causal, kernels
from gpt2_tf import model as model_graph
from gpt2_tf.tf1_reference import Reference

from conftest import FIXTURES, FLOAT32, assert_close
from support import attention64, with_gradients


def load_reference(folder):
    return np.load(folder / 'reference.npz')


# --- fixtures written by the original graph --------------------------------------------------

def test_fixture_logits_and_present(fixture_dir):
    ref = load_reference(fixture_dir)
    out = gpt2_tf.load_model(fixture_dir)(ref['tokens'])
    assert_close(out['logits'], ref['logits'], 'logits', rel=FLOAT32)
    assert_close(out['present'], ref['present'], 'present', rel=FLOAT32)


def test_fixture_split_continues_from_past(fixture_dir):
    ref = load_reference(fixture_dir)
    model = gpt2_tf.load_model(fixture_dir)
    k = int(ref['split'])
    first = model(ref['tokens'][:, :k])
    out = model(ref['tokens'][:, k:], past=first['present'])
    assert_close(out['logits'], ref['split_logits'], 'split_logits', rel=FLOAT32)
    assert_close(out['present'], ref['split_present'], 'split_present', rel=FLOAT32)


def test_tf1_reference_reproduces_fixtures(fixture_dir):
    """The restated TF1 graph stays equal to the original code's outputs."""
    ref = load_reference(fixture_dir)
    graph = Reference(HParams.from_json(fixture_dir / 'hparams.json'), str(fixture_dir / 'model.ckpt'))
    out = graph(ref['tokens'])
    assert_close(out['logits'], ref['logits'], 'logits', rel=FLOAT32)
    assert_close(out['present'], ref['present'], 'present', rel=FLOAT32)
    k = int(ref['split'])
    split = graph(ref['tokens'][:, k:], past=graph(ref['tokens'][:, :k])['present'])
    assert_close(split['logits'], ref['split_logits'], 'split_logits', rel=FLOAT32)
    assert_close(split['present'], ref['split_present'], 'split_present', rel=FLOAT32)


# --- the TF1 reference on random checkpoints of other shapes ----------------------------------

SHAPES = [
    HParams(n_vocab=97, n_ctx=16, n_embd=8, n_head=1, n_layer=1),
    HParams(n_vocab=97, n_ctx=16, n_embd=24, n_head=3, n_layer=4),
    HParams(n_vocab=61, n_ctx=16, n_embd=48, n_head=12, n_layer=1),
    HParams(n_vocab=61, n_ctx=16, n_embd=36, n_head=12, n_layer=4),
]


@pytest.mark.parametrize('hparams', SHAPES, ids=lambda h: f'head{h.n_head}-layer{h.n_layer}')
def test_matches_tf1_on_random_checkpoints(random_checkpoint, hparams):
    folder = random_checkpoint(hparams, scale=0.3)
    model = gpt2_tf.load_model(folder)
    graph = Reference(hparams, str(folder / 'model.ckpt'))
    rng = np.random.default_rng(1)
    for batch in (1, 5):
        tokens = rng.integers(0, hparams.n_vocab, size=(batch, hparams.n_ctx), dtype=np.int32)
        for t in range(1, hparams.n_ctx + 1):
            ours, theirs = model(tokens[:, :t]), graph(tokens[:, :t])
            assert_close(ours['logits'], theirs['logits'], f'logits B={batch} T={t}', rel=FLOAT32)
            assert_close(ours['present'], theirs['present'], f'present B={batch} T={t}', rel=FLOAT32)
    assert model.tracing_count == 1  # 32 shapes, one trace


@pytest.mark.parametrize('hparams', SHAPES[1:3], ids=lambda h: f'head{h.n_head}-layer{h.n_layer}')
def test_past_chained_over_three_calls(random_checkpoint, hparams):
    folder = random_checkpoint(hparams, scale=0.3)
    model = gpt2_tf.load_model(folder)
    graph = Reference(hparams, str(folder / 'model.ckpt'))
    tokens = np.random.default_rng(2).integers(0, hparams.n_vocab, size=(5, 13), dtype=np.int32)
    ours_past = theirs_past = None
    for chunk in (tokens[:, :4], tokens[:, 4:5], tokens[:, 5:]):
        ours = model(chunk) if ours_past is None else model(chunk, past=ours_past)
        theirs = graph(chunk) if theirs_past is None else graph(chunk, past=theirs_past)
        assert_close(ours['logits'], theirs['logits'], 'chained logits', rel=FLOAT32)
        ours_past = ours['present'] if ours_past is None else tf.concat([ours_past, ours['present']], axis=-2)
        theirs_past = theirs['present'] if theirs_past is None else np.concatenate(
            [theirs_past, theirs['present']], axis=-2)
    assert_close(ours_past, theirs_past, 'chained present', rel=FLOAT32)
    # Chained presents equal one call over the whole sequence.
    assert_close(ours_past, graph(tokens)['present'], 'whole-sequence present', rel=FLOAT32)
    assert_close(ours['logits'], graph(tokens)['logits'][:, 5:], 'whole-sequence logits', rel=FLOAT32)


# --- a whole sequence's causal attention: the kernel's op, or TensorFlow's ops in parts when long --------

@pytest.mark.parametrize('where', ['kernel', 'TensorFlow ops'])
@pytest.mark.parametrize('traced', [False, True], ids=['eager', 'traced-unknown-length'])
@pytest.mark.parametrize('sequence', [1, 65, causal.PARTS_FROM - 1, causal.PARTS_FROM, 700, 1024])
def test_causal_attention_equals_the_original_and_so_do_its_gradients(sequence, traced, where):
    if where == 'kernel' and not kernels.attention_available():
        pytest.skip(kernels._attention_library())  # never under CI (test_kernels.test_the_kernel_builds_here)
    rng = np.random.default_rng(sequence)
    q, k, v = (rng.standard_normal((2, 3, sequence, 16)).astype(np.float32) * 2 for _ in range(3))
    grad_out = rng.standard_normal((2, 3, sequence, 16)).astype(np.float32)
    rows = []  # the query rows of each call of the attention weights

    def weights(q, *rest):
        rows.append(q.shape[2])
        return model_graph.attention_weights(q, *rest)

    def attend(q, k, v):
        mask = tf.reshape(model_graph.attention_mask(sequence, sequence, dtype=tf.float32), [1, 1, sequence, sequence])
        return causal.causal_attn(q, k, v, mask, weights=weights, mask=model_graph.attention_mask)

    with kernels.tensorflow_ops() if where == 'TensorFlow ops' else contextlib.nullcontext():
        ours = with_gradients(attend, *map(tf.constant, (q, k, v)), grad_out)
        if traced:  # the length unknown when traced: tf.cond picks parts or the whole at run time
            spec = tf.TensorSpec([None, 3, None, 16], tf.float32)
            ours = tf.function(lambda *t: with_gradients(attend, *t, grad_out), input_signature=[spec] * 3)(q, k, v)
    theirs = with_gradients(attention64, *(tf.constant(t.astype(np.float64)) for t in (q, k, v)), grad_out)
    assert_close(ours[0], theirs[0], 'attention', rel=FLOAT32)
    for name, a, b in zip('qkv', ours[1], theirs[1]):
        assert_close(a, b, f'gradient of {name}', rel=FLOAT32)
    if where == 'kernel':  # the kernel's op took it all: TensorFlow's weights never formed
        assert rows == []
    elif not traced:  # in parts from PARTS_FROM on, each part a PARTS-th of the queries (rounded up)
        size = -(-sequence // causal.PARTS)
        expected = [min(size, sequence - i * size) for i in range(causal.PARTS)]
        assert rows == (expected if sequence >= causal.PARTS_FROM else [sequence])


LONG = HParams(n_vocab=50, n_ctx=1024, n_embd=24, n_head=3, n_layer=2)


def test_a_long_sequence_matches_tf1(random_checkpoint):
    folder = random_checkpoint(LONG, scale=0.3)
    model = gpt2_tf.load_model(folder)
    graph = Reference(LONG, str(folder / 'model.ckpt'))
    tokens = np.random.default_rng(4).integers(0, LONG.n_vocab, size=(2, LONG.n_ctx), dtype=np.int32)
    for t in (LONG.n_ctx, 700):
        ours, theirs = model(tokens[:, :t]), graph(tokens[:, :t])
        assert_close(ours['logits'], theirs['logits'], f'logits T={t}', rel=FLOAT32)
        assert_close(ours['present'], theirs['present'], f'present T={t}', rel=FLOAT32)


# --- the module itself ------------------------------------------------------------------------

@pytest.mark.parametrize('dtype', ['float32', 'int8'])
def test_a_built_model_starts_at_zeros_with_gains_and_scales_at_one(dtype):
    # load_model alone builds its models unfilled (precision.unfilled), then assigns every variable.
    hparams = HParams(n_vocab=11, n_ctx=7, n_embd=12, n_head=3, n_layer=2)
    for name, v in Model(hparams, dtype=dtype).variables_by_name().items():
        assert np.all(v.numpy() == (1 if name.endswith(('/g', '_scale')) else 0)), name


def test_variable_names_are_checkpoint_names():
    hparams = HParams(n_vocab=11, n_ctx=7, n_embd=12, n_head=3, n_layer=2)
    shapes = {name: v.shape.as_list() for name, v in Model(hparams).variables_by_name().items()}
    expected = {'model/wte': [11, 12], 'model/wpe': [7, 12], 'model/ln_f/g': [12], 'model/ln_f/b': [12]}
    for i in range(2):
        expected.update({
            f'model/h{i}/ln_1/g': [12], f'model/h{i}/ln_1/b': [12],
            f'model/h{i}/attn/c_attn/w': [1, 12, 36], f'model/h{i}/attn/c_attn/b': [36],
            f'model/h{i}/attn/c_proj/w': [1, 12, 12], f'model/h{i}/attn/c_proj/b': [12],
            f'model/h{i}/ln_2/g': [12], f'model/h{i}/ln_2/b': [12],
            f'model/h{i}/mlp/c_fc/w': [1, 12, 48], f'model/h{i}/mlp/c_fc/b': [48],
            f'model/h{i}/mlp/c_proj/w': [1, 48, 12], f'model/h{i}/mlp/c_proj/b': [12],
        })
    assert shapes == expected


def test_eager_equals_tf_function():
    folder = FIXTURES / 'tf1-tiny-hot'
    ref = load_reference(folder)
    model = gpt2_tf.load_model(folder)
    assert tf.executing_eagerly()
    eager = model.forward(tf.constant(ref['tokens']))
    compiled = model(ref['tokens'])
    # Same ops; only graph rewrites (oneDNN's softmax among them) may round float32 differently.
    for name in ('logits', 'present'):
        scale = max(1.0, float(np.abs(ref[name]).max()))
        np.testing.assert_allclose(eager[name], compiled[name], rtol=0, atol=3e-6 * scale)


def ops_run(fn) -> set:
    """The op types the runtime ran in one call of fn, after TensorFlow's graph rewrites (its profiler's trace)."""
    import tempfile

    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    with tempfile.TemporaryDirectory() as folder:
        tf.profiler.experimental.start(folder)
        fn()
        tf.profiler.experimental.stop()
        space = xplane_pb2.XSpace.FromString(next(pathlib.Path(folder).rglob('*.xplane.pb')).read_bytes())
    return {metadata.name.split(':')[-1] for plane in space.planes for metadata in plane.event_metadata.values()}


def test_the_gelu_runs_fused_into_its_product_where_onednn_is_on():
    from tensorflow.python.util import _pywrap_util_port as port

    if not port.IsMklEnabled():  # on by default wherever TensorFlow loads through gpt2_tf (test_quiet)
        pytest.skip("TensorFlow's oneDNN ops are off")
    model = gpt2_tf.load_model(FIXTURES / 'tf1-tiny')
    tokens = np.zeros([2, 5], np.int32)
    model(tokens)
    ran = ops_run(lambda: model(tokens))
    assert '_MklNativeFusedMatMul' in ran and 'Tanh' not in ran, sorted(ran)


def test_logits_read_by_np_asarray_are_a_view_of_the_tensor():  # the README's advice, against .numpy()'s copy
    logits = gpt2_tf.load_model(FIXTURES / 'tf1-tiny')(np.zeros([1, 3], np.int32))['logits']
    assert not np.asarray(logits).flags.owndata and logits.numpy().flags.owndata


def test_new_batch_sequence_and_past_do_not_retrace():
    model = gpt2_tf.load_model(FIXTURES / 'tf1-tiny')
    for batch, t in [(1, 3), (4, 9), (2, 17)]:
        out = model(np.zeros([batch, t], np.int32))
    assert model.tracing_count == 1
    for t in (1, 5, 2):
        model(np.zeros([2, t], np.int32), past=out['present'])
    assert model.tracing_count == 2  # one trace for calls with past, one without


def test_device_can_be_pinned():
    ref = load_reference(FIXTURES / 'tf1-tiny')
    model = gpt2_tf.load_model(FIXTURES / 'tf1-tiny', device='/CPU:0')
    assert all(v.device.endswith('CPU:0') for v in model.variables)
    out = model(ref['tokens'])
    assert out['logits'].device.endswith('CPU:0')
    assert_close(out['logits'], ref['logits'], 'logits on /CPU:0', rel=FLOAT32)


@pytest.mark.parametrize('tokens, past, message', [
    ([[0, 512]], None, r'token id 512 is outside the vocabulary \[0, 512\)'),
    ([[-1, 3]], None, r'token id -1 is outside'),
    ([[1] * 33], None, r'sequence too long: 0 past \+ 33 new tokens > n_ctx = 32'),
    ([1, 2, 3], None, r'tokens must be \[batch, sequence\]'),
    ([[0.5]], None, 'tokens must be integers'),
    ([[1]], np.zeros([1, 2, 2, 4, 3, 7], np.float32), r'past must have shape \[1, 2, 2, 4, past_length, 8\]'),
    ([[1] * 2], np.zeros([1, 2, 2, 4, 31, 8], np.float32), r'31 past \+ 2 new tokens > n_ctx = 32'),
    ([[1]], [[1.0, 2.0], [3.0]], 'past must be an array of floats, the present a call returned; got a ragged'),
    ([[1]], np.zeros([1, 2, 2, 4, 3, 8], np.int32), 'past must be an array of floats, .*; got int32'),
    ([[1]], 'abc', 'past must be an array of floats'),
])
def test_bad_call_inputs(tokens, past, message):
    from gpt2_tf.validate import GPT2Error

    model = gpt2_tf.load_model(FIXTURES / 'tf1-tiny')
    with pytest.raises(GPT2Error, match=message):  # the project's one line, not TensorFlow's conversion error
        model(tokens, past=past)


@pytest.mark.parametrize('device, message', [('/GPU:7', r'no /GPU:7 visible \(this machine has: .*CPU:0'),
                                             ('cuda', "device 'cuda' is not a device name")])
def test_a_device_that_is_not_there_is_refused_not_replaced(device, message):
    from gpt2_tf.validate import GPT2Error

    with pytest.raises(GPT2Error, match=message):  # TensorFlow's soft placement would run it on the CPU
        gpt2_tf.load_model(FIXTURES / 'tf1-tiny', device=device)


def test_variable_shapes_without_building_agree_with_the_model():
    from gpt2_tf.checkpoint import variable_shapes
    hparams = HParams(n_vocab=11, n_ctx=7, n_embd=12, n_head=3, n_layer=3)
    built = {name: tuple(v.shape.as_list()) for name, v in Model(hparams).variables_by_name().items()}
    assert variable_shapes(hparams) == built


def test_xla_compiled_calls_match_fixtures(fixture_dir):
    ref = load_reference(fixture_dir)
    model = gpt2_tf.load_model(fixture_dir, jit_compile=True)
    out = model(ref['tokens'])
    assert_close(out['logits'], ref['logits'], 'XLA logits', rel=FLOAT32)
    assert_close(out['present'], ref['present'], 'XLA present', rel=FLOAT32)
    k = int(ref['split'])
    split = model(ref['tokens'][:, k:], past=model(ref['tokens'][:, :k])['present'])
    assert_close(split['logits'], ref['split_logits'], 'XLA split_logits', rel=FLOAT32)


def test_int64_ids_are_checked_before_any_cast():
    model = gpt2_tf.load_model(FIXTURES / 'tf1-tiny')
    with pytest.raises(ValueError, match='token id 4294967301 is outside the vocabulary'):
        model(np.array([[2**32 + 5]], np.int64))  # as int32 it would be id 5


def test_names_do_not_depend_on_the_callers_name_scope():
    hparams = HParams(n_vocab=11, n_ctx=7, n_embd=12, n_head=3, n_layer=1)
    with tf.name_scope('outer'):
        names = set(Model(hparams).variables_by_name())
    assert names == set(Model(hparams).variables_by_name())
    assert 'model/h0/mlp/c_fc/w' in names


def test_the_mask_holds_where_every_score_is_far_below_minus_1e4(random_checkpoint, tmp_path):
    # Queries and keys fixed by the biases alone (q = 128, k = -128 in every feature): every score, seen
    # or masked, is -128 * 128 * 8 / sqrt(8) = -46341. The original's -1e10 leaves attention uniform over
    # the past; a mask of -1e4 would put all of it on the masked future instead.
    hparams = HParams(n_vocab=61, n_ctx=16, n_embd=16, n_head=2, n_layer=2)
    model = gpt2_tf.load_model(random_checkpoint(hparams, scale=0.3))
    for block in model.h:
        w, b = block.attn.c_attn.w.numpy(), block.attn.c_attn.b.numpy()
        w[..., :2 * hparams.n_embd] = 0
        b[:hparams.n_embd], b[hparams.n_embd:2 * hparams.n_embd] = 128, -128
        block.attn.c_attn.w.assign(w)
        block.attn.c_attn.b.assign(b)
    prefix = gpt2_tf.save_checkpoint(model, tmp_path / 'far')
    assert -128 * 128 * hparams.head_size / np.sqrt(hparams.head_size) < -4e4
    tokens = np.random.default_rng(3).integers(0, hparams.n_vocab, size=(2, hparams.n_ctx), dtype=np.int32)
    theirs = Reference(hparams, prefix)(tokens)
    ours = gpt2_tf.load_model(tmp_path / 'far')(tokens)
    assert_close(ours['logits'], theirs['logits'], 'logits', rel=FLOAT32)
    assert_close(ours['present'], theirs['present'], 'present', rel=FLOAT32)
