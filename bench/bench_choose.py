"""One decode step's choice of tokens (sample.choose) on the full vocabulary, under XLA, per top_k.

    python bench/bench_choose.py [--batch 8] [--top_k 40,64] [--calls 200]

Times choose alone on random logits [batch, 50257], drawing among tf.math.top_k's candidates (what the
decode loop does when every row has a top_k) and over the full row, with the CPU named.
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--batch', type=int, default=8)
    parser.add_argument('--top_k', default='40,64')
    parser.add_argument('--calls', type=int, default=200)
    args = parser.parse_args()
    print(f'CPU: {cpu()}')
    logits = tf.constant(np.random.default_rng(0).standard_normal((args.batch, VOCAB)).astype(np.float32) * 2)
    print(f'{"top_k":>6} {"kmax":>6} {"among top ms":>13} {"full row ms":>12}')
    for top_k in map(int, args.top_k.split(',')):
        options = [tf.fill([args.batch], np.float32(1.0)), tf.fill([args.batch], np.int32(top_k)),
                   tf.fill([args.batch], np.float32(1.0)), tf.constant(row_keys(1, args.batch))]
        kmax = sample.top_k_size(np.array([top_k]), VOCAB)
        times = []
        for among_top in (True, False):
            choose = tf.function(lambda l, step, flag=among_top: sample.choose(l, *options, step, kmax=kmax,
                                                                               among_top=flag), jit_compile=True)
            choose(logits, tf.constant(0, tf.int64)).numpy()
            start = time.perf_counter()
            for i in range(args.calls):
                choose(logits, tf.constant(i, tf.int64)).numpy()
            times.append((time.perf_counter() - start) / args.calls * 1000)
        print(f'{top_k:>6} {kmax:>6} {times[0]:>13.3f} {times[1]:>12.3f}')


if __name__ == '__main__':
    main()
