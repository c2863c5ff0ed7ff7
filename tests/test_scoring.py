"""Scoring against the TF1 graph: log-probs, top-N, windowed perplexity, padded batches, bad input."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest

import gpt2_tf
from gpt2_tf import HParams, compiled, scoring
from gpt2_tf.assets import bundled_checkpoint
from gpt2_tf.sample import Request
from gpt2_tf.tf1_reference import Reference

from conftest import FIXTURES, FLOAT32, assert_close


def reference_log_probs(logits, tokens):
    """float64 log-softmax of the reference logits, gathered at the next tokens: [batch, T - 1]."""
    x = np.asarray(logits, np.float64)[:, :-1]
    lse = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    return np.take_along_axis(x, np.asarray(tokens)[:, 1:, None], -1)[..., 0] - lse


@pytest.fixture(scope='module')
def hot():
    folder = FIXTURES / 'tf1-tiny-hot'
    return gpt2_tf.load_model(folder), Reference(HParams.from_json(folder / 'hparams.json'), str(folder / 'model.ckpt'))


def test_score_equals_the_log_softmax_of_the_original_logits(fixture_dir):
    ref = np.load(fixture_dir / 'reference.npz')
    lp = gpt2_tf.score(gpt2_tf.load_model(fixture_dir), ref['tokens'])
    assert lp.dtype == np.float32 and lp.shape == (ref['tokens'].shape[0], ref['tokens'].shape[1] - 1)
    assert_close(lp, reference_log_probs(ref['logits'], ref['tokens']), 'log-probs')


@pytest.mark.parametrize('hparams', [
    HParams(n_vocab=97, n_ctx=16, n_embd=24, n_head=3, n_layer=2),
    HParams(n_vocab=301, n_ctx=40, n_embd=32, n_head=4, n_layer=3),
], ids=['97-vocab', '301-vocab'])
def test_score_and_top_match_tf1_on_random_checkpoints(random_checkpoint, hparams):
    folder = random_checkpoint(hparams, scale=0.3)
    model = gpt2_tf.load_model(folder)
    graph = Reference(hparams, str(folder / 'model.ckpt'))
    tokens = np.random.default_rng(3).integers(0, hparams.n_vocab, (3, hparams.n_ctx), dtype=np.int32)
    logits = graph(tokens)['logits']
    lp, ids, top_lp = gpt2_tf.score(model, tokens, top=5)
    want = reference_log_probs(logits, tokens)
    assert_close(lp, want, 'log-probs')
    ordered = np.argsort(-logits[:, :-1], axis=-1, kind='stable')[..., :5]
    np.testing.assert_array_equal(ids, ordered)  # random logits have no exact ties
    shifted = logits[:, :-1].astype(np.float64) - logits[:, :-1].max(-1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))  # the top log-probs are its values
    assert_close(top_lp, np.take_along_axis(log_softmax, ordered, -1), 'top log-probs')  # every column


def test_numpy_integers_are_taken_as_ints(hot):
    model, _ = hot
    lp, ids, top_lp = gpt2_tf.score(model, [[1, 2, 3]], top=np.int64(3))
    assert ids.shape == (1, 2, 3)
    np.testing.assert_array_equal(gpt2_tf.score(model, [[1, 2, 3]], top=np.int64(0)), lp)


def test_a_padded_batch_equals_rows_scored_alone(hot):
    model, _ = hot
    tokens = np.load(FIXTURES / 'tf1-tiny-hot' / 'reference.npz')['tokens']
    rows = [tokens[0, :5].tolist(), tokens[1, :33].tolist(), tokens[2].tolist()]
    together = gpt2_tf.score(model, rows)
    assert [len(r) for r in together] == [4, 32, 63]
    for row, lp in zip(rows, together):
        assert_close(lp, gpt2_tf.score(model, [row])[0], 'padded row')


def test_windows_score_every_position_once_with_enough_context():
    for n, n_ctx, stride in [(3000, 1024, 512), (100, 32, 1), (100, 32, 31), (33, 32, 31), (5, 32, 31)]:
        seen = []
        for start, end, first in scoring.windows(n, n_ctx, stride):
            assert end - start <= n_ctx and first - start >= min(first, n_ctx - stride)
            seen.extend(range(first, end))
        assert seen == list(range(1, n))


@pytest.mark.parametrize('stride, bos', [(63, False), (20, False), (1, True), (40, True)])
def test_perplexity_equals_the_windows_computed_from_the_tf1_graph(hot, stride, bos):
    model, graph = hot
    n_ctx = model.hparams.n_ctx
    ids = np.random.default_rng(5).integers(0, model.hparams.n_vocab, 3 * n_ctx, dtype=np.int32)
    bos_token = model.hparams.n_vocab - 1  # this vocabulary's stand-in for <|endoftext|>
    full = np.concatenate([[bos_token], ids]) if bos else ids
    # By hand: each window through the TF1 graph, its log-softmax at the positions it scores.
    expected = np.zeros(len(full) - 1)
    for start, end, first in scoring.windows(len(full), n_ctx, stride):
        window = full[start:end][None]
        lp = reference_log_probs(graph(window)['logits'], window)[0]
        expected[first - 1:end - 1] = lp[first - 1 - start:]
    lp = scoring.window_log_probs(model, ids, stride=stride, bos=bos, end_of_text=bos_token)
    assert_close(lp, expected, 'windowed log-probs')
    result = gpt2_tf.perplexity(model, ids, stride=stride, bos=bos, end_of_text=bos_token)
    assert result['tokens'] == len(full) - 1
    assert result['nll'] == pytest.approx(-expected.mean(), rel=1e-5)
    assert result['perplexity'] == pytest.approx(np.exp(-expected.mean()), rel=1e-5)


@pytest.mark.parametrize('stride, bos', [(63, False), (np.int64(20), False), (7, True)])  # 20: as read from an array
def test_perplexity_equals_a_plain_loop_over_windows(hot, stride, bos):
    # Written out here, not through scoring.windows: window k scores positions 1 + k * stride onwards
    # (stride of them) and sees the n_ctx tokens that end at its last one; a float64 log-softmax of
    # the model's full logits for each window.
    model, _ = hot
    n_ctx = model.hparams.n_ctx
    ids = np.random.default_rng(8).integers(0, model.hparams.n_vocab, 2 * n_ctx + 5, dtype=np.int32)
    bos_token = model.hparams.n_vocab - 1
    full = np.concatenate([[bos_token], ids]) if bos else ids
    expected = []
    for first in range(1, len(full), stride):
        end = min(first + stride, len(full))
        start = max(0, end - n_ctx)
        logits = model(full[None, start:end])['logits'].numpy()[0].astype(np.float64)
        top = logits.max(-1, keepdims=True)
        log_softmax = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        expected += [log_softmax[p - 1 - start, full[p]] for p in range(first, end)]
    expected = np.array(expected)
    lp = scoring.window_log_probs(model, ids, stride=stride, bos=bos, end_of_text=bos_token)
    assert_close(lp, expected, 'windowed log-probs', rel=FLOAT32)
    result = gpt2_tf.perplexity(model, ids, stride=stride, bos=bos, end_of_text=bos_token)
    assert result['tokens'] == len(full) - 1
    assert result['nll'] == pytest.approx(-expected.mean(), rel=1e-6)


def test_the_default_stride_is_half_a_window(hot):
    # n_ctx // 2 for any model (512 for GPT-2's 1024; this one's n_ctx is 64), the command line's default too
    model, _ = hot
    ids = np.random.default_rng(9).integers(0, model.hparams.n_vocab, 2 * model.hparams.n_ctx + 5, dtype=np.int32)
    assert gpt2_tf.perplexity(model, ids) == gpt2_tf.perplexity(model, ids, stride=model.hparams.n_ctx // 2)


def test_score_completion_refuses_text_and_too_many_tokens_saying_what_to_do():
    model = gpt2_tf.load_model('test')  # n_ctx 128
    refused = lambda message: pytest.raises(gpt2_tf.GPT2Error, match=message)  # noqa: E731
    with refused(r'^prompt_ids must be token ids, got text: encode it first \(gpt2_tf.encode\)$'):
        gpt2_tf.score_completion(model, 'The capital', gpt2_tf.encode(' Paris'))
    with refused(r"^the prompt and completion are 141 tokens, past n_ctx = 128: keep the prompt's last 88 tokens$"):
        gpt2_tf.score_completion(model, [1] * 101, [2] * 40)
    with refused(r'^completion_ids must be one sequence of token ids, got shape \[1, 2\]$'):
        gpt2_tf.score_completion(model, [1], [[2, 3]])


def test_score_completion_is_the_sum_over_the_completion(hot):
    model, _ = hot
    prompt, completion = [5, 6, 7, 8], [9, 10, 11]
    lp = gpt2_tf.score(model, [prompt + completion])[0]
    assert gpt2_tf.score_completion(model, prompt, completion) == pytest.approx(float(lp[3:].sum()), rel=1e-6)


def test_new_lengths_in_a_bucket_do_not_retrace(hot):
    model, _ = hot
    fn = compiled.shared(scoring._scored, model, 'xla')
    gpt2_tf.score(model, [[1, 2, 3, 4, 5]])
    before = fn.tracing_count
    for n in (3, 6, 7, 8):  # all bucket to 8
        gpt2_tf.score(model, [list(range(1, n + 1))])
    assert fn.tracing_count == before


@pytest.mark.parametrize('call, message', [
    (lambda m: gpt2_tf.score(m, [[5]]), 'row 0 has 1 token'),
    (lambda m: gpt2_tf.score(m, [[5, 300]]), r'row 0: token id 300 is outside the vocabulary \[0, 300\)'),
    (lambda m: gpt2_tf.score(m, [[5] * 65]), r'row 0 has 65 tokens, past n_ctx = 64: score a longer text in windows '
                                             r'with perplexity\(\) or window_log_probs\(\)'),
    (lambda m: gpt2_tf.score(m, [1, 2, 3]), r'tokens must be \[batch, T\]'),
    (lambda m: gpt2_tf.score(m, [[1, 2]], top=51), r'top must be an integer in \[0, 50\]'),
    (lambda m: gpt2_tf.perplexity(m, [7]), 'the text has 1 token'),
    (lambda m: gpt2_tf.perplexity(m, []), 'the text has 0 token'),
    (lambda m: gpt2_tf.perplexity(m, [], bos=True, end_of_text=3),
     r'the text has 0 token\(s\): scoring needs at least 1 with bos=True$'),
    (lambda m: gpt2_tf.perplexity(m, [1, 2, 3], stride=64), r'stride must be an integer in \[1, 63\]'),
    (lambda m: gpt2_tf.perplexity(m, [1, 2, 3], stride=0), r'stride must be an integer in \[1, 63\]'),
    (lambda m: gpt2_tf.perplexity(m, [1, 2, -3]), 'token id -3 is outside'),
    (lambda m: gpt2_tf.perplexity(m, [1, 2, 3], stride=2, batch_size=0), 'batch_size must be a positive integer'),
    (lambda m: gpt2_tf.perplexity(m, [1, 2, 3], stride=2, batch_size=-1), 'batch_size must be a positive integer'),
    (lambda m: gpt2_tf.perplexity(m, [1, 2, 3], bos=True, end_of_text=1.5), 'end_of_text must be a token id'),
    (lambda m: gpt2_tf.score(m, [np.array([[1, 2]]), [1, 2]]), r'row 0 must be one sequence .* shape \[1, 2\]'),
    (lambda m: gpt2_tf.score(m, [1, [1, 2]]), 'tokens must be one array of token ids'),
])
def test_bad_input_fails_before_any_compute(hot, monkeypatch, call, message):
    model, _ = hot
    monkeypatch.setattr(compiled.Shared, '__call__', lambda *a, **k: pytest.fail('computed before checking'))
    with pytest.raises(ValueError, match=message):
        call(model)


# --- the command line -----------------------------------------------------------------------------

def test_score_command_on_a_file_and_on_stdin(tmp_path):
    text = tmp_path / 'text.txt'
    # \r\n read as \n and a leading byte-order mark left out, as encode reads them
    text.write_bytes(b'\xef\xbb\xbf' + b'The quick brown fox jumps over the lazy dog.\r\n' * 10)
    cmd = [sys.executable, '-m', 'gpt2_tf.cli', 'score', str(text), '-', '--stride', '50', '--json']
    done = subprocess.run(cmd, input=b'\xef\xbb\xbfHello there,\r\nworld.', capture_output=True, cwd=tmp_path, timeout=300)
    done.stdout, done.stderr = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0, done.stderr
    reports = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r['file'] for r in reports] == [str(text), '-']
    model = gpt2_tf.load_model(bundled_checkpoint())
    ids = gpt2_tf.encode('The quick brown fox jumps over the lazy dog.\n' * 10)
    direct = gpt2_tf.perplexity(model, ids, stride=50)
    assert reports[0]['tokens'] == direct['tokens'] == len(ids) - 1
    assert reports[0]['nll'] == pytest.approx(direct['nll'], rel=1e-5)
    assert reports[0]['perplexity'] == pytest.approx(direct['perplexity'], rel=1e-5)
    pieces = reports[1]['token_pieces']
    assert ''.join(p['text'] for p in pieces) == 'Hello there,\nworld.'
    assert pieces[0]['log_prob'] is None and all(isinstance(p['log_prob'], float) for p in pieces[1:])
    plain = subprocess.run([sys.executable, '-m', 'gpt2_tf.cli', 'score', str(text)], capture_output=True,
                           text=True, cwd=tmp_path, timeout=300)
    assert plain.returncode == 0 and 'perplexity' in plain.stdout


@pytest.mark.parametrize('argv, message', [
    (['score', 'missing.txt'], 'missing.txt: no such file'),
    (['score', 'empty.txt'], 'empty.txt: the text has 0 token'),
    (['score', 'one.txt', '--stride', '128'], r'stride must be an integer in \[1, 127\]'),
    (['score', 'latin1.txt'], r'latin1.txt: not UTF-8 text \(invalid continuation byte at byte 3\); convert it'),
    (['score', '-'], r'-: not UTF-8 text \(invalid continuation byte at byte 3\); convert it'),  # stdin alike
])
def test_score_command_errors_are_one_line(tmp_path, argv, message):
    (tmp_path / 'empty.txt').write_text('')
    (tmp_path / 'one.txt').write_text('Hello world')
    latin1 = 'café au lait'.encode('latin-1')
    (tmp_path / 'latin1.txt').write_bytes(latin1)
    done = subprocess.run([sys.executable, '-m', 'gpt2_tf.cli', *argv], capture_output=True, input=latin1,
                          cwd=tmp_path, timeout=300)
    done.stderr = done.stderr.decode()
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if not line.startswith('gpt2-tf: no model')]
    assert len(lines) == 1 and re.search(message, lines[0]), done.stderr


@pytest.mark.parametrize('jit, known_rows', [(False, True), (False, False), (True, True)],
                         ids=['graph', 'rows-unknown-until-run', 'xla'])
def test_the_frozen_head_loss_in_parts_equals_the_one_op_loss(monkeypatch, jit, known_rows):
    # Training's loss when wte takes no gradient: 3 x 15 = 45 rows of logits in parts of at most 16 (three of
    # 15 when N is known, else 16, 16 and a padded 13). Against the original's one op over all the logits, the
    # loss times 3 and its gradients with respect to the blocks' output and ln_f's g and b.
    import tensorflow as tf
    monkeypatch.setattr(scoring, 'LOSS_ROWS', 16)
    model = gpt2_tf.load_model(FIXTURES / 'tf1-tiny')
    rng = np.random.default_rng(3)
    h = tf.constant(rng.normal(0, 1, (3, 15, model.hparams.n_embd)).astype(np.float32))
    labels = tf.constant(rng.integers(0, model.hparams.n_vocab, (3, 15)).astype(np.int32))
    norm = [model.ln_f.g, model.ln_f.b]

    def both(h, labels):
        out = []
        for loss_of in (lambda: scoring.frozen_head_loss(model, h, labels),
                        lambda: tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                            labels=labels, logits=model.logits(h)))):
            with tf.GradientTape() as tape:
                tape.watch(h)
                loss = 3 * loss_of()
            out.append([loss] + tape.gradient(loss, [h] + norm))
        return out

    shape = [None if not known_rows else 3, None if not known_rows else 15]
    run = tf.function(both, jit_compile=jit, input_signature=[tf.TensorSpec(shape + [h.shape[-1]]),
                                                                tf.TensorSpec(shape, tf.int32)])
    ours, theirs = run(h, labels)
    for name, a, b in zip(['loss', 'h', 'ln_f/g', 'ln_f/b'], ours, theirs):
        # float32 sums in another order: 1e-6 of the largest value
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-6 * max(1.0, np.abs(b.numpy()).max()),
                                   err_msg=name)
    assert np.abs(theirs[1].numpy()).max() > 1e-3  # a real gradient to compare


def test_bad_input_raises_the_projects_error_which_the_package_exports():
    model = gpt2_tf.load_model('test')
    for call in (lambda: gpt2_tf.score(model, [[1]]), lambda: gpt2_tf.score(model, []),
                 lambda: gpt2_tf.score(model, [[1, 2]], mode='fast'), lambda: gpt2_tf.perplexity(model, [[1, 2]]),
                 lambda: gpt2_tf.score_completion(model, [], [1]), lambda: gpt2_tf.load_model('test', dtype='int4')):
        with pytest.raises(gpt2_tf.GPT2Error):  # a plain ValueError before
            call()


def test_more_top_tokens_than_the_vocabulary_holds_is_one_line(random_checkpoint):
    model = gpt2_tf.load_model(random_checkpoint(HParams(n_vocab=12, n_ctx=16, n_embd=8, n_head=2, n_layer=1)))
    with pytest.raises(gpt2_tf.GPT2Error, match=r'top must be an integer in \[0, 12\], got 20 \(the vocabulary '
                                                r'has 12 tokens\)'):
        gpt2_tf.score(model, [[1, 2, 3]], top=20)
    with pytest.raises(gpt2_tf.GPT2Error, match=r'logprobs must be an integer in \[0, 12\], got 13'):
        Request(model, 2, [[1, 2]], None, None, 1, 0, 1, None, None, None, logprobs=13)
    assert gpt2_tf.score(model, [[1, 2, 3]], top=12)[1].shape == (1, 2, 12)
