"""One decode step's choice of tokens (sample.choose) on the full vocabulary, under XLA, per filter.

    python bench/bench_choose.py [--batch 1,8] [--calls 200]

Times choose alone on random logits [batch, 50257] (normal, scale 2), with the plan the decode loop makes
(sample.plan_for): the filters and the draw among tf.math.top_k's candidates where every drawing row has a
top_k, else over the full row. With the CPU named.
"""

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).parent))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from gpt2_tf import sample  # noqa: E402
from gpt2_tf.noise import row_keys  # noqa: E402
from bench_generate import cpu  # noqa: E402

VOCAB = 50257
CASES = [('no filter', 0, 1.0), ('top_k=40', 40, 1.0), ('top_k=40 top_p=0.9', 40, 0.9), ('top_p=0.9', 0, 0.9)]


def timed(batch: int, top_k: int, top_p: float, calls: int) -> float:
    """ms a call of choose, as the decode loop plans it."""
    logits = tf.constant(np.random.default_rng(0).standard_normal((batch, VOCAB)).astype(np.float32) * 2)
    options = [tf.fill([batch], np.float32(1.0)), tf.fill([batch], np.int32(top_k)),
               tf.fill([batch], np.float32(top_p)), tf.constant(row_keys(1, batch))]
    plan = sample.plan_for(np.array([1.0]), np.array([top_k]), VOCAB, chunk=1)
    choose = tf.function(lambda x, step: sample.choose(x, *options, step, kmax=plan.kmax, among_top=plan.among_top),
                         jit_compile=True)
    choose(logits, tf.constant(0, tf.int64)).numpy()
    start = time.perf_counter()
    for i in range(calls):
        choose(logits, tf.constant(i, tf.int64)).numpy()
    return (time.perf_counter() - start) / calls * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--batch', default='1,8')
    parser.add_argument('--calls', type=int, default=200)
    args = parser.parse_args()
    print(f'CPU: {cpu()}')
    batches = [int(b) for b in args.batch.split(',')]
    print(f'{"case":<26}' + ''.join(f'{f"B{b} ms":>10}' for b in batches))
    for name, top_k, top_p in CASES:
        row = [timed(b, top_k, top_p, args.calls) for b in batches]
        print(f'{name:<26}' + ''.join(f'{ms:>10.3f}' for ms in row), flush=True)


if __name__ == '__main__':
    main()
