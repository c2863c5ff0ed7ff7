"""The decode loop's key/value cache under XLA: writing it alone, and writing then attending over it (XLA's
attention, and the kernel's).

    python bench/bench_cache_write.py [--batch 8] [--size 128] [--reps 5]

A loop of 48 steps over 12 layers' caches [batch, 2, 12, size, 64] (124M's shapes), compiled
with XLA as the decode loop is: 'write' only writes each step's keys and values (the caches
are read after the loop, so XLA keeps the writes), 'both' writes and then attends over what
was written with the model's attention (its own Cache and the model's attention_weights; the
query changes each step, so nothing is hoisted), 'kernel' the same by Cache.attend as a decode
step takes it (the kernel, where it is built). The caches come in as arguments (XLA would
see through caches of zeros). Each step of 'both' reads all 12 caches whole, 2 * 12 * batch
* size * 768 * 4 bytes (47 MB at batch 8 and 80 slots); the rate is those bytes over its time.
'kernel' reads only the slots written so far (from 17 to 64 of them here).
"""

import argparse
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
sys.path.insert(0, str(pathlib.Path(__file__).parent))

import tensorflow as tf  # noqa: E402

from gpt2_tf import precision  # noqa: E402
from gpt2_tf.decoding import Cache, cache_mask, row_slots  # noqa: E402
from gpt2_tf.model import attention_weights  # noqa: E402
from bench_generate import cpu  # noqa: E402

LAYERS, HEADS, FEATURES, START, STEPS = 12, 12, 64, 16, 64


def loop(case: str, batch: int, size: int):
    query = tf.random.normal([batch, HEADS, 1, FEATURES])

    def step(i, caches, acc):
        slots = row_slots(i, batch, 1)
        mask = cache_mask(tf.zeros([batch], tf.int32), slots, size)
        written = []
        for cache in caches:
            q = query * (1 + acc)  # a new query each step, so that nothing is hoisted out of the loop
            if case == 'kernel':
                with precision.decoding():
                    out, cache = Cache(cache, slots, mask).attend(q, q, -q)
            else:
                k, v, _, cache = Cache(cache, slots, mask)(q, -q)
                out = q if case == 'write' else tf.matmul(attention_weights(q, k, mask), v)
            written.append(cache)
            acc = acc + tf.reduce_mean(out) * 1e-6
        return i + 1, written, acc

    @tf.function(jit_compile=True)
    def run(caches):  # arguments, not constants: XLA would see through caches of zeros that are never written
        _, caches, acc = tf.while_loop(lambda i, c, a: i < STEPS, step, (START, caches, 0.0))
        return acc + tf.add_n([tf.reduce_sum(c[:1, :1, :1]) for c in caches])  # the caches stay live

    caches = [tf.random.normal([batch, 2, HEADS, size, FEATURES]) for _ in range(LAYERS)]
    return lambda: run(caches)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--batch', type=int, default=8)
    parser.add_argument('--size', type=int, default=128)
    parser.add_argument('--reps', type=int, default=5)
    args = parser.parse_args()
    print(f'CPU: {cpu()}')
    read = 2 * LAYERS * args.batch * args.size * HEADS * FEATURES * 4
    for case in ('write', 'both', 'kernel'):
        run = loop(case, args.batch, args.size)
        run()
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            run().numpy()
            times.append(time.perf_counter() - start)
        per_step = statistics.median(times) / (STEPS - START)
        rate = f', {read / 1e6:.0f} MB read a step at {read / per_step / 1e9:.1f} GB/s' if case == 'both' else ''
        print(f'batch {args.batch}, cache size {args.size}, {case}: {per_step * 1e3:.2f} ms a step{rate}', flush=True)


if __name__ == '__main__':
    main()
