"""Scoring speed: perplexity of a 10,000-token text, gpt2_tf against the TF1 graph doing the same windows.

    python bench/bench_score.py [--tokens 10000] [--stride 512] [--batch 4] [--reps 3]

A 124M-shaped original-format checkpoint with random values (bench/.cache/).
The TF1 side runs each batch of windows through the original graph with a
log-softmax gathered at the next tokens (what users wrote on top of it), and
keeps the positions each window scores; ours computes logits only there, under
XLA (the default) and in a plain tf.function (mode='function').
"""

import argparse
import os
import pathlib
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
sys.path.insert(0, str(pathlib.Path(__file__).parent))

import numpy as np  # noqa: E402

from gpt2_tf import scoring  # noqa: E402
from bench_generate import cpu, sides, timed  # noqa: E402


def tf1_window_log_probs(reference, ids, n_ctx, stride, batch):
    out = np.zeros(len(ids) - 1, np.float32)
    spans = scoring.windows(len(ids), n_ctx, stride)
    for at in range(0, len(spans), batch):
        group = spans[at:at + batch]
        length = max(end - start for start, end, _ in group)
        if any(end - start != length for start, end, _ in group):  # the short first windows go one by one
            for start, end, first in group:
                lp = reference.log_probs(ids[start:end][None])[0]
                out[first - 1:end - 1] = lp[first - 1 - start:]
            continue
        lp = reference.log_probs(np.stack([ids[start:end] for start, end, _ in group]))
        for i, (start, end, first) in enumerate(group):
            out[first - 1:end - 1] = lp[i, first - 1 - start:]
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--tokens', type=int, default=10_000)
    parser.add_argument('--stride', type=int, default=512)
    parser.add_argument('--batch', type=int, default=4, help='windows per call, both sides')
    parser.add_argument('--reps', type=int, default=3)
    args = parser.parse_args()
    _, hparams, model, reference = sides()
    ids = np.random.default_rng(0).integers(0, hparams.n_vocab, args.tokens, dtype=np.int32)
    print(f'CPU: {cpu()}')
    print(f'{args.tokens:,} tokens, stride {args.stride}, {args.batch} windows per call, '
          f'{len(scoring.windows(len(ids), hparams.n_ctx, args.stride))} windows')

    results = {'TF1': [], 'xla': [], 'function': []}  # every call's output; the last is compared
    tf1_first, tf1 = timed(lambda: results['TF1'].append(
        tf1_window_log_probs(reference, ids, hparams.n_ctx, args.stride, args.batch)), args.reps)
    print(f'{"TF1":<16} first {tf1_first:7.2f} s   {tf1:7.2f} s   {(len(ids) - 1) / tf1:8.1f} tokens/s')
    for mode in ('xla', 'function'):
        first, seconds = timed(lambda: results[mode].append(
            scoring.window_log_probs(model, ids, stride=args.stride, batch_size=args.batch, mode=mode)), args.reps)
        diff = float(np.abs(results[mode][-1] - results['TF1'][-1]).max())
        print(f'{"ours (" + mode + ")":<16} first {first:7.2f} s   {seconds:7.2f} s   '
              f'{(len(ids) - 1) / seconds:8.1f} tokens/s   / TF1 time {seconds / tf1:.2f}, '
              f'max |log-prob diff| {diff:.2g}', flush=True)


if __name__ == '__main__':
    main()
