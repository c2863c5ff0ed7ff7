"""One model used from two threads at once: an eager call while a compiled one traces and runs."""

import threading

import numpy as np

import gpt2_tf
from gpt2_tf.sample import sample_sequence

from conftest import FIXTURES


def test_eager_scoring_while_compiled_sampling_traces():
    model = gpt2_tf.load_model(FIXTURES / 'tf1-tiny-hot')
    tokens = np.load(FIXTURES / 'tf1-tiny-hot' / 'reference.npz')['tokens'][:, :40]
    expected_lp = gpt2_tf.score(model, tokens, mode='eager')
    sampling = dict(context=[5, 6, 7], batch_size=2, top_k=20, seed=4, mode='function')
    expected_ids = sample_sequence(model, 24, **sampling)
    problems, sampled = [], threading.Event()

    def sample():
        try:  # each chunk size is a new static argument: a new trace on this model, each time
            for chunk in (1, 2, 3, 5, 6, 7):
                ids = sample_sequence(model, 24, chunk=chunk, **sampling)
                if not np.array_equal(ids, expected_ids):
                    problems.append(f'chunk {chunk}: other tokens')
        except Exception as e:  # noqa: BLE001 -- reported below, with the thread that raised it
            problems.append(f'sampling: {type(e).__name__}: {e}')
        finally:
            sampled.set()

    thread = threading.Thread(target=sample)
    thread.start()
    scored = 0
    try:
        while not sampled.is_set() or scored < 3:
            lp = gpt2_tf.score(model, tokens, mode='eager')
            scored += 1
            if not np.array_equal(lp, expected_lp):
                problems.append(f'eager score {scored}: other log-probs')
                break
    except Exception as e:  # noqa: BLE001
        problems.append(f'eager score {scored}: {type(e).__name__}: {str(e).splitlines()[0]}')
    thread.join()
    assert not problems, problems
    assert all(v.__class__.__name__.endswith('Variable') for v in model.variables)  # the model is as it was
