"""Traces across repeated calls of the documented functions: each compiled function traces once per
option set, a new batch size reuses its trace, and TensorFlow never warns of retracing."""

import json
import subprocess
import sys

from conftest import FIXTURES

BUNDLED = FIXTURES.parent.parent / 'gpt2_tf' / 'assets' / 'test-checkpoint'

# The README's calls, three times over, each round at another batch size, in a fresh process (TensorFlow's
# retracing warning is counted per process, and warns at most twice).
README = '''
import json, sys
import numpy as np
import gpt2_tf
from gpt2_tf import compiled

model = gpt2_tf.load_model(sys.argv[1])
rounds = []
for batch in (4, 2, 3):
    ids = gpt2_tf.encode("Hello, I'm a language model,")
    tokens = np.array([ids] * batch, np.int32)
    out = model(tokens)
    out = model(tokens[:, :3], past=out['present'])
    tokens = gpt2_tf.sample_sequence(model, 40, context=ids, batch_size=batch, top_k=40, seed=1)
    texts = gpt2_tf.generate(model, "Hello, I'm a language model,", 40, nsamples=batch, top_p=0.9)
    lp = gpt2_tf.score(model, tokens)
    lp, top_ids, top_lp = gpt2_tf.score(model, tokens, top=5)
    r = gpt2_tf.perplexity(model, np.concatenate([tokens[0]] * batch), stride=32)
    counts = {'model': model.tracing_count}
    for shared in compiled._functions.values():
        counts[shared.fn.__name__] = counts.get(shared.fn.__name__, 0) + shared.tracing_count
    rounds.append(counts)
print(json.dumps(rounds))
'''


def test_the_readme_calls_trace_once_per_option_set():
    run = subprocess.run([sys.executable, '-c', README, str(BUNDLED)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert 'retracing' not in run.stderr, run.stderr[-2000:]
    rounds = json.loads(run.stdout.splitlines()[-1])
    # model(tokens) and model(tokens, past): one each. The sampling loop's start: once for both calls;
    # its step: once per option set (top_k=40; top_p=0.9). Scoring: one per padded length and top.
    first = rounds[0]
    assert first['model'] == 2 and first['_scored'] == 3, first
    assert sorted(n for name, n in first.items() if name not in ('model', '_scored')) == [1, 2], first
    assert rounds[1] == rounds[2] == rounds[0], rounds  # other batch sizes, the same traces
