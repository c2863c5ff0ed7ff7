"""Generation and forward-pass speed: gpt2_tf against the TF1 reference graph, in one run.

    python bench/bench_generate.py [--reps 5] [--modes function,xla]

Uses a 124M-shaped original-format checkpoint with random values (written once
into bench/.cache/). Prints ms per call, tokens/s and ours/TF1 time ratios; the
first call of each (trace and compile) is timed separately.
"""

import argparse
import os
import pathlib
import statistics
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import gpt2_tf  # noqa: E402
from gpt2_tf import HParams  # noqa: E402
from gpt2_tf.sample import sample_sequence  # noqa: E402
from gpt2_tf.tf1_reference import Reference, write_random_checkpoint  # noqa: E402

CACHE = pathlib.Path(__file__).parent / '.cache' / '124M-random'


def checkpoint() -> pathlib.Path:
    if not (CACHE / 'checkpoint').exists():
        print(f'writing a 124M-shaped random checkpoint to {CACHE} ...', flush=True)
        write_random_checkpoint(CACHE, HParams.named('124M'), seed=0, scale=0.02, meta_graph=False)
    return CACHE


def timed(fn, reps):
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def memory_bandwidth(megabytes: int = 512) -> float:
    """GB/s of a large array copy (bytes read + bytes written), best of five."""
    src = np.ones(megabytes * 2**20 // 4, np.float32)
    dst = np.empty_like(src)
    best = min(timed(lambda: np.copyto(dst, src), 4))
    return 2 * src.nbytes / best / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--reps', type=int, default=5)
    parser.add_argument('--modes', default='function,xla', help='our decode loop modes to time')
    parser.add_argument('--prompt', type=int, default=16)
    parser.add_argument('--new', type=int, default=64)
    args = parser.parse_args()

    folder = checkpoint()
    hparams = HParams.named('124M')
    model = gpt2_tf.load_model(folder)
    model_xla = gpt2_tf.load_model(folder, jit_compile=True)
    reference = Reference(hparams, str(folder / 'model.ckpt'))
    rng = np.random.default_rng(0)
    print(f'TensorFlow {tf.__version__}, {os.cpu_count()} CPUs, devices: '
          f'{[d.name for d in tf.config.list_logical_devices()]}')
    bandwidth = memory_bandwidth()
    weights = sum(v.shape.num_elements() for v in model.variables) * 4
    print(f'memory bandwidth (numpy copy): {bandwidth:.1f} GB/s; reading the {weights / 1e6:.0f} MB of weights '
          f'once per token bounds batch-1 decoding at {bandwidth * 1e9 / weights:.1f} tokens/s')
    print(f'{"case":<34}{"first call s":>13}{"ms/call":>10}{"tokens/s":>10}{"ours/TF1":>10}')

    for batch in (1, 8):
        prompt = rng.integers(0, hparams.n_vocab, size=(batch, args.prompt), dtype=np.int32)
        sampler = reference.sampler(length=args.new, batch_size=batch, top_k=1)
        tf1_first, tf1 = timed(lambda: sampler(prompt), args.reps)
        expected = sampler(prompt)
        new_tokens = batch * args.new
        print(f'{f"greedy {args.new} new, B={batch}: TF1":<34}{tf1_first:>13.2f}{tf1 * 1e3:>10.1f}'
              f'{new_tokens / tf1:>10.1f}{"":>10}')
        for mode in args.modes.split(','):
            run = lambda: sample_sequence(model, args.new, context=prompt, top_k=1, mode=mode)  # noqa: E731
            first, ours = timed(run, args.reps)
            same = 'same tokens' if np.array_equal(run(), expected) else 'TOKENS DIFFER'
            print(f'{f"greedy {args.new} new, B={batch}: ours {mode}":<34}{first:>13.2f}{ours * 1e3:>10.1f}'
                  f'{new_tokens / ours:>10.1f}{ours / tf1:>10.2f}  {same}')

    for batch, length in ((1, 1024), (8, 128)):
        tokens = rng.integers(0, hparams.n_vocab, size=(batch, length), dtype=np.int32)
        tf1_first, tf1 = timed(lambda: reference(tokens), args.reps)
        n = batch * length
        print(f'{f"forward B={batch} T={length}: TF1":<34}{tf1_first:>13.2f}{tf1 * 1e3:>10.1f}{n / tf1:>10.1f}')
        for name, ours_model in (('ours', model), ('ours jit_compile', model_xla)):
            first, ours = timed(lambda: ours_model(tokens)['logits'].numpy(), args.reps)
            print(f'{f"forward B={batch} T={length}: {name}":<34}{first:>13.2f}{ours * 1e3:>10.1f}'
                  f'{n / ours:>10.1f}{ours / tf1:>10.2f}')


if __name__ == '__main__':
    main()
