"""Encode throughput of the two BPE paths on a few MB of mixed text.

    python bench/bench_encoder.py [--mb 3]

The pure-Python path (the original algorithm) starts with an empty merge
cache, as in a fresh process; tiktoken is built locally from the same files.
"""

import argparse
import json
import pathlib
import time

import numpy as np

from gpt2_tf.assets import bundled_vocabulary
from gpt2_tf.encoder import Encoder, _read_files

CASES = pathlib.Path(__file__).parent.parent / 'tests' / 'fixtures' / 'bpe-cases.jsonl'


def corpus(megabytes: float, encoder: dict) -> str:
    """English-like words from the vocabulary, numbers, code, whitespace runs and the non-Latin test cases."""
    rng = np.random.default_rng(0)
    words = [w.lstrip('Ġ') for w in encoder if w.isascii() and w.lstrip('Ġ').isalpha()]
    cases = [json.loads(line)['text'] for line in CASES.read_text(encoding='utf-8').split('\n') if line]
    parts, size = [], 0
    while size < megabytes * 1e6:
        kind = rng.random()
        if kind < 0.7:
            part = ' '.join(rng.choice(words, 40)) + '. '
        elif kind < 0.8:
            part = f'{rng.integers(0, 10**9)} {rng.random():.6f}, '
        else:
            part = cases[rng.integers(len(cases))] + '\n'
        parts.append(part)
        size += len(part.encode('utf-8'))
    return ''.join(parts)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--mb', type=float, default=3.0)
    args = parser.parse_args()
    encoder, merges = _read_files(*bundled_vocabulary())
    text = corpus(args.mb, encoder)
    size = len(text.encode('utf-8')) / 1e6
    print(f'{size:.2f} MB of mixed text')
    results = {}
    for fast in (False, True):
        enc = Encoder(encoder, merges, fast=fast)
        start = time.perf_counter()
        ids = enc.encode(text)
        seconds = time.perf_counter() - start
        results[enc.backend] = ids
        print(f'{enc.backend:>9}: {seconds:7.2f} s  {size / seconds:7.2f} MB/s  {len(ids):,} tokens')
    print('same ids:', results['python'] == results['tiktoken'])


if __name__ == '__main__':
    main()
