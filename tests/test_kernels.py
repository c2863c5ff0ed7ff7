"""The int8 product and the few-row float32 product: the C++ kernel (as a TensorFlow op, and as XLA's custom
call inside an XLA-compiled function) and the TensorFlow fallback, against a float64 numpy product; where the
float32 kernel is taken. A whole sequence's attention (attention.cc, a library of its own) against float64
autograd, and where it is taken."""

import contextlib
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import tensorflow as tf

from gpt2_tf import kernels, precision
from gpt2_tf.validate import GPT2Error

from support import attention64, with_gradients

SHAPES = [(1, 768, 2304, False), (3, 64, 200, False), (8, 300, 77, False), (5, 96, 1000, True),
          (1, 768, 5000, True), (17, 100, 130, False), (6, 33, 17, True), (16, 768, 3072, False),
          (11, 768, 1001, True), (16, 80, 64, False),
          # rows split evenly over a group's tiles: AVX-512 7 + 8 and 4 + 5, AVX2 3 + 4 + 4 + 4 and 3 + 3 + 3
          (15, 200, 384, False), (9, 64, 256, False), (9, 64, 300, True),
          (2, 40, 130, True),  # wte's tile of two rows
          (1, 64, 200, False),  # one row, channels not a whole number of its 128-channel tiles
          (16, 48, 50, True), (64, 96, 2500, False), (70, 40, 4100, True),  # the tiles at many rows
          (384, 96, 2500, False), (390, 40, 4100, True),  # enough rows for the GEMM, over more than one chunk
          (64, 0, 8, False), (3, 0, 8, True)]  # an empty sum (k = 0): zeros


def case(m, k, n, transpose, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.integers(-127, 128, (n, k) if transpose else (k, n)).astype(np.int8)
    scale = (rng.random(n) * 0.02 + 1e-3).astype(np.float32)
    reference = x.astype(np.float64) @ ((w.T if transpose else w).astype(np.float64) * scale)
    return x, w, scale, reference


def test_the_kernel_builds_here():
    # CI's machines have g++ and TensorFlow's XLA headers; elsewhere the fallback is used and this says why.
    if os.environ.get('CI') == 'true':
        assert kernels.available(), kernels.unavailable_reason()
        assert kernels.xla_available()
        assert kernels.attention_available(), kernels._attention_library()
    elif not kernels.available():
        pytest.skip(kernels.unavailable_reason())


WHERE = ['kernel', 'kernel under XLA', 'TensorFlow ops']


def run(fn, x, where, call):
    """fn(x) eagerly, or XLA-compiled where `where` says so, whose HLO is checked to call `call` -> numpy."""
    if where != 'TensorFlow ops' and not (kernels.xla_available() if 'XLA' in where else kernels.available()):
        pytest.skip(kernels.unavailable_reason() or 'the kernel was built without XLA')
    if 'XLA' not in where:
        return fn(tf.constant(x)).numpy()
    compiled = tf.function(fn, jit_compile=True)
    assert call in compiled.experimental_get_compiler_ir(tf.constant(x))(stage='hlo')
    return compiled(tf.constant(x)).numpy()


def product(x, w, scale, where, **options):
    """int8_matmul as `where` says -> numpy."""
    kernel = where != 'TensorFlow ops'
    return run(lambda x: kernels.int8_matmul(x, tf.constant(w), tf.constant(scale), kernel=kernel, **options), x,
               where, 'gpt2_tf_int8_matmul')


@pytest.mark.parametrize('where', WHERE)
@pytest.mark.parametrize('m, k, n, transpose', SHAPES)
def test_int8_product_equals_the_float64_product(m, k, n, transpose, where):
    x, w, scale, reference = case(m, k, n, transpose)
    y = product(x, w, scale, where, transpose_w=transpose)
    assert y.shape == reference.shape
    # float32 sums of k terms: a few ulps of the largest partial sum, far below one step of the int8 grid.
    assert np.abs(y - reference).max() <= 1e-5 * np.abs(reference).max()


# the tiles; the dequantized copy; TensorFlow's ops
@pytest.mark.parametrize('rows, kernel', [(4, None), (kernels.MANY_ROWS[False], None), (4, False)])
def test_an_int8_product_refuses_what_the_op_refuses_on_every_path(rows, kernel):
    x, w, scale, _ = case(rows, 16, 256, False)
    with pytest.raises(TypeError, match=r'w must be int8, got int32; quantize it first'):
        kernels.int8_matmul(tf.constant(x), tf.constant(w.astype(np.int32)), tf.constant(scale), kernel=kernel)
    with pytest.raises(ValueError, match=r'a transposed w has no panels; pass panel=0'):
        kernels.int8_matmul(tf.constant(x), tf.constant(w.T), tf.constant(scale), transpose_w=True, panel=128,
                            kernel=kernel)


def panels(w: np.ndarray, width: int) -> np.ndarray:
    """w [K, N] with its values laid out as [N / width, K, width], in w's shape: the packed layout."""
    k, n = w.shape
    return np.ascontiguousarray(w.reshape(k, n // width, width).transpose(1, 0, 2)).reshape(k, n)


@pytest.mark.parametrize('where', WHERE)
@pytest.mark.parametrize('m, k, n, width', [(1, 768, 2304, 128), (7, 64, 384, 128), (13, 33, 256, 128),
                                            (2, 40, 96, 32), (9, 768, 3072, 128), (80, 64, 2560, 128),
                                            (8, 768, 2304, 128), (19, 96, 512, 128),  # tall tiles: 8, 6 + 6 + 7
                                            # (AVX2 4 + 4, 3 + 4 + 4 + 4 + 4)
                                            (1, 40, 96, 32),  # one row, panels narrower than its 128-channel tiles
                                            (1, 40, 512, 256), (3, 40, 512, 256)])  # two 128-channel units a panel
def test_packed_product_equals_the_float64_product(m, k, n, width, where):
    x, w, scale, reference = case(m, k, n, False, seed=2)
    y = product(x, panels(w, width), scale, where, panel=width)
    assert np.abs(y - reference).max() <= 1e-5 * np.abs(reference).max()  # as above


FLOAT_SHAPES = [(1, 768, 2304, False), (2, 768, 768, False), (3, 768, 3072, False),  # below 17 rows: bands of k
                (5, 33, 300, False),  # two threads: bands of 8, 8, 8, 9 rows of w (one past the steps); a channel tail
                # from 7 rows on, register tiles of up to 12 rows (AVX-512) or 6 (AVX2), over chunks of 128 rows of w:
                (7, 40, 2100, False), (8, 3072, 768, False),  # rows 7 and 8, AVX2 3 + 4 and 4 + 4; k in 6 chunks a band
                (11, 130, 70, False),  # AVX2 5 + 6; four tiles of channels and a tail of 6; a band of 34 rows of w
                (12, 3072, 768, False), (13, 33, 300, False),  # AVX-512 12 and 6 + 7, AVX2 6 + 6 and 4 + 4 + 5
                (16, 768, 2304, False),  # the most rows a band takes: AVX-512 8 + 8, AVX2 5 + 5 + 6
                (6, 130, 70, False),  # the most rows the bands' steps take: AVX2 4 + 2
                (4, 3, 50, False),  # k shorter than a band's step of 8 rows
                (17, 3072, 768, False), (22, 768, 2304, False),  # panels: k in 24 and 6 chunks; rows 6+6+5, 6+6+6+4
                (19, 33, 300, False),  # the last segment 44: 2 panels, then a vector and 4 channels; rows 6 + 6 + 6 + 1
                (9, 17, 13, False), (70, 64, 200, False),  # fewer channels than a vector; Eigen's GEMM
                (8, 768, 5000, True), (3, 33, 17, True), (70, 40, 300, True),  # wte's layout
                (11, 64, 300, True),  # wte's rows split evenly: AVX-512 5 + 6, AVX2 3 + 4 + 4
                (17, 0, 8, False), (70, 0, 8, True), (2, 0, 8, False)]  # an empty sum (k = 0): zeros


@pytest.mark.parametrize('where', WHERE[:2])
@pytest.mark.parametrize('m, k, n, transpose', FLOAT_SHAPES)
def test_float_product_equals_the_float64_product(m, k, n, transpose, where):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k) if transpose else (k, n)).astype(np.float32)
    reference = x.astype(np.float64) @ (w.T if transpose else w).astype(np.float64)
    y = run(lambda x: kernels.float_matmul(x, tf.constant(w), transpose_w=transpose), x, where, 'gpt2_tf_float_matmul')
    assert y.shape == reference.shape
    assert np.abs(y - reference).max() <= 1e-5 * np.abs(reference).max()  # float32 sums, as above


ATTENTION_SHAPES = [(1, 12, 80, 64), (8, 12, 80, 64), (3, 2, 7, 5), (2, 1, 33, 19)]  # B, H, S, F


def attention_case(b, h, s, f, seed=0):
    """q [B, H, F], cache [B, 2, H, S, F], mask [B, S] (row 0 sees no slot when there are others; the rest a
    random set and their last), and the original's attention over them in float64."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, h, f)).astype(np.float32)
    cache = (rng.standard_normal((b, 2, h, s, f)) * 2).astype(np.float32)
    mask = (rng.random((b, s)) < 0.6).astype(np.float32)
    mask[:, -1] = 1
    if b > 1:
        mask[0] = 0
    q64, k, v, m = q.astype(np.float64), cache[:, 0].astype(np.float64), cache[:, 1].astype(np.float64), mask[:, None]
    w = np.einsum('bhf,bhsf->bhs', q64, k) / np.sqrt(f) * m - 1e10 * (1 - m)
    w = np.exp(w - w.max(axis=-1, keepdims=True))
    w /= w.sum(axis=-1, keepdims=True)
    return q, cache, mask, np.einsum('bhs,bhsf->bhf', w, v)


@pytest.mark.parametrize('where', WHERE[:2])
@pytest.mark.parametrize('b, h, s, f', ATTENTION_SHAPES)
def test_cached_attention_equals_the_float64_attention(b, h, s, f, where):
    q, cache, mask, reference = attention_case(b, h, s, f)
    got = run(lambda q: kernels.cached_attention(q, tf.constant(cache), tf.constant(mask)), q, where,
              'gpt2_tf_cached_attention')
    np.testing.assert_allclose(got, reference, rtol=0, atol=1e-5 * max(1.0, np.abs(reference).max()))


SEQUENCE_SHAPES = [(1, 2, 1, 8), (2, 3, 65, 16), (1, 12, 200, 64), (1, 2, 1024, 64), (1, 1, 130, 7)]  # B, H, T, F


@pytest.mark.parametrize('where', ['kernel'])  # the AVX2 build's run below selects its tests by 'kernel'
@pytest.mark.parametrize('b, h, t, f, spread', [(*shape, 2) for shape in SEQUENCE_SHAPES] + [(1, 3, 200, 16, 6)])
def test_sequence_attention_equals_the_float64_attention_and_so_do_its_gradients(b, h, t, f, spread, where):
    # spread 6: q and k's entries 6 x N(0, 1), scores of std 36 (up to about 150), where the backward pass's
    # weights recomputed from a float32 log-sum-exp alone were 3x further from float64 than TensorFlow's ops
    if not kernels.attention_available():
        pytest.skip(kernels._attention_library())
    rng = np.random.default_rng(t)
    q, k = ((rng.standard_normal((b, h, t, f)) * spread).astype(np.float32) for _ in range(2))
    v, grad = ((rng.standard_normal((b, h, t, f)) * 2).astype(np.float32) for _ in range(2))
    ours, theirs = (with_gradients(attend, *(tf.constant(x, dtype) for x in (q, k, v)), grad)
                    for attend, dtype in ((kernels.causal_attention, tf.float32), (attention64, tf.float64)))
    for name, got, reference in zip(['a', 'dq', 'dk', 'dv'], [ours[0], *ours[1]], [theirs[0], *theirs[1]]):
        got, reference = np.asarray(got), np.asarray(reference)
        np.testing.assert_allclose(got, reference, rtol=0, atol=1e-5 * max(1.0, np.abs(reference).max()), err_msg=name)


def test_a_sequence_s_attention_takes_the_kernel_outside_xla_and_exports(random_checkpoint):
    if not kernels.attention_available():
        pytest.skip(kernels._attention_library())
    import gpt2_tf
    from gpt2_tf.hparams import HParams

    model = gpt2_tf.load_model(random_checkpoint(HParams(n_vocab=50, n_ctx=16, n_embd=8, n_head=2, n_layer=1)))

    def ops(jit_compile=False) -> set:  # the op types of the forward pass and its gradient, traced
        def forward(X):
            h = model.embed(X, tf.zeros_like(X))
            with tf.GradientTape() as tape:
                tape.watch(h)
                out = model.blocks(h)[0]
            return tape.gradient(out, h)
        function = tf.function(forward, jit_compile=jit_compile, autograph=False)
        graph = function.get_concrete_function(tf.TensorSpec([2, 5], tf.int32)).graph
        return {op.type for op in graph.get_operations()}
    kernel = {'Gpt2CausalAttention', 'Gpt2CausalAttentionGrad'}
    assert kernel <= ops()
    assert not kernel & ops(jit_compile=True)  # no XLA kernel: XLA's own ops
    with kernels.tensorflow_ops():  # exports: no op library needed to load them
        assert not kernel & ops()
        with kernels.tensorflow_ops(products_only=True):  # nor when something inside asks for products only
            assert not kernel & ops()
    with kernels.tensorflow_ops(products_only=True):  # training: the attention keeps its kernel
        assert kernel <= ops()
        with kernels.tensorflow_ops():
            assert not kernel & ops()
        assert kernel <= ops()
    tokens = tf.constant([[1, 2, 3, 4, 5]])
    eager = model(tokens)['logits'].numpy()  # model.__call__'s trace, with the kernel's op
    compiled = tf.function(lambda t: model(t)['logits'], jit_compile=True)(tokens).numpy()  # traced anew in XLA
    np.testing.assert_allclose(compiled, eager, rtol=0, atol=1e-5 * max(1.0, np.abs(eager).max()))


def test_the_sequence_attention_refuses_mismatched_shapes_in_one_line():
    if not kernels.attention_available():
        pytest.skip(kernels._attention_library())
    q = tf.zeros([1, 2, 3, 4])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r'q, k and v must be .* got \[1,2,3,4\], \[1,2,3,5\]'):
        kernels.causal_attention(q, tf.zeros([1, 2, 3, 5]), q)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r'features > 0'):
        kernels.causal_attention(*[tf.zeros([1, 2, 3, 0])] * 3)
    library = kernels._loaded(attention=True)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r'da must be shaped as q \[1,2,3,4\] .* got'):
        library.gpt2_causal_attention_grad(q, q, q, tf.zeros([1, 2, 4]), q)


def test_without_the_attention_s_library_a_sequence_takes_tensorflow_s_ops(tmp_path, monkeypatch):
    # attention.cc is a library of its own: its failed build leaves the products' library (cached above) alone,
    # and the model's attention takes TensorFlow's ops.
    from gpt2_tf import causal, model as graph

    products = kernels.available()  # loaded (or not) from the usual cache, before the build below fails
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(kernels.ARCH_ENV, raising=False)  # a build asked for by name is refused when it fails
    monkeypatch.setattr(kernels, '_run_all', lambda commands: (_ for _ in ()).throw(
        subprocess.CalledProcessError(1, commands[0], stderr=b'attention.cc:1: error: no compiler today')))
    kernels._attention_library.cache_clear()
    try:
        assert kernels._attention_library() == 'g++ failed: attention.cc:1: error: no compiler today'
        assert kernels.available() == products
        q = tf.random.normal([1, 2, 5, 4])
        mask = tf.reshape(graph.attention_mask(5, 5, dtype=tf.float32), [1, 1, 5, 5])
        attend = tf.function(lambda q: causal.causal_attn(q, q, q, mask, weights=graph.attention_weights,
                                                         mask=graph.attention_mask))
        assert 'Gpt2CausalAttention' not in {op.type for op in attend.get_concrete_function(q).graph.get_operations()}
        assert attend(q).shape == [1, 2, 5, 4]
    finally:
        kernels._attention_library.cache_clear()


def test_a_decode_step_attends_by_the_kernel_one_query_a_row(random_checkpoint, monkeypatch):
    if not kernels.available():
        pytest.skip(kernels.unavailable_reason())
    import gpt2_tf
    from gpt2_tf.decoding import decode, empty_cache
    from gpt2_tf.hparams import HParams

    monkeypatch.delenv('TF_XLA_FLAGS', raising=False)
    model = gpt2_tf.load_model(random_checkpoint(HParams(n_vocab=50, n_ctx=16, n_embd=8, n_head=2, n_layer=1)))

    def ops(n) -> set:  # the op types of a decode step of n tokens a row, traced
        step = lambda X: decode(model, X, pads=tf.zeros([2], tf.int32), caches=empty_cache(model, 2, 8),  # noqa
                                index=tf.constant(0))[0]
        graph = tf.function(step).get_concrete_function(tf.TensorSpec([2, n], tf.int32)).graph
        return {op.type for op in graph.get_operations()}
    assert 'Gpt2CachedAttention' in ops(1)
    assert 'Gpt2CachedAttention' not in ops(3)  # a prompt's queries: the original's attention
    with kernels.tensorflow_ops():
        assert 'Gpt2CachedAttention' not in ops(1)


def test_products_called_from_many_threads_at_once_give_the_same_bits_as_alone():
    # Under XLA the products share one team of threads; a product that finds it busy runs on its caller alone.
    # Each thread's results must be those of the product run by itself, bit for bit (the same sums in order).
    import threading

    if not kernels.xla_available():
        pytest.skip(kernels.unavailable_reason() or 'the kernel was built without XLA')
    rng = np.random.default_rng(4)
    cases = [(tf.constant(rng.standard_normal((m, 768)).astype(np.float32)),
              tf.constant(rng.standard_normal((768, 2304)).astype(np.float32))) for m in (1, 5, 8, 16)]
    compiled = tf.function(lambda x, w: kernels.float_matmul(x, w), jit_compile=True)
    alone = [compiled(x, w).numpy() for x, w in cases]
    mismatches, start = [], threading.Barrier(len(cases))

    def hammer(i):
        start.wait()
        for _ in range(30):
            if not np.array_equal(compiled(*cases[i]).numpy(), alone[i]):
                mismatches.append(i)
    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(len(cases))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not mismatches
    for (x, w), y in zip(cases, alone):
        np.testing.assert_allclose(y, x.numpy().astype(np.float64) @ w.numpy(), rtol=1e-5, atol=1e-4)


def traced_ops(fn, rows, k) -> set:
    """The op types of fn traced for x [rows, k] (rows None: unknown when traced)."""
    return {op.type for op in tf.function(fn).get_concrete_function(tf.TensorSpec([rows, k])).graph.get_operations()}


@pytest.mark.parametrize('cpu', ['avx2 fma', 'avx2 fma avx512f'])
def test_float32_products_of_few_rows_take_the_kernel_while_decoding_as_the_cpu_table_says(cpu, monkeypatch):
    if not kernels.available():
        pytest.skip(kernels.unavailable_reason())

    monkeypatch.setattr(kernels, '_cpu_key', lambda: 'flags : ' + cpu)
    monkeypatch.delenv('TF_XLA_FLAGS', raising=False)
    w = tf.constant(np.random.default_rng(0).standard_normal((96, 200)).astype(np.float32))

    def step(x):
        with precision.decoding():
            return precision.product(x, w)
    first, last = 1, 16  # the block products' and the tied logits' rows on both tables
    logits = lambda x: precision.product(x, tf.transpose(w), transpose_b=True)  # noqa: E731  wte's layout
    for rows in (1, 2, 8, 9, 11, 12, 16, 17):
        assert ('Gpt2FloatMatMul' in traced_ops(step, rows, 96)) == (first <= rows <= last), rows
        assert 'Gpt2FloatMatMul' not in traced_ops(lambda x: precision.product(x, w), rows, 96)  # not decoding
        with precision.decoding():
            assert ('Gpt2FloatMatMul' in traced_ops(logits, rows, 96)) == (first <= rows <= last), rows
    assert 'If' in traced_ops(step, None, 96) or 'StatelessIf' in traced_ops(step, None, 96)
    with kernels.tensorflow_ops():
        assert 'Gpt2FloatMatMul' not in traced_ops(step, 8, 96)
    monkeypatch.setenv('TF_XLA_FLAGS', '--tf_xla_persistent_cache_directory=/nonexistent')
    assert 'Gpt2FloatMatMul' not in traced_ops(step, 8, 96)
    monkeypatch.delenv('TF_XLA_FLAGS')
    library = kernels._library()[0]
    monkeypatch.setattr(kernels, '_library', lambda: (library, False))  # built without XLA's custom calls
    assert 'Gpt2FloatMatMul' not in traced_ops(step, 8, 96)


def test_an_open_batch_takes_the_kernel_in_xla_for_few_rows_only(monkeypatch):
    if not kernels.xla_available():
        pytest.skip(kernels.unavailable_reason() or 'the kernel was built without XLA')

    monkeypatch.setattr(kernels, '_cpu_key', lambda: 'flags : avx2 fma')
    monkeypatch.delenv('TF_XLA_FLAGS', raising=False)
    w = np.random.default_rng(1).standard_normal((64, 96)).astype(np.float32)

    def step(x):
        with precision.decoding():
            return precision.product(x, tf.constant(w))
    compiled = tf.function(step, jit_compile=True, input_signature=[tf.TensorSpec([None, 64])])
    for rows in (1, 2, 16, 17):
        x = np.random.default_rng(rows).standard_normal((rows, 64)).astype(np.float32)
        hlo = compiled.experimental_get_compiler_ir(tf.constant(x))(stage='optimized_hlo')
        assert ('gpt2_tf_float_matmul' in hlo) == (rows in (1, 2, 16)), rows  # the cond folded to the branch taken
        np.testing.assert_allclose(compiled(tf.constant(x)).numpy(), x.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)


def test_kernel_and_fallback_agree_in_a_compiled_function():
    if not kernels.available():
        pytest.skip(kernels.unavailable_reason())
    x, w, scale, _ = case(4, 768, 3072, False, seed=1)
    run = tf.function(lambda x, kernel: kernels.int8_matmul(x, w, scale, kernel=kernel))
    np.testing.assert_allclose(run(tf.constant(x), True).numpy(), run(tf.constant(x), False).numpy(),
                               rtol=0, atol=2e-6 * np.abs(x @ (w * scale)).max())


@pytest.mark.parametrize('traced', ['eager', 'rows unknown when traced'])
def test_products_take_tensorflow_s_over_a_dequantized_copy_from_many_rows_on(traced, monkeypatch):
    if not kernels.available():
        pytest.skip(kernels.unavailable_reason())

    taken = tf.Variable(0)  # counts the products TensorFlow's ops made, when they run (not when traced)
    plain = kernels._dequantized_product

    def counted(*args):
        with tf.control_dependencies([taken.assign_add(1)]):
            return tf.identity(plain(*args))

    monkeypatch.setattr(kernels, '_dequantized_product', counted)

    def run(x, w, scale, **options):
        if traced == 'eager':
            return kernels.int8_matmul(tf.constant(x), w, scale, **options).numpy()
        fn = tf.function(lambda x: kernels.int8_matmul(x, w, scale, **options),
                         input_signature=[tf.TensorSpec([None, x.shape[1]], tf.float32)])
        return fn(tf.constant(x)).numpy()

    for transpose_w, many in kernels.MANY_ROWS.items():
        for rows in (1, many - 1, many, 3 * many):
            if transpose_w:  # wte's layout
                x, w, scale, reference = case(rows, 96, 300, True, seed=rows)
                options = {'transpose_w': True}
            else:
                x, w, scale, reference = case(rows, 96, 256, False, seed=rows)
                w, options = precision.pack(w), {'panel': precision.panel(256)}
            taken.assign(0)
            y = run(x, tf.constant(w), tf.constant(scale), **options)
            assert taken.numpy() == (rows >= many), (transpose_w, rows)
            np.testing.assert_allclose(y, reference, rtol=1e-4, atol=1e-4)


def test_wte_s_dequantized_product_takes_its_rows_a_part_at_a_time():
    if not kernels.available():
        pytest.skip(kernels.unavailable_reason())
    n = kernels.DEQUANTIZED_ROWS + 808  # two parts, the second shorter
    x, w, scale, reference = case(kernels.MANY_ROWS[True], 16, n, True, seed=3)
    y = kernels.int8_matmul(tf.constant(x), tf.constant(w), tf.constant(scale), transpose_w=True).numpy()
    assert y.shape == reference.shape
    assert np.abs(y - reference).max() <= 1e-5 * np.abs(reference).max()


def test_tensors_off_the_cpu_keep_out_of_the_kernels(monkeypatch):
    # The ops and XLA's custom calls are the CPU's alone: a model on a GPU traces TensorFlow's ops instead.
    import types


    assert kernels.on_cpu(types.SimpleNamespace(device='/job:localhost/replica:0/task:0/device:CPU:0'))
    assert not kernels.on_cpu(types.SimpleNamespace(device='/job:localhost/replica:0/task:0/device:GPU:0'))
    if not kernels.decoding_available():
        pytest.skip(kernels.unavailable_reason())
    w8, scale = precision.quantize(np.random.default_rng(0).standard_normal((64, 32)), rows=False)  # nf 32: plain
    w32 = tf.random.normal([64, 32])

    def traced_ops():
        with precision.decoding():
            graph = tf.function(lambda x: [precision.product(x, w8, scale), precision.product(x, w32)]) \
                .get_concrete_function(tf.TensorSpec([1, 64])).graph
        return {op.type for op in graph.get_operations()}

    assert {'Gpt2Int8MatMul', 'Gpt2FloatMatMul'} <= traced_ops()  # on this CPU: the kernels
    monkeypatch.setattr(kernels, 'on_cpu', lambda x: False)  # as on a GPU
    assert not [op for op in traced_ops() if op.startswith('Gpt2')]


def test_off_switch_uses_the_fallback():
    script = ('import os; os.environ["GPT2_TF_KERNELS"] = "off"; from gpt2_tf import kernels; '
              'print(kernels.available(), kernels.unavailable_reason())')
    out = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ['False', 'GPT2_TF_KERNELS=off']


def test_the_kernel_compiles_under_xla_when_it_loads_after_the_first_xla_compile():
    # XLA's op registry is read at the process's first XLA compile; the kernel registers itself for XLA directly.
    script = '''
import numpy as np, tensorflow as tf
tf.function(lambda x: x * 2, jit_compile=True)(tf.ones(3))
from gpt2_tf import kernels
if not kernels.xla_available():
    print('skip', kernels.unavailable_reason() or 'the kernel was built without XLA'); raise SystemExit
x, w, s = np.ones((2, 8), np.float32), np.ones((8, 3), np.int8), np.full(3, 0.5, np.float32)
run = tf.function(lambda x: kernels.int8_matmul(x, w, s, kernel=True), jit_compile=True)
print('gpt2_tf_int8_matmul' in run.experimental_get_compiler_ir(tf.constant(x))(stage='hlo'), run(x).numpy().tolist())
'''
    out = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    if out.stdout.startswith('skip'):
        pytest.skip(out.stdout)
    assert out.stdout.split('\n')[0] == 'True [[4.0, 4.0, 4.0], [4.0, 4.0, 4.0]]'


def test_under_xla_the_custom_calls_keep_to_tensorflow_s_intra_op_threads():
    # A process given one intra-op thread (a Beam worker's share of the cores, say) starts none of the library's
    # threads; left to its default, a helper per further CPU it may use and an Eigen pool of one per CPU.
    # Products and attention stay right.
    script = '''
import os, sys, numpy as np, tensorflow as tf
if int(sys.argv[1]):
    tf.config.threading.set_intra_op_parallelism_threads(int(sys.argv[1]))
from gpt2_tf import kernels
if not kernels.xla_available():
    print('skip', kernels.unavailable_reason() or 'the kernel was built without XLA'); raise SystemExit
rng = np.random.default_rng(0)
x = rng.standard_normal((4, 768)).astype(np.float32)
w8 = rng.integers(-127, 128, (768, 2304)).astype(np.int8)
s = (rng.random(2304) * 0.02 + 1e-3).astype(np.float32)
w = rng.standard_normal((768, 2304)).astype(np.float32)
q, cache = rng.standard_normal((2, 12, 64)).astype(np.float32), rng.standard_normal((2, 2, 12, 40, 64)).astype(np.float32)
mask = np.ones((2, 40), np.float32)
many = rng.standard_normal((384, 768)).astype(np.float32)  # Gemm's rows (int8 and float32): Eigen's device
run = tf.function(lambda *a: (kernels.int8_matmul(a[0], a[1], a[2], kernel=True), kernels.float_matmul(a[0], a[3]),
                             kernels.cached_attention(*a[4:7]), kernels.int8_matmul(a[7], a[1], a[2], kernel=True),
                             kernels.float_matmul(a[7], a[3])), jit_compile=True)
inputs = [tf.constant(v) for v in (x, w8, s, w, q, cache, mask, many)]  # arguments: constants would be folded
ir = run.experimental_get_compiler_ir(*inputs)(stage='hlo')
def unnamed():  # threads named as the process is: the Eigen pool's, for one
    name = open('/proc/self/comm').read()
    return sum(open(f'/proc/self/task/{t}/comm').read() == name for t in os.listdir('/proc/self/task'))
tf.function(lambda *a: [t * 2 for t in a], jit_compile=True)(*inputs)  # XLA's own threads, started
before = unnamed()
y8, y, a, g8, g = (t.numpy() for t in run(*inputs))
x64 = x.astype(np.float64)
scores = np.einsum('bhf,bhsf->bhs', q.astype(np.float64), cache[:, 0]) / 8
weights = np.exp(scores - scores.max(-1, keepdims=True))
a64 = np.einsum('bhs,bhsf->bhf', weights / weights.sum(-1, keepdims=True), cache[:, 1])
many64 = many.astype(np.float64)
errors = [np.abs(y8 - x64 @ (w8 * s.astype(np.float64))).max(), np.abs(y - x64 @ w).max(), np.abs(a - a64).max(),
          np.abs(g8 - many64 @ (w8 * s.astype(np.float64))).max(), np.abs(g - many64 @ w).max()]
team = sum(open(f'/proc/self/task/{t}/comm').read().strip() == 'gpt2_tf-team' for t in os.listdir('/proc/self/task'))
print(ir.count('custom_call_target="gpt2_tf_'), team, unnamed() - before, len(os.sched_getaffinity(0)),
      max(errors) < 1e-3)
'''
    cpus = None
    for threads in (1, 0):
        out = subprocess.run([sys.executable, '-c', script, str(threads)], capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-2000:]
        if out.stdout.startswith('skip'):
            pytest.skip(out.stdout)
        calls, team, pool, cpus, right = out.stdout.split()
        assert (calls, right) == ('5', 'True'), out.stdout
        assert (int(team), int(pool)) == ((0, 0) if threads == 1 else (int(cpus) - 1, int(cpus))), (threads, out.stdout)


@pytest.mark.filterwarnings('ignore:the matmul kernels could not be built')
def test_a_failed_xla_build_is_recorded_and_not_tried_again(tmp_path, monkeypatch):
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path))
    calls = []

    def failing(commands):
        calls.append(commands)
        raise subprocess.CalledProcessError(1, commands[0], stderr=b'x.cc:3:10: fatal error: some_header.h: No such file')

    monkeypatch.setattr(kernels, '_run_all', failing)
    reason = 'g++ failed: x.cc:3:10: fatal error: some_header.h: No such file'
    assert kernels._load(xla=True) == reason
    assert kernels._load(xla=True).startswith(f'{reason} (recorded in ') and len(calls) == 1  # g++ not run again
    assert kernels._load(xla=False) == reason and len(calls) == 2  # the build without XLA is still tried


def test_a_missing_compiler_is_told_from_another_missing_file(tmp_path, monkeypatch):
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path))
    for missing, reason in [('g++', 'no g++ on this machine'),
                            (str(tmp_path / 'work'), 'the kernel could not be built: [Errno 2] No such file')]:
        def run_all(commands, missing=missing):
            raise FileNotFoundError(2, 'No such file or directory', missing)

        monkeypatch.setattr(kernels, '_run_all', run_all)
        assert kernels._load(xla=False, name='attention').startswith(reason)


def test_a_cache_folder_that_cannot_be_made_is_said_in_one_warning_naming_its_setting(tmp_path, monkeypatch):
    (tmp_path / 'file').write_text('not a folder')
    for where in ('file', 'file/kernels'):  # a file, a folder under a file
        monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path / where))
        with pytest.warns(UserWarning) as said:
            assert isinstance(kernels._load(xla=False, name='attention'), str)  # the kernels are off
        assert [str(w.message).count('\n') for w in said] == [0]
        assert 'set GPT2_TF_KERNEL_CACHE to a writable folder' in str(said[0].message)


def test_a_cut_off_library_is_built_again_not_mapped(tmp_path, monkeypatch):
    # A cache folder copied or synced may hold a cut-off library: mapping one crashes the process (SIGBUS).
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path))
    target = kernels._library_path(xla=False, name='attention')
    target.write_bytes(b'\x7fELF' + b'\0' * 60)  # what is left of it
    calls = []

    def failing(commands):
        calls.append(commands)
        raise subprocess.CalledProcessError(1, commands[0], stderr=b'attention.cc:1: error: no compiler today')

    monkeypatch.setattr(kernels, '_run_all', failing)
    assert kernels._load(xla=False, name='attention') == 'g++ failed: attention.cc:1: error: no compiler today'
    assert len(calls) == 1  # built again, never handed to the loader


def test_a_killed_compiler_is_not_recorded_as_a_failed_build(tmp_path, monkeypatch):
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(kernels, '_run_all', lambda commands: (_ for _ in ()).throw(
        subprocess.CalledProcessError(-9, commands[0], stderr=b'')))  # the out-of-memory killer's signal
    assert kernels._load(xla=True) == 'g++ was killed (signal 9; out of memory?)'
    assert not kernels._library_path(xla=True).with_suffix('.failed').exists()  # tried again next time


@pytest.mark.skipif('avx2' not in kernels._cpu_key().split(), reason='the AVX2 path needs an x86 CPU with AVX2')
def test_the_avx2_path_passes_the_same_products_on_any_x86_cpu(tmp_path, monkeypatch):
    # Built with -march=x86-64-v3 (AVX2 and FMA, no AVX-512), whatever this CPU has, the kernel's AVX2 code
    # gives the products and the attention above; on an AVX-512 machine the native build holds zmm
    # instructions, this one none.
    env = dict(os.environ, **{kernels.ARCH_ENV: 'x86-64-v3', kernels.CACHE_ENV: str(tmp_path)})
    # The build with XLA's headers (the same tiles, three times the compile time) is marked as failed in this
    # cache, so only the plain op is built.
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    kernels._library_path(xla=True).with_suffix('.failed').write_text('skipped by this test')
    selected = 'equals_the_float64 and kernel and not XLA and not TensorFlow'
    out = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', __file__, '-k', selected],
                         env=env, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stdout[-3000:]
    assert 'skipped' not in out.stdout and ' passed' in out.stdout, out.stdout[-1000:]
    built = sorted(tmp_path.glob('*.so'))
    assert [path.name.split('-')[0] for path in built] == ['attention', 'matmul'], built
    for path in built:
        code = subprocess.run(['objdump', '-d', str(path)], capture_output=True, text=True, check=True).stdout
        assert 'ymm' in code and 'zmm' not in code, path.name


def test_a_kernel_target_g_plus_plus_does_not_know_is_refused_in_one_line(tmp_path):
    script = ('from gpt2_tf import kernels\ntry:\n    kernels.available()\nexcept ValueError as e:\n    print(e)')
    env = dict(os.environ, **{kernels.ARCH_ENV: 'bogus', kernels.CACHE_ENV: str(tmp_path)})
    out = subprocess.run([sys.executable, '-c', script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line, = out.stdout.strip().splitlines()
    assert line.startswith('GPT2_TF_KERNEL_ARCH=bogus: the int8 kernel could not be built (g++ failed: ')
    assert "bad value" in line and 'bogus' in line.split('(', 1)[1]  # g++'s own error line, not its list of values


# --- building: what is recorded, what is refused ----------------------------------------------------

def failing_build(stderr: bytes, returncode: int = 1):
    def run_all(commands):
        raise subprocess.CalledProcessError(returncode, commands[0], stderr=stderr)
    return run_all


@pytest.mark.parametrize('stderr, recorded', [
    (b'matmul_xla.cc:9:10: fatal error: xla/ffi/api/ffi.h: No such file or directory', True),  # the next try too
    (b"Assembler messages:\nFatal error: can't write 20 bytes to section .text: No space left on device", False),
    (b'/usr/bin/ld: final link failed: No space left on device', False),
    (b'matmul.cc:1018:78: fatal error: error writing to /tmp/ccOdbMuA.s: No space left on device', False),  # cc1plus
])
@pytest.mark.parametrize('xla, name', [(True, 'matmul'), (False, 'matmul'), (False, 'attention')])
def test_only_a_failure_in_the_sources_keeps_a_build_from_being_tried_again(
        tmp_path, monkeypatch, stderr, recorded, xla, name):
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(kernels, '_run_all', failing_build(stderr))
    on_release = []

    @contextlib.contextmanager
    def one_builder(target):
        try:
            yield
        finally:  # a builder waiting on the lock reads the record as soon as it is released
            on_release.append(target.with_suffix('.failed').exists())

    monkeypatch.setattr(kernels, '_one_builder', one_builder)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter('always')
        reason = kernels._load(xla=xla, name=name)
    assert reason.startswith('g++ failed: ') and on_release == [recorded]
    failed = kernels._library_path(xla, name).with_suffix('.failed')
    assert failed.exists() == recorded  # a full disk is tried again once there is room
    assert [str(w.message) for w in said] == ([f"the {name} kernels could not be built, and TensorFlow's ops run "
                                               f"instead ({failed.read_text()})"] if recorded else [])
    if recorded:
        assert kernels._load(xla=xla, name=name) == failed.read_text() and 'remove it to build' in failed.read_text()


def test_the_kernel_switch_and_arch_settings_are_read_or_refused(monkeypatch):
    from gpt2_tf import quiet

    for value in ('off', 'OFF', '0', 'false', 'no', ' none '):  # one rule for both settings
        monkeypatch.setenv(kernels.SWITCH_ENV, value)
        assert kernels._refused() == f'{kernels.SWITCH_ENV}={value}'
        monkeypatch.setenv(quiet.XLA_CACHE_ENV, value)
        assert quiet.xla_cache_folder() is None, value  # not a folder named 'no' in the working folder
    for value in ('', 'on', '1', 'true', 'yes'):
        monkeypatch.setenv(kernels.SWITCH_ENV, value)
        assert kernels._refused() is None
    monkeypatch.setenv(kernels.SWITCH_ENV, 'disable')
    with pytest.raises(GPT2Error, match="GPT2_TF_KERNELS='disable' is neither off .* nor on"):
        kernels._refused()
    monkeypatch.setenv(kernels.ARCH_ENV, 'native')
    with pytest.raises(GPT2Error, match=r'no g\+\+ on this machine\); unset GPT2_TF_KERNEL_ARCH to run without it'):
        kernels._checked('no g++ on this machine', 'the int8 kernel')
    monkeypatch.setenv(kernels.ARCH_ENV, 'pentium9')
    with pytest.raises(GPT2Error, match='give g\\+\\+ a valid -march value'):
        kernels._checked("g++ failed: error: bad value 'pentium9' for '-march=' switch", 'the int8 kernel')


def test_under_xla_an_int8_product_takes_the_kernel_only_as_xlas_custom_call(monkeypatch):
    if not kernels.available():
        pytest.skip(kernels.unavailable_reason())
    w8, scale = precision.quantize(np.random.default_rng(0).standard_normal((64, 32)), rows=False)

    def traced_ops(jit_compile):
        product = tf.function(lambda x: kernels.int8_matmul(x, w8, scale), jit_compile=jit_compile)
        return {op.type for op in product.get_concrete_function(tf.TensorSpec([2, 64])).graph.get_operations()}

    monkeypatch.setattr(kernels, 'xla_available', lambda: False)  # a library built without XLA's headers
    assert 'Gpt2Int8MatMul' in traced_ops(False)
    assert not [op for op in traced_ops(True) if op.startswith('Gpt2')]  # XLA could not compile it


def test_a_build_another_process_holds_is_waited_for_said_and_given_up_on(tmp_path, monkeypatch, capsys):
    import fcntl

    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(kernels, 'LOCK_NOTICE', 0.2)
    monkeypatch.setattr(kernels, 'LOCK_WAIT', 1.0)
    monkeypatch.setattr(kernels, '_run_all', lambda commands: pytest.fail('built while another build held the lock'))
    monkeypatch.setattr(sys.stderr, 'isatty', lambda: True)  # someone watching (on a pipe it waits quietly)
    target = kernels._library_path(xla=False, name='attention')
    with open(target.with_suffix('.lock'), 'w') as held:  # another process's build, hung
        fcntl.flock(held, fcntl.LOCK_EX)
        reason = kernels._load(xla=False, name='attention')
    assert reason.startswith('the kernel could not be built: another process has been building ')
    assert f'waiting for another process that is building {target.name}' in capsys.readouterr().err


def test_a_killed_builds_work_folder_is_removed_by_the_next_build(tmp_path, monkeypatch):
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(kernels, '_run_all', failing_build(b'x.cc:1:1: error: stop here'))
    old, recent = tmp_path / 'gpt2_tf-build-killed', tmp_path / 'gpt2_tf-build-now'  # a kill -9's, a build's now
    other = tmp_path / 'tmp_notes'  # another program's, in a shared cache folder
    for folder in (old, recent, other):
        folder.mkdir()
        (folder / 'attention.o').write_bytes(b'\0' * 100)
    os.utime(old, (0, 0))
    os.utime(other, (0, 0))
    kernels._load(xla=False, name='attention')
    assert not old.exists() and recent.exists() and other.exists()


def test_the_cache_key_holds_what_changes_the_library(monkeypatch):
    key = kernels._library_path(xla=False)
    monkeypatch.setattr(tf.sysconfig, 'get_compile_flags', lambda: ['-D_GLIBCXX_USE_CXX11_ABI=0'])  # another build
    assert kernels._library_path(xla=False) != key
    monkeypatch.undo()
    monkeypatch.setattr(kernels, '_gxx_version', lambda: '99.1.0')
    assert kernels._library_path(xla=False) != key


def test_one_install_reached_through_a_link_is_one_key(monkeypatch, tmp_path):
    # A venv linked into another folder (as the README's tests do) names TensorFlow's headers by another path.
    (tmp_path / 'venv').mkdir(), (tmp_path / 'other').mkdir()
    (tmp_path / 'linked').symlink_to(tmp_path / 'venv')
    keys = {}
    for folder in ('venv', 'linked', 'other'):
        monkeypatch.setattr(tf.sysconfig, 'get_compile_flags', lambda: [f'-I{tmp_path / folder}/include', '-DX'])
        monkeypatch.setattr(tf.sysconfig, 'get_link_flags', lambda: [f'-L{tmp_path / folder}', '-l:libx.so.2'])
        keys[folder] = kernels._library_path(xla=False)
    assert keys['venv'] == keys['linked'] != keys['other']

