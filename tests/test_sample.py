"""Sampling: the original filters, greedy decoding against the original graph, the compiled loop (over the
model, and over fake steps)."""

import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import gpt2_tf
from gpt2_tf import compiled, kernels, noise, sample, thresholds
from gpt2_tf.compiled import bucket
from gpt2_tf.sample import MODES, Decoder, sample_chunks, sample_sequence, top_k_logits, top_p_logits

from conftest import FIXTURES
from support import FakeModel, compiled_hlo, no_cache

GREEDY = {'tf1-tiny': (5, 20), 'tf1-tiny-hot': (8, 40)}  # prompt length P, new tokens N


@pytest.fixture(scope='module')
def models():
    return {name: gpt2_tf.load_model(FIXTURES / name) for name in GREEDY}


def test_filters_equal_the_original_exactly():
    ref = np.load(FIXTURES / 'tf1-filters.npz')
    # The references were computed one row at a time; here all four rows go at once.
    for i, k in enumerate(ref['ks']):
        np.testing.assert_array_equal(top_k_logits(ref['logits'], int(k)).numpy(), ref['top_k'][i], f'k={k}')
    for i, p in enumerate(ref['ps']):
        np.testing.assert_array_equal(top_p_logits(ref['logits'], float(p)).numpy(), ref['top_p'][i], f'p={p}')


def test_top_k_keeps_ties_and_top_p_keeps_one():
    logits = tf.constant([[1.0, 3.0, 3.0, 2.0], [0.0, 5.0, -1.0, 4.0]])
    kept = top_k_logits(logits, 1).numpy() > -1e9
    np.testing.assert_array_equal(kept, [[False, True, True, False], [False, True, False, False]])
    kept = top_p_logits(logits, 0.0).numpy() > -1e9
    np.testing.assert_array_equal(kept, [[False, True, True, False], [False, True, False, False]])


@pytest.mark.parametrize('mode', MODES)
@pytest.mark.parametrize('name', GREEDY)
def test_greedy_equals_original_graph(models, name, mode):
    ref = np.load(FIXTURES / name / 'reference.npz')
    prompt, new = GREEDY[name]
    out = sample_sequence(models[name], new, context=ref['tokens'][:, :prompt], top_k=1, mode=mode)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, ref['greedy'])


@pytest.mark.parametrize('name', GREEDY)
def test_greedy_through_the_float32_kernel_equals_original_graph(models, name, monkeypatch):
    # As on a CPU without AVX-512, where a decode step's products over 1-16 rows take the float32 kernel: the
    # 3-row batch, decoded in the XLA loop (the default), traced afresh.
    if not kernels.xla_available():
        pytest.skip(kernels.unavailable_reason() or 'the kernel was built without XLA')
    monkeypatch.setattr(kernels, '_cpu_key', lambda: 'flags : avx2 fma')
    monkeypatch.setattr(compiled, '_functions', {})
    monkeypatch.delenv('TF_XLA_FLAGS', raising=False)
    calls, real = [], kernels.float_matmul
    monkeypatch.setattr(kernels, 'float_matmul', lambda *args, **options: calls.append(1) or real(*args, **options))
    ref = np.load(FIXTURES / name / 'reference.npz')
    prompt, new = GREEDY[name]
    out = sample_sequence(models[name], new, context=ref['tokens'][:, :prompt], top_k=1)
    assert calls, 'the kernel was not traced into the decode step'
    np.testing.assert_array_equal(out, ref['greedy'])


def test_temperature_zero_is_greedy(models):
    ref = np.load(FIXTURES / 'tf1-tiny' / 'reference.npz')
    out = sample_sequence(models['tf1-tiny'], 20, context=ref['tokens'][:, :5], temperature=0)
    np.testing.assert_array_equal(out, ref['greedy'])


def test_mixed_length_batch_equals_row_by_row(models):
    model = models['tf1-tiny-hot']
    tokens = np.load(FIXTURES / 'tf1-tiny-hot' / 'reference.npz')['tokens']
    rows = [tokens[0, :1].tolist(), tokens[1, :9].tolist(), tokens[2, :20].tolist(), tokens[0, :4].tolist()]
    together = sample_sequence(model, 30, context=rows, top_k=1)
    assert [len(r) for r in together] == [31, 39, 50, 34]
    for row, out in zip(rows, together):
        np.testing.assert_array_equal(out, sample_sequence(model, 30, context=row, top_k=1)[0])


def traces(model, mode='xla') -> int:
    return sum(compiled.shared(fn, model, mode).tracing_count for fn in (sample.begin, sample.advance))


def test_new_prompt_length_in_a_bucket_does_not_retrace():
    model = gpt2_tf.load_model(FIXTURES / 'tf1-tiny')
    before = traces(model)
    for prompt, length in [(3, 20), (5, 17), (8, 24), (6, 25)]:  # prompts bucket to 8, lengths to 32
        sample_sequence(model, length, context=list(range(1, prompt + 1)), seed=1, top_k=40, top_p=0.9)
    assert bucket(3) == bucket(8) == 8 and bucket(17) == bucket(32) == 32
    assert traces(model) - before <= 2  # at most one trace each of begin and advance


def test_a_chunk_compiles_once_wherever_it_starts():
    """XLA compiles anew for each value of an argument it must know at compile time; `done` must not be one,
    or the first generation of a process compiles every chunk."""
    model = gpt2_tf.load_model(FIXTURES / 'tf1-tiny')
    request = sample.Request(model, 24, [1, 2, 3], None, None, 1.0, 0, 1.0, 1, 'xla', 8)
    first, then = (compiled.shared(fn, model, 'xla') for fn in (sample.begin, sample.advance))
    pads = tf.constant(request.pads)
    logits, caches = first(model, tf.constant(request.context), pads=pads, size=request.size)
    loop = dict(pads=pads, prompt=tf.constant(request.context.shape[1], tf.int32), options=request.options(),
                length=tf.constant(request.length, tf.int32), plan=request.plan, decoder=sample.DECODER)
    at = [compiled_hlo(then, model, logits, caches, done=tf.constant(done), **loop) for done in (0, 8, 16)]
    assert at[0] == at[1] == at[2]


SEEDED = ('import gpt2_tf, sys; from gpt2_tf.sample import sample_sequence; '
          'm = gpt2_tf.load_model(sys.argv[1]); '
          'print(sample_sequence(m, 20, context=[1, 2, 3], batch_size=2, seed=1234, top_p=0.95).tolist())')


def test_seed_reproducible_across_processes(models):
    folder = str(FIXTURES / 'tf1-tiny')
    runs = [subprocess.run([sys.executable, '-c', SEEDED, folder], capture_output=True, text=True, check=True)
            for _ in range(2)]
    assert runs[0].stdout == runs[1].stdout
    here = sample_sequence(models['tf1-tiny'], 20, context=[1, 2, 3], batch_size=2, seed=1234, top_p=0.95)
    assert runs[0].stdout.strip() == str(here.tolist())


def test_seeds_and_rows_differ(models):
    model = models['tf1-tiny']
    a = sample_sequence(model, 20, context=[1, 2, 3], batch_size=2, seed=1)
    b = sample_sequence(model, 20, context=[1, 2, 3], batch_size=2, seed=2)
    assert (a != b).any()
    assert (a[0] != a[1]).any()  # rows of one batch draw independently
    np.testing.assert_array_equal(a, sample_sequence(model, 20, context=[1, 2, 3], batch_size=2, seed=1))


@pytest.mark.parametrize('mode', ['function', 'eager'])
def test_seeded_sampling_is_the_same_in_every_mode(models, mode):
    model = models['tf1-tiny-hot']
    kwargs = dict(context=[[5, 6, 7], [8, 9, 10]], seed=7, top_k=20, top_p=0.9, temperature=0.8)
    np.testing.assert_array_equal(sample_sequence(model, 25, mode=mode, **kwargs),
                                  sample_sequence(model, 25, mode='xla', **kwargs))


def test_start_token_is_unconditional_sampling(models):
    out = sample_sequence(models['tf1-tiny'], 10, start_token=0, batch_size=3, seed=3)
    assert out.shape == (3, 11) and (out[:, 0] == 0).all()


# --- the loop with fake steps: no model, the loop's bookkeeping alone ---------------------------

V_FAKE = 50


def counting_step(model, X, *, pads, caches, index):
    """The next token is (position + 1) % V_FAKE, position the last fed token's within its row."""
    position = index + tf.shape(X)[1] - 1 - pads
    return tf.one_hot((position + 1) % V_FAKE, V_FAKE) * 10, caches


def echo_step(model, X, *, pads, caches, index):
    """The next token is (3 * the last token fed + 1) % V_FAKE: a token fed back wrongly shows."""
    return tf.one_hot((X[:, -1] * 3 + 1) % V_FAKE, V_FAKE) * 10, caches


def slot_cache(model, batch, size):
    return [tf.zeros([batch], tf.int32)]  # how many slots each row has written


def slot_step(model, X, *, pads, caches, index):
    """The cache counts the slots written; the next token is that count % V_FAKE: caches dropped between
    steps show."""
    written = caches[0] + tf.shape(X)[1]
    return tf.one_hot(written % V_FAKE, V_FAKE) * 10, [written]


def ramp_logits(fed):
    """float32 [batch, V_FAKE]: distinct logits that depend on the token fed (numpy or tensor ids)."""
    ids = np.arange(V_FAKE)
    return ((ids[None, :] * 7 + np.asarray(fed)[:, None] * 3) % V_FAKE * np.float32(0.1)).astype(np.float32)


def ramp_step(model, X, *, pads, caches, index):
    ids = tf.range(V_FAKE)
    return tf.cast((ids[None, :] * 7 + X[:, -1:] * 3) % V_FAKE, tf.float32) * 0.1, caches


def failing_step(model, X, *, pads, caches, index):
    pytest.fail('ran before the request was checked')


FAILING = Decoder(step=failing_step, cache=no_cache)


@pytest.mark.parametrize('chunk', [1, 3, 32])
def test_loop_positions_with_a_fake_step(chunk):
    fed = []

    def recording_step(model, X, **where):
        fed.append(X.shape[1])
        return counting_step(model, X, **where)

    out = sample_sequence(FakeModel(V_FAKE, 40), 6, context=[[7, 7, 7], [9]], top_k=1, mode='eager', chunk=chunk,
                          decoder=Decoder(step=recording_step, cache=no_cache))
    np.testing.assert_array_equal(out[0], [7, 7, 7, 3, 4, 5, 6, 7, 8])
    np.testing.assert_array_equal(out[1], [9, 1, 2, 3, 4, 5, 6])
    assert fed == [8] + [1] * 5  # the padded prompt, then every new token but the last


@pytest.mark.parametrize('mode', MODES)
@pytest.mark.parametrize('chunk', [1, 4, 32])
def test_the_loop_feeds_back_the_tokens_it_chose(mode, chunk):
    prompts = [[7, 7, 7], [9], [2, 11]]
    out = sample_sequence(FakeModel(V_FAKE, 40), 9, context=prompts, top_k=1, mode=mode, chunk=chunk,
                          decoder=Decoder(step=echo_step, cache=no_cache))
    for prompt, row in zip(prompts, out):
        expected = list(prompt)
        for _ in range(9):
            expected.append((3 * expected[-1] + 1) % V_FAKE)
        np.testing.assert_array_equal(row, expected)


@pytest.mark.parametrize('chunk', [1, 5, 32])
def test_the_loop_threads_the_caches_through_every_step(chunk):
    out = sample_sequence(FakeModel(V_FAKE, 40), 12, context=[[7, 7, 7], [9]], top_k=1, mode='function', chunk=chunk,
                          decoder=Decoder(step=slot_step, cache=slot_cache))
    padded = 8  # both prompts fill the 8 slots of their bucket
    np.testing.assert_array_equal(out[1][1:], np.arange(padded, padded + 12) % V_FAKE)
    np.testing.assert_array_equal(out[0][3:], out[1][1:])


@pytest.mark.parametrize('chunk', [2, 3, 32])
def test_the_loops_log_probs_come_from_the_steps_logits(chunk):
    prompt = [5, 6, 7]
    chunks = list(sample_chunks(FakeModel(V_FAKE, 40), 7, context=prompt, batch_size=2, top_k=1, mode='eager', chunk=chunk,
                                logprobs=3, decoder=Decoder(step=ramp_step, cache=no_cache)))
    got = {name: np.concatenate([c[name] for c in chunks], axis=1) for name in chunks[0]}
    fed = [prompt[-1]]  # expected, from numpy alone: greedy over ramp_logits, log-softmax in float64
    log_probs, top_ids = [], []
    for _ in range(7):
        row = ramp_logits(fed[-1:])[0].astype(np.float64)
        lp = row - np.log(np.exp(row - row.max()).sum()) - row.max()
        fed.append(int(np.argmax(row)))
        log_probs.append(lp[fed[-1]])
        top_ids.append(np.argsort(-lp, kind='stable')[:3])
    for i in range(2):
        np.testing.assert_array_equal(got['tokens'][i], fed[1:])
        np.testing.assert_allclose(got['log_probs'][i], log_probs, atol=1e-6)  # float32 log-softmax of values < 5
        np.testing.assert_array_equal(got['top_ids'][i], top_ids)


@pytest.mark.parametrize('kwargs, message', [
    (dict(length=31, context=[1] * 3), r'prompt 0: 3 tokens \+ length 31 exceeds the window by 1 '
                                       r'\(needs prompt \+ length - 1 <= n_ctx = 32\)'),
    (dict(length=33, start_token=0), 'length 33 is longer than the window'),
    (dict(length=5, context=[]), 'prompt 0 is empty'),
    (dict(length=5, context=[[1, 2], []]), 'prompt 1 is empty'),
    (dict(length=5, start_token=5.7), 'start_token must be an integer token id, got 5.7'),  # was token 5
    (dict(length=5, start_token=True), 'start_token must be an integer token id, got True'),
    (dict(length=5, start_token=512), r'token id 512 is outside the vocabulary \[0, 512\)'),
    (dict(length=5, context=[1, 512]), r'prompt 0: token id 512 is outside the vocabulary \[0, 512\)'),
    (dict(length=5, context=[-3]), 'token id -3 is outside'),
    (dict(length=5, context=[2**32 + 5]), 'token id 4294967301 is outside'),
    (dict(length=5, context=[1], top_k=-1), 'top_k must be an integer >= 0'),
    (dict(length=5, context=[1], top_p=1.5), r'top_p must be in \[0, 1\]'),
    (dict(length=5, context=[1], top_p=-0.1), r'top_p must be in \[0, 1\]'),
    (dict(length=5, context=[1], temperature=-1), r'temperature must be in \[0, 2\]'),
    (dict(length=5, context=[1], temperature=2.5), r'temperature must be in \[0, 2\]'),
    (dict(length=5, context=[1], temperature=float('nan')), r'temperature must be in \[0, 2\]'),
    (dict(length=5, context=[[1], [2]], top_k=[1, 2, 3]), r'top_k must be a number or one value per row \(2\)'),
    (dict(length=5, context=[[1], [2]], top_k=[1, 2.5]), r'top_k must be an integer >= 0 .*got 2.5$'),  # not 1.0
    (dict(length=5, context=[1], seed=2**70), 'seed .* is out of range'),
    (dict(length=5, context=[1], seed=(1, 2, 3)), 'seed must be an integer, a pair of integers, or one pair per row'),
    (dict(length=5, context=[1], chunk=0), 'chunk must be a positive integer'),
    (dict(length=0, context=[1]), 'length must be a positive integer'),
    (dict(length=5), 'give exactly one of context and start_token'),
    (dict(length=5, context=[1], start_token=0), 'give exactly one of context and start_token'),
    (dict(length=5, context=[[1], [2]], batch_size=3), 'batch_size 3 differs from the 2 prompts'),
    (dict(length=5, context=[1.5]), 'token ids must be integers'),
    (dict(length=5, context='Hello'), 'context must be token ids, got text: encode it first'),
    (dict(length=5, context=5), 'context must be a list of token ids, or one list per row, got 5'),
    (dict(length=5, context=np.int32(5)), 'context must be a list of token ids, or one list per row, got 5'),
    (dict(length=5, context=[[1, 2], 3]), 'context mixes token ids and lists of them'),
    (dict(length=5, context=[3, [1, 2]]), 'context mixes token ids and lists of them'),
    (dict(length=5, context=[1], mode='fast'), "mode must be one of"),
])
def test_bad_requests_fail_before_compute(kwargs, message):
    model = gpt2_tf.load_model(FIXTURES / 'tf1-tiny')
    with pytest.raises(ValueError, match=message):
        sample_sequence(model, **kwargs, decoder=FAILING)


# --- per-row seeds and options, the chunked loop ------------------------------------------------

@pytest.mark.parametrize('mode', MODES)
def test_a_row_equals_its_key_sampled_alone(models, mode):
    model = models['tf1-tiny-hot']
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [3]]
    options = dict(temperature=[0.8, 1.0, 1.7], top_k=[0, 20, 5], top_p=[0.9, 1.0, 0.5])
    together = sample_sequence(model, 20, context=prompts, seed=(11, 4), mode=mode, **options)
    keys = noise.row_keys((11, 4), 3)
    for i, prompt in enumerate(prompts):
        alone = sample_sequence(model, 20, context=prompt, seed=keys[i:i + 1], mode=mode,
                                **{name: values[i] for name, values in options.items()})
        np.testing.assert_array_equal(together[i], alone[0], f'row {i}')


def test_row_keys_follow_the_seed_forms():
    pair = noise.row_keys((3, 9), 4)
    assert pair.shape == (4, 2) and pair.dtype == np.int64 and len({tuple(k) for k in pair}) == 4
    np.testing.assert_array_equal(noise.row_keys(3, 4), noise.row_keys((3, 0), 4))  # an int s is (s, 0)
    np.testing.assert_array_equal(noise.row_keys(pair, 4), pair)  # one pair per row: used as given
    np.testing.assert_array_equal(pair[2], tf.random.experimental.stateless_fold_in(
        tf.constant([3, 9], tf.int64), tf.constant(2, tf.int64), alg='philox').numpy())


@pytest.mark.parametrize('chunk', [1, 5, 16])
def test_chunk_size_does_not_change_the_tokens(models, chunk):
    model = models['tf1-tiny-hot']
    kwargs = dict(context=[[5, 6, 7], [8, 9, 10]], seed=5, top_k=30, top_p=0.95, temperature=1.2)
    np.testing.assert_array_equal(sample_sequence(model, 23, chunk=chunk, **kwargs),
                                  sample_sequence(model, 23, chunk=64, **kwargs))


def test_sample_chunks_yields_the_same_tokens_chunk_by_chunk(models):
    model = models['tf1-tiny-hot']
    chunks = list(sample_chunks(model, 21, context=[5, 6, 7], batch_size=2, seed=8, chunk=8))
    assert [c.shape for c in chunks] == [(2, 8), (2, 8), (2, 5)]
    whole = sample_sequence(model, 21, context=[5, 6, 7], batch_size=2, seed=8)
    np.testing.assert_array_equal(np.concatenate(chunks, axis=1), whole[:, 3:])
    first = next(iter(sample_chunks(model, 21, context=[5, 6, 7], batch_size=2, seed=8, chunk=8)))
    np.testing.assert_array_equal(first, chunks[0])  # stopping after one chunk is allowed


def test_the_length_rule_allows_the_whole_window(models):
    model = models['tf1-tiny']  # n_ctx = 32
    out = sample_sequence(model, 32, start_token=0, batch_size=2, seed=1)  # 1 + 32 - 1 = n_ctx
    assert out.shape == (2, 33)
    out = sample_sequence(model, 28, context=[1, 2, 3, 4, 5], top_k=1)  # 5 + 28 - 1 = n_ctx
    assert out.shape == (1, 33)


SOAK = '''
import gc, json, sys, types, weakref
import gpt2_tf
from gpt2_tf import compiled, sample

def rss_mb():
    with open('/proc/self/status') as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith('VmRSS'))

fixture, bundled = sys.argv[1:]
alive, cycles = [], []
for i in range(20):  # build, sample from and drop 20 models of one shape
    model = gpt2_tf.load_model(fixture)
    sample.sample_sequence(model, 20, context=[1, 2, 3], batch_size=2, seed=i, top_k=20, top_p=0.9)
    alive.append(weakref.ref(model))
    del model
    gc.collect()
    cycles.append(rss_mb())
hp = gpt2_tf.HParams.from_json(fixture + '/hparams.json')
shape = types.SimpleNamespace(hparams=hp, dtype='float32')  # the models are gone; their shape stays
shared_traces = [compiled.shared(f, shape, 'xla').tracing_count for f in (sample.begin, sample.advance)]
model = gpt2_tf.load_model(bundled)
calls = []
for i in range(200):
    gpt2_tf.generate(model, 'Hello there', 12, seed=i, top_k=40)
    calls.append(rss_mb())
traces = [compiled.shared(f, model, 'xla').tracing_count for f in (sample.begin, sample.advance)]
print(json.dumps(dict(alive=sum(r() is not None for r in alive), cycles=cycles, calls=calls,
                      shared_traces=shared_traces, traces=traces)))
'''


@pytest.mark.slow
def test_soak_models_are_freed_and_nothing_recompiles():
    bundled = str(FIXTURES.parent.parent / 'gpt2_tf' / 'assets' / 'test-checkpoint')
    run = subprocess.run([sys.executable, '-c', SOAK, str(FIXTURES / 'tf1-tiny-hot'), bundled],
                         capture_output=True, text=True, check=True)
    report = __import__('json').loads(run.stdout.splitlines()[-1])
    assert report['alive'] == 0  # the compiled loop keeps no model alive
    assert report['shared_traces'] == [1, 1]  # 20 models of one shape share one compiled loop
    assert report['traces'] == [1, 1]  # 200 calls of one shape: compiled once
    # RSS after the first cycle and after the first call stays within 25 MB (measured: under 2 MB).
    assert max(report['cycles'][1:]) - report['cycles'][0] < 25, report['cycles']
    assert max(report['calls'][1:]) - report['calls'][0] < 25, report['calls'][::20]


def test_a_run_time_top_k_finds_the_same_kth_logit_as_tf_top_k():
    rng = np.random.default_rng(4)
    logits = tf.constant(np.round(rng.standard_normal((6, 500)) * 3, 1).astype(np.float32))  # many ties
    k = tf.constant([1, 2, 7, 40, 499, 500], tf.int32)
    keys = thresholds.order_keys(logits)
    values = tf.sort(logits, direction='DESCENDING')
    expected = thresholds.order_keys(tf.gather(values, k - 1, batch_dims=1))
    np.testing.assert_array_equal(thresholds.kth_largest(keys, k), expected)


def test_the_loops_log_probs_are_the_models_raw_distribution(models):
    model = models['tf1-tiny-hot']
    prompt = [5, 6, 7, 8]
    chunks = list(sample_chunks(model, 10, context=prompt, seed=3, top_k=20, temperature=0.7, logprobs=4, chunk=4))
    tokens = np.concatenate([c['tokens'] for c in chunks], axis=1)[0]
    lp = np.concatenate([c['log_probs'] for c in chunks], axis=1)[0]
    top_ids = np.concatenate([c['top_ids'] for c in chunks], axis=1)[0]
    full = np.concatenate([prompt, tokens])
    scored, ids, top_lp = gpt2_tf.score(model, [full.tolist()], top=4)
    np.testing.assert_allclose(lp, scored[0][len(prompt) - 1:], atol=1e-4)  # no temperature, no filters
    np.testing.assert_array_equal(top_ids, ids[0][len(prompt) - 1:])
    np.testing.assert_array_equal(tokens, sample_sequence(model, 10, context=prompt, seed=3, top_k=20,
                                                          temperature=0.7)[0, 4:])


def break_every_logit(model):
    model.ln_f.g.assign(tf.tensor_scatter_nd_update(model.ln_f.g, [[0]], [np.nan]))  # every logit NaN


def break_one_logit(model, value):
    wte = model.wte  # token 40's row: its logit alone (the prompt does not hold it); XLA's max skips a NaN
    model.wte.assign(tf.tensor_scatter_nd_update(wte, [[40]], [tf.fill([wte.shape[1]], value)]))


@pytest.mark.parametrize('options', [dict(top_k=1), dict(top_k=40), dict(temperature=0.8), dict(top_p=0.9)],
                         ids=['greedy', 'top_k', 'full', 'top_p'])
@pytest.mark.parametrize('mode', MODES)
@pytest.mark.parametrize('broken', [break_every_logit, lambda m: break_one_logit(m, np.nan),
                                    lambda m: break_one_logit(m, np.inf)], ids=['all NaN', 'one NaN', 'inf weights'])
def test_nan_logits_are_refused_not_drawn_as_ids_past_the_vocabulary(options, mode, broken):
    model = gpt2_tf.load_model(FIXTURES / 'tf1-tiny')
    broken(model)
    with pytest.raises(gpt2_tf.GPT2Error, match=r"^the model's logits were not finite \(NaN or \+inf\), so no token "
                                                r'could be drawn: its weights hold NaN'):
        sample_sequence(model, 3, context=[[1, 2, 3]], seed=1, mode=mode, **options)
