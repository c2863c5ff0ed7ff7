"""What the sampler draws, tested by drawing: support, goodness of fit, and end to end against TF1.

Every test uses fixed seeds, so none is flaky: a p-value below the threshold
means a wrong distribution (each test was seen to fail with the temperature
dropped, a filter dropped, or u = 1.0 allowed back in).
"""

import numpy as np
import pytest
import tensorflow as tf

import gpt2_tf
from gpt2_tf import sample
from gpt2_tf.noise import UNIFORM_BITS, gumbel, row_keys, uniform, uniform_bits
from gpt2_tf.sample import choose
from gpt2_tf.thresholds import floors, order_keys
from gpt2_tf.tf1_reference import Reference, top_k_filter, top_p_filter

from conftest import FIXTURES
from support import chi_square_p_value

P_MIN = 1e-4  # a correct sampler fails one such test in 10,000 seeds; the seeds here are fixed
V = 50257


def peaked_logits(vocab: int, seed: int) -> np.ndarray:
    """A GPT-2-like row: a long flat tail and a head of a few dozen likely tokens."""
    rng = np.random.default_rng(seed)
    row = rng.standard_normal(vocab).astype(np.float32) * 1.5
    row[rng.choice(vocab, 30, replace=False)] += rng.uniform(3, 8, 30).astype(np.float32)
    return row


def original_probs(row, temperature, top_k, top_p) -> np.ndarray:
    """float64 [vocab]: the distribution the original sample_sequence draws from for one row.

    At top_p = 1 the port skips the nucleus filter, which in the original could still
    drop tail tokens whose float32 cumulative sum rounded above 1 (a named departure).
    """
    kept = top_k_filter(tf.constant(row[None] / np.float32(temperature)), top_k)
    if top_p < 1:
        kept = top_p_filter(kept, top_p)
    kept = kept.numpy()[0]
    probs = np.where(kept > -1e9, np.exp(kept.astype(np.float64) - kept.max()), 0.0)
    return probs / probs.sum()


_choose = tf.function(choose, jit_compile=True)


def draw(row, temperature, top_k, top_p, *, rows: int, steps: int, seed: int) -> np.ndarray:
    """Token counts [vocab] over rows x steps draws from `choose`, all on the same logits, with the
    options the decode loop would pass."""
    logits = tf.constant(np.tile(row, [rows, 1]))
    options = [tf.fill([rows], np.float32(temperature)), tf.fill([rows], np.int32(top_k)),
               tf.fill([rows], np.float32(top_p)), tf.constant(row_keys(seed, rows))]
    plan = sample.plan_for(np.array([temperature]), np.array([top_k]), row.shape[-1], chunk=1)
    kmax, among_top = plan.kmax, plan.among_top  # as the decode loop decides
    counts = np.zeros(row.shape[-1], np.int64)
    for step in range(steps):
        ids = _choose(logits, *options, tf.constant(step, tf.int64), kmax=kmax, among_top=among_top).numpy()
        np.add.at(counts, ids, 1)
    return counts


# --- the noise ---------------------------------------------------------------------------------

def test_uniforms_stay_strictly_inside_zero_and_one():
    # The extreme grid points are exact in float32; u = 1.0 would make the noise +inf.
    u = uniform(tf.constant([0, (1 << UNIFORM_BITS) - 1], tf.int32)).numpy()
    assert u[0] == np.float32(2.0 ** -24) and u[1] == np.float32(1 - 2.0 ** -24)
    extremes = -np.log(-np.log(u.astype(np.float64)))
    assert np.isfinite(extremes).all() and extremes.min() > -2.82 and extremes.max() < 16.64
    noise = gumbel(tf.constant(row_keys(5, 200)), tf.constant(0, tf.int64), V).numpy()
    assert np.isfinite(noise).all() and noise.max() <= 16.64 and noise.min() >= -2.82


def test_uniform_bits_are_uniform_and_independent_of_the_batch():
    keys = row_keys(9, 64)
    bits = uniform_bits(tf.constant(keys), tf.constant(3, tf.int64), 4096).numpy()
    counts = np.bincount(bits.ravel() >> (UNIFORM_BITS - 8), minlength=256)  # 256 equal bins
    assert chi_square_p_value(counts, np.full(256, bits.size / 256))[2] > P_MIN
    alone = uniform_bits(tf.constant(keys[5:6]), tf.constant(3, tf.int64), 4096).numpy()
    np.testing.assert_array_equal(alone[0], bits[5])  # a row's bits depend on its key and the step only
    other_step = uniform_bits(tf.constant(keys[5:6]), tf.constant(4, tf.int64), 4096).numpy()
    assert (other_step != alone).mean() > 0.99


# --- the support: removed tokens are never drawn ----------------------------------------------------

@pytest.mark.parametrize('temperature, top_k, top_p', [
    (1.0, 40, 1.0), (1.0, 0, 0.9), (0.05, 40, 1.0), (2.0, 0, 0.5), (1.5, 100, 0.95),
])
def test_no_draw_outside_the_original_filters_support(temperature, top_k, top_p):
    row = peaked_logits(V, seed=1)
    allowed = original_probs(row, temperature, top_k, top_p) > 0
    counts = draw(row, temperature, top_k, top_p, rows=100, steps=100, seed=2)  # 10^4 draws
    assert counts.sum() == 10_000
    outside = counts[~allowed].sum()
    assert outside == 0, f'{outside} of 10,000 draws fell outside the {allowed.sum()} allowed tokens'


def test_kept_set_equals_the_original_float32_filter():
    """The top-p cut differs from the original's only where float32 rounding of the cumulative sum decides,
    found over the full row or among tf.math.top_k's candidates (a top_k's)."""
    rng = np.random.default_rng(3)
    for trial in range(12):
        scale = [0.5, 1.5, 3.0, 8.0][trial % 4]
        logits = (rng.standard_normal((4, V)) * scale).astype(np.float32)
        for temperature, top_k, top_p in [(1.0, 0, 0.9), (0.7, 40, 0.8), (1.3, 0, 0.5), (1.0, 1000, 0.95)]:
            kmax = sample.top_k_size(np.array([top_k]), V)
            check_kept_set(logits, temperature, top_k, top_p, None, None)  # the k-th logit by bisection, the full row
            check_kept_set(logits, temperature, top_k, top_p, kmax, tf.math.top_k(logits, k=kmax) if kmax else None)


def check_kept_set(logits, temperature, top_k, top_p, kmax, top):
    floor, _ = floors(tf.constant(logits), tf.fill([4], np.float32(temperature)), tf.fill([4], np.int32(top_k)),
                      tf.fill([4], np.float32(top_p)), kmax=kmax, top=top)
    ours = order_keys(tf.constant(logits)).numpy() >= floor.numpy()[:, None]
    x = top_k_filter(tf.constant(logits / np.float32(temperature)), top_k).numpy()
    theirs = top_p_filter(tf.constant(x), top_p).numpy() > -1e9
    # The original's cumulative sums, float32 as it computes them and exact, per token.
    order = np.argsort(-x, axis=-1, kind='stable')
    ordered = np.take_along_axis(x, order, -1)
    cum32 = tf.cumsum(tf.nn.softmax(ordered, axis=-1), axis=-1).numpy().astype(np.float64)
    exact = np.exp(ordered.astype(np.float64) - ordered[:, :1])
    cum64 = np.cumsum(exact / exact.sum(-1, keepdims=True), axis=-1)
    doubtful = np.zeros_like(ours)
    np.put_along_axis(doubtful, order, (np.abs(cum32 - top_p) < 1e-5) | (np.abs(cum64 - top_p) < 1e-5), -1)
    assert not (ours & ~theirs & ~doubtful).any(), 'kept a token the original drops'
    assert not (theirs & ~ours & ~doubtful).any(), 'dropped a token the original keeps'


@pytest.mark.parametrize('temperature, top_k, top_p', [(1.0, 40, 1.0), (0.7, 40, 0.9), (1.3, 200, 1.0),
                                                      (2.0, 5, 0.5), (0.01, 3, 1.0), (1.0, 1000, 0.95)])
def test_drawing_among_the_top_k_picks_what_the_full_row_picks(temperature, top_k, top_p):
    rng = np.random.default_rng(8)
    logits = tf.constant((rng.standard_normal((8, V)) * 2).astype(np.float32))
    options = [tf.fill([8], np.float32(temperature)), tf.fill([8], np.int32(top_k)), tf.fill([8], np.float32(top_p)),
               tf.constant(row_keys(9, 8))]
    plan = sample.plan_for(np.array([temperature]), np.array([top_k]), V, chunk=1)
    assert plan.among_top and 0 < plan.kmax < V
    for step in range(100):
        ours = _choose(logits, *options, tf.constant(step, tf.int64), kmax=plan.kmax, among_top=True).numpy()
        # kmax=None: the k-th logit found by bisection, the nucleus over the full row, the draw over the full row
        full = _choose(logits, *options, tf.constant(step, tf.int64), kmax=None).numpy()
        np.testing.assert_array_equal(ours, full, err_msg=f'step {step}')


def mixed_rows() -> np.ndarray:
    rng = np.random.default_rng(12)
    flat = (rng.standard_normal((3, V)) * 1.5).astype(np.float32)  # a 0.9-nucleus of thousands of tokens
    peaked = flat.copy()
    peaked[:, rng.choice(V, 20, replace=False)] += 12  # one of a few
    masked = np.full((2, V), -np.inf, np.float32)  # as penalties or a mask leave a row: a few finite logits
    masked[0, rng.choice(V, 100, replace=False)] = rng.standard_normal(100) * 3
    masked[1, :3] = [1, 2, 3]
    return np.concatenate([peaked, flat, masked])


@pytest.mark.parametrize('rows, temperature, top_k, top_p', [
    # every drawing row has a top_k: greedy rows, top_k alone, top_k with top_p, rows left with a few finite logits
    ([0, 1, 2, 3, 1, 5, 6], [0, 1, 1, 1, 0.7, 1, 1], [0, 40, 300, 40, 1, 10, 50], [0.9, 1, 0.8, 0.9, 0.9, 0.5, 0.9]),
    # and a row cut by top_p alone: the draw over the full row, the top_k rows' floors still from the candidates
    ([0, 3, 2, 4, 1, 5, 6], [0, 1, 1, 1, 0.7, 1, 1], [0, 0, 40, 300, 1, 0, 10], [0.9, 0.9, 1, 0.8, 0.9, 0.95, 0.5]),
])
def test_rows_of_mixed_options_draw_what_the_full_row_draws(rows, temperature, top_k, top_p):
    logits = tf.constant(mixed_rows()[rows])
    options = [tf.constant(np.float32(temperature)), tf.constant(np.int32(top_k)), tf.constant(np.float32(top_p)),
               tf.constant(row_keys(4, len(rows)))]
    plan = sample.plan_for(np.float32(temperature), np.int32(top_k), V, chunk=1)
    assert 0 < plan.kmax < V
    for step in range(20):
        ours = _choose(logits, *options, tf.constant(step, tf.int64), kmax=plan.kmax, among_top=plan.among_top)
        full = _choose(logits, *options, tf.constant(step, tf.int64), kmax=None)
        np.testing.assert_array_equal(ours.numpy(), full.numpy(), err_msg=f'step {step}')


def test_the_candidates_are_past_the_drawing_rows_top_k():
    one = lambda *values: np.array(values)  # noqa: E731
    assert sample.plan_for(one(1.0, 1.0), one(40, 300), V, chunk=1).kmax == 1024
    assert sample.plan_for(one(0.0, 1.0), one(20000, 40), V, chunk=1).kmax == 64  # a greedy row's top_k
    assert sample.plan_for(one(1.0, 1.0), one(1, 40), V, chunk=1).kmax == 64  # top_k 1 is greedy too
    assert sample.plan_for(one(1.0), one(0), V, chunk=1).kmax == 0
    assert sample.plan_for(one(1.0), one(20000), V, chunk=1).kmax == V  # no bucket past it: the full row


@pytest.mark.parametrize('top_k, top_p', [(20, 1.0), (64, 1.0), (20, 0.99)])
def test_ties_at_the_k_th_logit_past_the_candidates_are_drawn_as_the_full_row_draws_them(top_k, top_p):
    # 10 logits at 5 and 70 at 4: top_k 20 or 64 keeps all 80 (ties with the k-th survive, as in the original),
    # more than the 64 candidates top_k 20 alone would take; one row without ties shares the batch. With a top_p
    # too, the candidates above the ties hold less than it: its cut is found over the full row.
    rows, vocab = 400, 300
    row = np.full(vocab, -3.0, np.float32)
    row[:10], row[10:80] = 5.0, 4.0
    logits = np.tile(row, [rows, 1])
    logits[-1] = np.random.default_rng(0).standard_normal(vocab).astype(np.float32)
    options = [tf.fill([rows], np.float32(1.0)), tf.fill([rows], np.int32(top_k)), tf.fill([rows], np.float32(top_p)),
               tf.constant(row_keys(3, rows))]
    kmax = sample.top_k_size(np.array([top_k]), vocab)
    drawn = set()
    for step in range(5):
        full, top = (_choose(tf.constant(logits), *options, tf.constant(step, tf.int64), kmax=k,
                             among_top=flag).numpy() for k, flag in ((None, False), (kmax, True)))
        np.testing.assert_array_equal(top, full, err_msg=f'step {step}')
        drawn |= set(full[:-1].tolist())
    assert drawn == set(range(80))  # every kept token, none past them


# --- goodness of fit ----------------------------------------------------------------------------------

@pytest.mark.parametrize('temperature, top_k, top_p', [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.6, 0, 1.0), (1.0, 40, 1.0), (0.8, 10, 1.0),
    (1.0, 0, 0.9), (1.3, 0, 0.6), (1.0, 40, 0.8), (0.5, 100, 0.95),
])
def test_draws_fit_the_filtered_softmax(temperature, top_k, top_p):
    row = peaked_logits(2000, seed=4)
    expected = original_probs(row, temperature, top_k, top_p)
    counts = draw(row, temperature, top_k, top_p, rows=200, steps=100, seed=5)  # 2 x 10^4 draws
    statistic, df, p = chi_square_p_value(counts, expected * counts.sum())
    assert p > P_MIN, f'chi-square {statistic:.1f} on {df} degrees of freedom: p = {p:.2g}'


def test_rows_with_their_own_options_draw_from_their_own_distributions():
    row = peaked_logits(2000, seed=6)
    settings = [(1.0, 0, 1.0), (0.6, 20, 1.0), (1.4, 0, 0.7), (0.0, 0, 1.0)]
    rows = 60 * len(settings)
    logits = tf.constant(np.tile(row, [rows, 1]))
    pick = np.repeat(np.arange(len(settings)), 60)
    options = [tf.constant(np.array([settings[i][0] for i in pick], np.float32)),
               tf.constant(np.array([settings[i][1] for i in pick], np.int32)),
               tf.constant(np.array([settings[i][2] for i in pick], np.float32)),
               tf.constant(row_keys(7, rows))]
    counts = np.zeros([len(settings), 2000], np.int64)
    for step in range(200):
        ids = _choose(logits, *options, tf.constant(step, tf.int64), kmax=64).numpy()
        for i in range(len(settings)):
            np.add.at(counts[i], ids[pick == i], 1)
    for i, (temperature, top_k, top_p) in enumerate(settings[:3]):
        expected = original_probs(row, temperature, top_k, top_p) * counts[i].sum()
        assert chi_square_p_value(counts[i], expected)[2] > P_MIN, f'setting {settings[i]}'
    assert counts[3, row.argmax()] == counts[3].sum()  # temperature 0: always the argmax


# --- end to end: the loop against the TF1 graph ---------------------------------------------------

@pytest.fixture(scope='module')
def hot():
    folder = FIXTURES / 'tf1-tiny-hot'
    model = gpt2_tf.load_model(folder)
    reference = Reference(model.hparams, str(folder / 'model.ckpt'))
    prompt = np.load(folder / 'reference.npz')['tokens'][0, :6]
    return model, reference, prompt


@pytest.mark.parametrize('temperature, top_k, top_p', [(1.0, 0, 1.0), (0.8, 40, 1.0), (1.2, 0, 0.9)])
def test_next_token_draws_fit_the_tf1_graphs_distribution(hot, temperature, top_k, top_p):
    model, reference, prompt = hot
    logits = reference(prompt[None])['logits'][0, -1]
    expected = original_probs(logits, temperature, top_k, top_p)
    out = sample_sequence_rows(model, prompt, 4000, temperature, top_k, top_p)
    counts = np.bincount(out[:, len(prompt)], minlength=model.hparams.n_vocab)
    statistic, df, p = chi_square_p_value(counts, expected * counts.sum())
    assert p > P_MIN, f'chi-square {statistic:.1f} on {df} degrees of freedom: p = {p:.2g}'


def sample_sequence_rows(model, prompt, rows, temperature, top_k, top_p):
    return gpt2_tf.sample_sequence(model, 2, context=prompt, batch_size=rows, temperature=temperature,
                                   top_k=top_k, top_p=top_p, seed=21)


def test_the_tf1_references_filters_equal_the_originals_outputs():
    """The reference's filters, from which original_probs builds the expected distributions, against the outputs the
    original's top_k_logits and top_p_logits wrote into the fixture, row by row."""
    ref = np.load(FIXTURES / 'tf1-filters.npz')
    for row in range(len(ref['logits'])):
        logits = tf.constant(ref['logits'][row:row + 1])
        for i, k in enumerate(ref['ks']):
            np.testing.assert_array_equal(top_k_filter(logits, int(k)).numpy()[0], ref['top_k'][i][row], f'k={k}')
        for i, p in enumerate(ref['ps']):
            np.testing.assert_array_equal(top_p_filter(logits, float(p)).numpy()[0], ref['top_p'][i][row], f'p={p}')


@pytest.mark.parametrize('top_k, top_p', [(0, 1.0), (40, 1.0), (0, 0.9)])
def test_the_tf1_reference_sampler_draws_the_same_distribution(hot, top_k, top_p):
    model, reference, prompt = hot
    logits = reference(prompt[None])['logits'][0, -1]
    expected = original_probs(logits, 1.0, top_k, top_p)
    tf1 = reference.sampler(length=1, batch_size=4000, top_k=top_k, top_p=None if top_p == 1 else top_p, seed=3)
    counts = np.bincount(tf1(np.tile(prompt, [4000, 1]))[:, -1], minlength=model.hparams.n_vocab)
    statistic, df, p = chi_square_p_value(counts, expected * counts.sum())
    assert p > P_MIN, f'TF1 sampler: chi-square {statistic:.1f} on {df} degrees of freedom: p = {p:.2g}'
