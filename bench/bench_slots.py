"""In-flight slots: what one chunk costs per token at each chunk size, and what the first call of a shape costs.

    python bench/bench_slots.py [--slots 8] [--chunks 1,2,4,8,16] [--reps 5]

Uses the 124M-shaped random checkpoint of bench_generate.py. Every slot is
occupied (16-token prompts, temperature 0.8); the chunk sizes alternate
within each round, so a shared machine's load falls on all of them alike.
Prints the CPU, the first call of each chunk size (trace and compile), and
the median ms per chunk and per token.
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402

import gpt2_tf  # noqa: E402
from bench_generate import checkpoint, cpu  # noqa: E402
from gpt2_tf.slots import Slots  # noqa: E402


def filled(model, slots: int, chunk: int) -> Slots:
    engine = Slots(model, slots, chunk=chunk)
    rng = np.random.default_rng(0)
    for slot in range(slots):
        engine.join(slot, rng.integers(0, 50257, 16).tolist(), length=400, key=(slot, 1), temperature=0.8)
    return engine


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--slots', type=int, default=8)
    parser.add_argument('--chunks', default='1,2,4,8,16')
    parser.add_argument('--reps', type=int, default=5)
    args = parser.parse_args()
    chunks = [int(c) for c in args.chunks.split(',')]
    model = gpt2_tf.load_model(checkpoint())
    print(f'# {cpu()}; {args.slots} slots, 124M-shaped', flush=True)
    engines, first = {}, {}
    for chunk in chunks:
        engines[chunk] = filled(model, args.slots, chunk)
        start = time.perf_counter()
        engines[chunk].step()
        first[chunk] = time.perf_counter() - start
    times = {chunk: [] for chunk in chunks}
    for _ in range(args.reps):
        for chunk in chunks:
            start = time.perf_counter()
            engines[chunk].step()
            times[chunk].append(time.perf_counter() - start)
    print(f'{"chunk":>6}{"first call s":>14}{"ms/chunk":>10}{"ms/token step":>15}{"tokens/s":>10}')
    for chunk in chunks:
        seconds = statistics.median(times[chunk])
        print(f'{chunk:>6}{first[chunk]:>14.1f}{seconds * 1e3:>10.1f}{seconds / chunk * 1e3:>15.1f}'
              f'{args.slots * chunk / seconds:>10.1f}', flush=True)


if __name__ == '__main__':
    main()
