"""Fine-tuning speed and memory: gpt2_tf's Trainer against the TF1 reference training step, in one run.

    python bench/bench_train.py [--steps 3] [--batch 1] [--length 1024] [--bounds]

Each case runs in a fresh process on the 124M-shaped random checkpoint
(bench/.cache/): load, one step (tracing and compilation), then --steps timed
steps. Memory is read from /proc: the process's peak RSS over its whole run,
RSS just before the first step, and the peak during that step (sampled every
2 ms); activation memory is the last minus the one before. --bounds also
measures what bounds the step: the matrix products' floor at this machine's
matrix-product rate, and one layer's attention forward and backward.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import threading
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
sys.path.insert(0, str(pathlib.Path(__file__).parent))

CASES = {
    'tf1': 'TF1 graph, tf.compat.v1 Adam',
    'ours': 'Trainer, Adam',
    'ours-xla': 'Trainer, Adam, jit_compile=True',
    'ours-recompute': 'Trainer, Adam, recompute=True',
    'ours-unchecked': 'Trainer, Adam, no finite check',
}


def rss_mb() -> float:
    with open('/proc/self/status') as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith('VmRSS'))


def peak_mb() -> float:
    with open('/proc/self/status') as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith('VmHWM'))


class PeakDuring:
    """The highest RSS seen while the block runs, sampled every 2 ms."""

    def __enter__(self):
        self.peak, self.running = rss_mb(), True
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _watch(self):
        while self.running:
            self.peak = max(self.peak, rss_mb())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()


def child(case: str, steps: int, batch: int, length: int) -> dict:
    import numpy as np

    from bench_generate import checkpoint
    folder = checkpoint()
    tokens = np.random.default_rng(0).integers(0, 50257, (batch, length)).astype(np.int32)
    if case == 'tf1':
        from gpt2_tf import HParams
        from gpt2_tf.tf1_reference import ReferenceTrainer

        trainer = ReferenceTrainer(HParams.named('124M'), str(folder / 'model.ckpt'), learning_rate=1e-4)
    else:
        import gpt2_tf
        from gpt2_tf.train import Trainer

        if case == 'ours-unchecked':  # every update applied, as before the step checked its loss and gradients
            Trainer._apply_if_finite = lambda self, loss, grads, lr: [self._apply(grads, lr), True][1]
        trainer = Trainer(gpt2_tf.load_model(folder), 1e-4, recompute=case == 'ours-recompute',
                          jit_compile=case == 'ours-xla')
    before = rss_mb()
    start = time.perf_counter()
    with PeakDuring() as during:
        trainer.step(tokens)
    first = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.step(tokens)
        times.append(time.perf_counter() - start)
    return {'first': first, 'step': statistics.median(times), 'before_mb': before, 'during_mb': during.peak,
            'peak_mb': peak_mb()}


def bounds(batch: int, length: int):
    """The step's matrix-product floor, and the attention's share of the step."""
    import numpy as np

    from gpt2_tf import HParams  # before TensorFlow: gpt2_tf's oneDNN default applies
    import tensorflow as tf
    from bench_generate import timed

    from gpt2_tf.model import Past

    hp = HParams.named('124M')
    rows = batch * length
    rates = []
    for k, n in ((hp.n_embd, 3 * hp.n_embd), (hp.n_embd, 4 * hp.n_embd), (4 * hp.n_embd, hp.n_embd)):
        a, b = tf.random.normal([rows, k]), tf.random.normal([k, n])
        product = tf.function(tf.matmul)
        rates.append(2 * rows * k * n / timed(lambda: np.asarray(product(a, b)), 5)[1])  # a view: no copy
    rate = statistics.median(rates)
    per_token = 2 * (12 * hp.n_layer * hp.n_embd ** 2 + hp.n_vocab * hp.n_embd)  # the blocks' weights, the logits
    attention = 4 * hp.n_layer * length * length * hp.n_embd  # q.k and w.v over every pair, masked ones too
    flops = 3 * (rows * per_token + batch * attention)  # forward, and twice that backward
    print(f'matrix products: {rate / 1e9:.0f} GFLOP/s (TF, {rows} rows); the step\'s {flops / 1e12:.2f} TFLOP '
          f'take at least {flops / rate:.2f} s at that rate')
    shape = [batch, hp.n_head, length, hp.head_size]
    q, k, v = (tf.random.normal(shape) for _ in range(3))

    @tf.function
    def both(q, k, v):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = Past().attend(q, k, v)[0]  # the model's own attention over a whole sequence
        return tape.gradient(out, [q, k, v], output_gradients=tf.ones_like(out))

    seconds = timed(lambda: [g.numpy() for g in both(q, k, v)], 5)[1]
    print(f'one layer\'s attention, forward and backward: {seconds * 1e3:.1f} ms '
          f'({hp.n_layer * seconds:.2f} s for {hp.n_layer} layers)', flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--steps', type=int, default=3)
    parser.add_argument('--batch', type=int, default=1)
    parser.add_argument('--length', type=int, default=1024)
    parser.add_argument('--cases', default=','.join(CASES))
    parser.add_argument('--bounds', action='store_true', help="also measure what bounds the step")
    parser.add_argument('--child', default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.batch, args.length)))
        return
    from bench_generate import checkpoint, cpu
    checkpoint()  # written once, outside the timed processes
    print(f'CPU: {cpu()}')
    print(f'batch {args.batch}, T = {args.length}, median of {args.steps} steps after the first; one process per case')
    print(f'{"case":<36}{"first s":>9}{"step s":>8}{"/TF1":>7}{"peak MB":>9}{"before":>8}{"during":>8}'
          f'{"activ.":>8}')
    results = {}
    for case in args.cases.split(','):
        done = subprocess.run([sys.executable, __file__, '--child', case, '--steps', str(args.steps),
                               '--batch', str(args.batch), '--length', str(args.length)],
                              capture_output=True, text=True)
        if done.returncode:
            print(f'{CASES[case]:<36} failed: {done.stderr.strip().splitlines()[-1]}')
            continue
        r = results[case] = json.loads(done.stdout.strip().splitlines()[-1])
        ratio = r['step'] / results['tf1']['step'] if 'tf1' in results else float('nan')
        print(f'{CASES[case]:<36}{r["first"]:>9.2f}{r["step"]:>8.2f}{ratio:>7.2f}{r["peak_mb"]:>9.0f}'
              f'{r["before_mb"]:>8.0f}{r["during_mb"]:>8.0f}{r["during_mb"] - r["before_mb"]:>8.0f}', flush=True)
    if 'ours' in results and 'ours-recompute' in results:
        plain, lean = results['ours'], results['ours-recompute']
        print(f'recompute: peak RSS {lean["peak_mb"] / plain["peak_mb"]:.2f}x, activation memory '
              f'{(lean["during_mb"] - lean["before_mb"]) / (plain["during_mb"] - plain["before_mb"]):.2f}x '
              f'of the plain step')
    if args.bounds:
        bounds(args.batch, args.length)


if __name__ == '__main__':
    main()
