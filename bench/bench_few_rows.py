"""Whole greedy calls with the float32 kernel's table for this CPU (kernels.FEW_ROWS) against XLA's dots alone.

    python bench/bench_few_rows.py [--batches 2,4,8] [--rounds 3] [--reps 3] [--sides table,logits,xla]

Each round runs a process per side in turn: 'table' decodes as shipped (the products that kernels.few_rows
names for this CPU take the kernel), 'logits' with the block products' rows emptied (only the tied logits
take the kernel), 'xla' with the table emptied (every float32 product is XLA's dot). Each prints, per batch,
the median of --reps greedy calls after a first (the 124M-shaped checkpoint, a 16-token prompt, 64 new
tokens); the round's last line gives each side's time over xla's.
"""

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
sys.path.insert(0, str(pathlib.Path(__file__).parent))

SIDES = ('table', 'logits', 'xla')


def worker(side: str, batches: list, reps: int) -> None:
    import numpy as np

    import gpt2_tf
    from gpt2_tf import kernels
    from bench_generate import checkpoint

    if side != 'table':  # the block products' rows (layout False) emptied; for xla, the logits' too
        kernels.FEW_ROWS = {cpu: {False: range(0), True: rows[True] if side == 'logits' else range(0)}
                            for cpu, rows in kernels.FEW_ROWS.items()}
    model = gpt2_tf.load_model(checkpoint())
    for batch in batches:
        prompt = np.random.default_rng(batch).integers(0, 50257, (batch, 16)).astype(np.int32)
        call = lambda: gpt2_tf.sample_sequence(model, 64, context=prompt, top_k=1)  # noqa: E731
        call()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        print(f'{batch} {statistics.median(times)}', flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--batches', default='2,4,8')
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--reps', type=int, default=3)
    parser.add_argument('--sides', default=','.join(SIDES))
    parser.add_argument('--side', choices=SIDES, help=argparse.SUPPRESS)  # a worker process
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(',')]
    if args.side:
        return worker(args.side, batches, args.reps)
    sides = args.sides.split(',')
    if 'xla' not in sides or not set(sides) <= set(SIDES):
        parser.error(f'--sides {args.sides}: give xla and any of {", ".join(SIDES[:-1])}, comma-separated')
    from bench_generate import cpu
    print(f'CPU: {cpu()}')
    for round_ in range(1, args.rounds + 1):
        ms = {}
        for side in sides:
            out = subprocess.run([sys.executable, __file__, '--side', side, '--batches', args.batches,
                                  '--reps', str(args.reps)], capture_output=True, text=True, check=True).stdout
            ms[side] = {int(b): float(s) * 1e3 for b, s in (line.split() for line in out.splitlines() if line)}
            print(f'round {round_} {side:<5} ' + ' '.join(f'B{b} {t:.0f} ms' for b, t in ms[side].items()), flush=True)
        for side in set(ms) - {'xla'}:
            print(f'round {round_} {side} / xla: ' + ' '.join(f'B{b} {ms[side][b] / ms["xla"][b]:.2f}x'
                                                             for b in batches), flush=True)


if __name__ == '__main__':
    main()
