"""Penalties, tested by what the loop draws: over a fake decoder whose next-token logits are a fixed row once
a known history has been forced, so the expected distribution is numpy's formula alone."""


import numpy as np
import pytest
import tensorflow as tf

from gpt2_tf import penalties, sample
from gpt2_tf.cli import main
from gpt2_tf.penalties import Penalties, penalize, penalties_for, record, start_state
from gpt2_tf.sample import MODES, Decoder, sample_chunks, sample_sequence

from support import FakeModel, chi_square_p_value, no_cache

P_MIN = 1e-4  # as in test_sampling_stats: a correct sampler fails one such test in 10,000 seeds; seeds are fixed
V = 12
ROW = np.array([2.0, 1.5, 1.0, 0.5, 0.2, -0.3, -0.6, -1.0, 1.2, 0.8, -0.2, 0.0], np.float32)  # both signs
PROMPT = [0, 5]  # one positive and one negative logit, never generated: repetition's prompt half
HISTORY = [1, 1, 6, 1]  # forced as the first generated tokens: token 1 three times, token 6 once
FORCE = 1000.0  # a forced history token's logit, beyond any penalty's reach


def history_step(model, X, *, pads, caches, index):
    """Generated token g is HISTORY[g] for g < len(HISTORY) (forced), then drawn from ROW, whatever was fed."""
    generated = index + tf.shape(X)[1] - pads - len(PROMPT)  # the index of the token these logits choose
    forced = tf.one_hot(tf.gather(HISTORY, tf.minimum(generated, len(HISTORY) - 1)), V) * FORCE
    return tf.where((generated < len(HISTORY))[:, None], forced, ROW[None]), caches


def fixed_step(model, X, *, pads, caches, index):
    """ROW at every step."""
    return tf.tile(ROW[None], [tf.shape(X)[0], 1]), caches


HISTORY_DECODER = Decoder(step=history_step, cache=no_cache)
FIXED = Decoder(step=fixed_step, cache=no_cache)


def failing_step(model, X, *, pads, caches, index):
    pytest.fail('ran before the request was checked')


# --- the formulas, in numpy alone ------------------------------------------------------------------

def expected_logits(prompt, history, *, presence=0.0, frequency=0.0, repetition=1.0, bias=None):
    """float64 [V]: ROW after the penalties, written from their definitions (HF's rule, then OpenAI's)."""
    logits = ROW.astype(np.float64)
    for t in set(prompt) | set(history):
        logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
    for t in set(history):
        logits[t] -= history.count(t) * frequency + presence
    for t, b in (bias or {}).items():
        logits[t] += b
    return logits


def softmax(z, top_k=0):
    if top_k:
        z = np.where(z >= np.sort(z)[-top_k], z, -np.inf)
    p = np.exp(z - z.max())
    return p / p.sum()


def next_token_counts(rows, *, mode='xla', temperature=1.0, top_k=0, **options) -> np.ndarray:
    """Counts [V] of the token drawn after PROMPT + HISTORY, one draw per row, each row with its own key."""
    out = sample_sequence(FakeModel(V, 64), len(HISTORY) + 1, context=PROMPT, batch_size=rows, seed=17, mode=mode,
                          temperature=temperature, top_k=top_k, decoder=HISTORY_DECODER, **options)
    np.testing.assert_array_equal(out[:, len(PROMPT):-1], np.tile(HISTORY, [rows, 1]))  # the history as forced
    return np.bincount(out[:, -1], minlength=V)


# --- the distribution after a known history ---------------------------------------------------------

@pytest.mark.parametrize('options', [
    dict(presence_penalty=1.5),
    dict(presence_penalty=-1.0),
    dict(frequency_penalty=0.7),
    dict(frequency_penalty=-0.4),
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.6),
], ids=lambda o: '-'.join(f'{k}={v}' for k, v in o.items()))
def test_the_next_token_fits_the_penalised_softmax(options):
    counts = next_token_counts(4000, temperature=0.8, **options)
    numpy_options = {name.split('_')[0]: value for name, value in options.items()}
    expected = softmax(expected_logits(PROMPT, HISTORY, **numpy_options) / 0.8) * counts.sum()
    statistic, df, p = chi_square_p_value(counts, expected)
    assert p > P_MIN, f'chi-square {statistic:.1f} on {df} degrees of freedom: p = {p:.2g}'
    unpenalised = softmax(ROW.astype(np.float64) / 0.8) * counts.sum()
    assert chi_square_p_value(counts, unpenalised)[2] < P_MIN  # the test tells the penalty from none


def test_all_penalties_apply_in_their_order_before_temperature_and_top_k():
    options = dict(repetition_penalty=1.6, frequency_penalty=0.5, presence_penalty=0.3, logit_bias={7: 3.0, 2: -0.5})
    counts = next_token_counts(4000, temperature=1.3, top_k=6, **options)
    logits = expected_logits(PROMPT, HISTORY, presence=0.3, frequency=0.5, repetition=1.6, bias={7: 3.0, 2: -0.5})
    expected = softmax(logits / 1.3, top_k=6) * counts.sum()
    statistic, df, p = chi_square_p_value(counts, expected)
    assert p > P_MIN, f'chi-square {statistic:.1f} on {df} degrees of freedom: p = {p:.2g}'


# --- ban and force ------------------------------------------------------------------------------

@pytest.mark.parametrize('temperature', [0.0, 1.0, 2.0])
def test_a_banned_token_is_never_drawn_and_a_forced_one_always_is(temperature):
    best, worst = int(ROW.argmax()), int(ROW.argmin())
    banned = sample_sequence(FakeModel(V, 64), 30, context=PROMPT, batch_size=200, seed=3, temperature=temperature,
                             logit_bias={best: -100}, decoder=FIXED)[:, len(PROMPT):]
    assert (banned != best).all()  # 6,000 draws
    if temperature:
        assert len(np.unique(banned)) == V - 1  # every other token still drawn
    forced = sample_sequence(FakeModel(V, 64), 30, context=PROMPT, batch_size=200, seed=3, temperature=temperature,
                             logit_bias={worst: 100}, decoder=FIXED)[:, len(PROMPT):]
    assert (forced == worst).all()


def test_each_row_keeps_its_own_penalties():
    best, worst = int(ROW.argmax()), int(ROW.argmin())
    prompts = [PROMPT] * 3
    options = dict(seed=(5, 1), temperature=1.0, decoder=FIXED)
    together = sample_sequence(FakeModel(V, 64), 40, context=prompts, logit_bias=[{best: -100}, {worst: 100}, None],
                               presence_penalty=[0, 0, 0], **options)[:, len(PROMPT):]
    assert (together[0] != best).all() and (together[1] == worst).all()
    alone = sample_sequence(FakeModel(V, 64), 40, context=prompts, **options)[:, len(PROMPT):]
    np.testing.assert_array_equal(together[2], alone[2])  # the row without penalties draws as it does without
    assert (alone[0] == best).any() and (alone[1] != worst).any()


def test_per_row_repetition_draws_each_rows_distribution():
    out = sample_sequence(FakeModel(V, 64), len(HISTORY) + 1, context=[PROMPT] * 4000, seed=23, temperature=0.8,
                          repetition_penalty=np.repeat([1.0, 2.0], 2000), decoder=HISTORY_DECODER)
    for half, repetition in enumerate([1.0, 2.0]):
        counts = np.bincount(out[half * 2000:(half + 1) * 2000, -1], minlength=V)
        expected = softmax(expected_logits(PROMPT, HISTORY, repetition=repetition) / 0.8) * counts.sum()
        assert chi_square_p_value(counts, expected)[2] > P_MIN, f'repetition_penalty {repetition}'


# --- none set, and the modes --------------------------------------------------------------------

def traces(model, mode) -> int:
    return sum(sample.compiled.shared(fn, model, mode).tracing_count for fn in (sample.begin, sample.advance))


@pytest.mark.parametrize('mode', MODES)
def test_without_penalties_the_loop_is_unchanged(mode):
    kwargs = dict(context=[[1, 2, 3], [4]], seed=9, top_k=5, mode=mode, chunk=4, decoder=FIXED)
    plain = sample_sequence(FakeModel(V, 64), 12, **kwargs)
    before = traces(FakeModel(V, 64), mode)
    defaults = sample_sequence(FakeModel(V, 64), 12, logit_bias=[{}, None], presence_penalty=[0, 0], frequency_penalty=0.0,
                               repetition_penalty=1, **kwargs)
    assert traces(FakeModel(V, 64), mode) == before  # the same compiled loop: no penalties traced in
    for a, b in zip(plain, defaults):
        np.testing.assert_array_equal(a, b)
    request = sample.Request(FakeModel(V, 64), 12, [1, 2], None, None, 1, 0, 1, 0, mode, None, presence_penalty=0)
    assert not request.plan.penalized and request.penalties is None


@pytest.mark.parametrize('mode', ['function', 'eager'])
@pytest.mark.parametrize('chunk', [1, 3, 32])
def test_penalties_draw_the_same_in_every_mode_and_chunk(mode, chunk):
    kwargs = dict(context=[[1, 2, 3], [4, 4]], seed=4, temperature=[0.9, 1.5], top_k=[0, 7], length=20,
                  logit_bias=[{3: 2.0}, {0: -100}], presence_penalty=[0.5, -0.3], frequency_penalty=[0.2, 1.0],
                  repetition_penalty=[1.3, 0.8], decoder=FIXED)
    reference = sample_sequence(FakeModel(V, 64), mode='xla', chunk=5, **kwargs)
    for got, want in zip(sample_sequence(FakeModel(V, 64), mode=mode, chunk=chunk, **kwargs), reference):
        np.testing.assert_array_equal(got, want)
    assert (reference[1][2:] != 0).all() and (reference[0][3:] == 3).mean() < 0.5  # the penalties at work


def test_frequency_penalty_counts_across_chunks():
    """A frequency penalty of 2 on logits 1 apart: greedy takes each token at most twice running, whatever the
    chunk boundaries, so the counts must travel between chunks."""
    out = sample_sequence(FakeModel(V, 64), 30, context=[0], temperature=0, frequency_penalty=2.0, chunk=2,
                          decoder=FIXED)[0, 1:]
    # In numpy: greedy over ROW - 2 * counts, one token at a time.
    counts, expected = np.zeros(V), []
    for _ in range(30):
        expected.append(int(np.argmax(ROW - 2.0 * counts)))
        counts[expected[-1]] += 1
    np.testing.assert_array_equal(out, expected)


def test_log_probs_stay_the_models_raw_distribution():
    worst = int(ROW.argmin())
    chunks = list(sample_chunks(FakeModel(V, 64), 6, context=PROMPT, seed=1, logit_bias={worst: 100}, logprobs=2,
                                repetition_penalty=3.0, decoder=FIXED))
    raw = ROW.astype(np.float64) - np.log(np.exp(ROW.astype(np.float64)).sum())
    np.testing.assert_array_equal(chunks[0]['tokens'], [[worst] * 6])
    np.testing.assert_allclose(chunks[0]['log_probs'], [[raw[worst]] * 6], atol=1e-6)  # float32 log-softmax
    np.testing.assert_array_equal(chunks[0]['top_ids'][0], [np.argsort(-ROW)[:2]] * 6)


# --- the pieces the batching engine calls ---------------------------------------------------------

def test_penalize_and_record_follow_the_formulas():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((3, V)).astype(np.float32) * 3
    counts = rng.integers(0, 3, (3, V)).astype(np.float32)
    seen = rng.random((3, V)) < 0.3
    p = Penalties(bias=rng.uniform(-5, 5, (3, V)).astype(np.float32), presence=np.float32([0.5, -1, 2]),
                  frequency=np.float32([0.1, 0.7, -2]), repetition=np.float32([1.2, 0.7, 3]))
    z = logits.astype(np.float64)
    repeated = seen | (counts > 0)
    z = np.where(repeated, np.where(z > 0, z / p.repetition[:, None], z * p.repetition[:, None]), z)
    z = z - counts * p.frequency[:, None] - (counts > 0) * p.presence[:, None] + p.bias
    got = penalize(tf.constant(logits), tf.constant(counts), tf.constant(seen), Penalties(*map(tf.constant, p)))
    np.testing.assert_allclose(got.numpy(), z, rtol=1e-6, atol=1e-5)  # float32 of values below 20
    tokens = np.int32([3, 0, 3])
    after = counts.copy()
    after[np.arange(3), tokens] += 1
    np.testing.assert_array_equal(record(tf.constant(counts), tf.constant(tokens)).numpy(), after)


def test_rows_built_together_equal_rows_built_alone():
    per_row = dict(logit_bias=[{1: 5.0}, None, {0: -100, 11: 2.5}], presence_penalty=[0.1, 0, 0],
                   frequency_penalty=[0, -0.5, 0], repetition_penalty=[1, 1, 1.4])
    together = penalties_for(3, V, **per_row)
    alone = [penalties_for(1, V, **{name: values[i] for name, values in per_row.items()}) for i in range(3)]
    for field, got in zip(Penalties._fields, together):
        np.testing.assert_array_equal(got, np.concatenate([getattr(a, field) for a in alone]), field)
    assert together.bias[2, 0] == -100 and together.bias[2, 11] == 2.5 and together.bias[1].sum() == 0
    assert penalties_for(2, V) is None and penalties_for(2, V, logit_bias=[{}, None], repetition_penalty=1.0) is None
    for field, got in zip(Penalties._fields, penalties.neutral(2, V)):
        np.testing.assert_array_equal(got, [[0] * V] * 2 if field == 'bias' else [float(field == 'repetition')] * 2)
    counts, seen = start_state([[3, 3, 5], [0]], V)
    assert counts.shape == (2, V) and not counts.any()
    expected = np.zeros([2, V], bool)
    expected[0, [3, 5]] = expected[1, 0] = True
    np.testing.assert_array_equal(seen, expected)


# --- bad values --------------------------------------------------------------------------------

@pytest.mark.parametrize('kwargs, message', [
    (dict(presence_penalty=2.5), r'presence_penalty must be a number in \[-2, 2\] \(0: none\), got 2.5'),
    (dict(frequency_penalty=-3), r'frequency_penalty must be a number in \[-2, 2\]'),
    (dict(frequency_penalty=float('nan')), r'frequency_penalty must be a number in \[-2, 2\]'),
    (dict(presence_penalty=[0.1, 0.2, 0.3]), r'presence_penalty must be a number or one value per row \(2\)'),
    (dict(repetition_penalty=0), r'repetition_penalty must be a number in \[0.01, 100\] \(1: none'),
    (dict(repetition_penalty=-1.5), r'repetition_penalty must be a number in \[0.01, 100\]'),
    (dict(repetition_penalty='high'), r"repetition_penalty must be a number in .*, got 'high'"),
    (dict(repetition_penalty=1e39), r'repetition_penalty must be a number in .*, got 1e\+39'),  # inf in float32
    (dict(repetition_penalty=1e-50), r'repetition_penalty must be a number in .*, got 1e-50'),  # 0 in float32
    (dict(logit_bias={12: 1}), r'logit_bias: token id 12 is outside the vocabulary \[0, 12\)'),
    (dict(logit_bias={-1: 1}), r'logit_bias: token id -1 is outside the vocabulary'),
    (dict(logit_bias={'5': 1}), r"logit_bias keys must be integer token ids .*got '5'"),
    (dict(logit_bias={5: 101}), r'logit_bias for token 5 must be a number in \[-100, 100\]'),
    (dict(logit_bias={5: True}), r'logit_bias for token 5 must be a number'),
    (dict(logit_bias=[{5: 1}]), r'logit_bias must be a dict .*or one dict \(or None\) per row \(2\); got a list of 1'),
    (dict(logit_bias=[{5: 1}, 7]), r'logit_bias entries must be dicts'),
    (dict(logit_bias=5), r'logit_bias must be a dict'),
])
def test_bad_penalties_fail_before_compute(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sample_sequence(FakeModel(V, 64), 5, context=[[1], [2]], decoder=Decoder(step=failing_step, cache=no_cache),
                        **kwargs)


# --- the command line ---------------------------------------------------------------------------

def run_cli(capsys, monkeypatch, tmp_path, *argv):
    monkeypatch.chdir(tmp_path)
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's errors
        code = e.code
    return (code,) + capsys.readouterr()


@pytest.mark.parametrize('flags, message', [
    (['--logit_bias', '50256=-100'], "argument --logit_bias/--logit-bias: give token ids and biases as ID:BIAS pairs separated "
                                     "by commas, e.g. 50256:-100,198:5; got '50256=-100'"),
    (['--logit_bias', '1:2,x:3'], 'ID:BIAS pairs'),
    (['--logit_bias', '1:2:3'], 'ID:BIAS pairs'),
    (['--logit_bias', '60000:-100'], r'error: logit_bias: token id 60000 is outside the vocabulary [0, 50257)'),
    (['--logit_bias', '5:-200'], 'error: logit_bias for token 5 must be a number in [-100, 100]'),
    (['--presence_penalty', '3'], 'error: presence_penalty must be a number in [-2, 2] (0: none), got 3'),
    (['--frequency-penalty', '-2.5'], 'error: frequency_penalty must be a number in [-2, 2]'),
    (['--repetition_penalty', '0'], 'error: repetition_penalty must be a number in [0.01, 100]'),
])
def test_the_command_line_refuses_bad_penalties_in_one_line(capsys, monkeypatch, tmp_path, flags, message):
    code, out, err = run_cli(capsys, monkeypatch, tmp_path, 'generate', 'Hello', '--length', '4', *flags)
    assert code == 2 and message in err, err
    assert 'Traceback' not in err and not out


def test_the_command_line_bans_and_forces(capsys, monkeypatch, tmp_path):
    common = ['--length', '6', '--seed', '2', '--mode', 'function', '--quiet', '--model_name', 'test']
    code, out, _ = run_cli(capsys, monkeypatch, tmp_path, 'generate', 'Hello', '--logit_bias', '13:100', *common)
    assert code == 0 and '......' in out  # id 13 is '.' in GPT-2's vocabulary
    code, out, _ = run_cli(capsys, monkeypatch, tmp_path, 'sample', '--nsamples', '1', '--repetition_penalty', '1.5',
                           '--presence_penalty', '1', '--frequency_penalty', '0.5', *common)
    assert code == 0 and 'SAMPLE 1' in out
