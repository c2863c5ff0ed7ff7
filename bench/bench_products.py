"""The decode step's weight products alone, inside an XLA loop: float32 (XLA's dots), float32 as a decode step
takes them (precision.decoding: the kernel where kernels.few_rows says), float32 with the kernel at every row
from 1 to 16 (float32-kernel) and int8 (the kernel).

    python bench/bench_products.py [--rows 1,8,16] [--dtypes float32,float32-decoding,float32-kernel,int8] [--reps 5] [--threads N]
        [--parts blocks,chained,logits] [--fastest]

For each dtype and number of rows (the batch of a decode step), 20 steps of a compiled
while loop, each doing what a step of the 124M-shaped model does with its weights: the
48 block products (c_attn, attn c_proj, c_fc, mlp c_proj of 12 layers), independent of each
other (XLA may overlap them); the same 48 chained as a step takes them, each waiting for the
last, with its bias (which XLA fuses into its dot); and, apart, the tied logits against wte.
Printed per step: ms, the weight bytes over that time (GB/s), and the FLOP rate; beside
them the bandwidth a plain float32 reduction reaches in the same process (bench_int8's measure). Each figure
is the median of --reps loops, or with --fastest their fastest (steadier where other work shares the memory).
"""

import argparse
import contextlib
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
sys.path.insert(0, str(pathlib.Path(__file__).parent))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import gpt2_tf  # noqa: E402
from gpt2_tf import kernels, precision  # noqa: E402
from bench_generate import checkpoint, cpu  # noqa: E402
from bench_int8 import read_bandwidth  # noqa: E402

STEPS = 20
MATRICES = ('attn/c_attn', 'attn/c_proj', 'mlp/c_fc', 'mlp/c_proj')


def products(model):
    """(the 48 block products, the logits) as functions of x [rows, 768] and its [rows, 3072] widening."""
    variables = model.variables_by_name()

    def weight(name):
        w = variables[name]
        return w[0] if w.shape.rank == 3 else w, variables.get(name + precision.SCALE)

    blocks = [[weight(f'model/h{i}/{m}/w') for m in MATRICES] for i in range(model.hparams.n_layer)]
    biases = [[variables[f'model/h{i}/{m}/b'] for m in MATRICES] for i in range(model.hparams.n_layer)]
    wte, wte_scale = weight('model/wte')[0], variables.get('model/wte' + precision.SCALE)

    def block_products(x, wide):
        out = []
        for layer in blocks:
            for (w, scale), rows in zip(layer, (x, x, x, wide)):
                out.append(tf.reduce_sum(precision.product(rows, w, scale)))
        return tf.add_n(out)

    def chained(x, _wide):  # each product waits for the last, its bias added, as in a decode step
        h = x
        for layer, bias in zip(blocks, biases):
            (attn, attn_s), (proj, proj_s), (fc, fc_s), (mlp, mlp_s) = layer
            a = precision.product(h, attn, attn_s) + bias[0]  # [rows, 2304]
            h = h + precision.product(a[:, :768], proj, proj_s) + bias[1]
            f = precision.product(h, fc, fc_s) + bias[2]  # [rows, 3072]
            h = h + precision.product(f, mlp, mlp_s) + bias[3]
        return tf.reduce_sum(h)

    def logits(x, _wide):
        return tf.reduce_sum(precision.product(x, wte, wte_scale, transpose_b=True))

    weights = sum(int(np.prod(w.shape)) * w.dtype.size for layer in blocks for w, _ in layer)
    return {'blocks': (block_products, weights), 'chained': (chained, weights),
            'logits': (logits, int(np.prod(wte.shape)) * wte.dtype.size)}


def timed_loop(fn, rows: int, reps: int, decoding: bool, summary=statistics.median) -> float:
    x, wide = tf.random.normal([rows, 768]), tf.random.normal([rows, 3072])

    @tf.function(jit_compile=True)
    def run():
        body = lambda i, a: (i + 1, a * 1e-9 + fn(x + a, wide + a))  # noqa: E731  (each step depends on the last)
        return tf.while_loop(lambda i, a: i < STEPS, body, (0, 0.0))[1]

    with precision.decoding() if decoding else contextlib.nullcontext():
        run()  # traced here
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run().numpy()
        times.append(time.perf_counter() - start)
    return summary(times) / STEPS


@contextlib.contextmanager
def forced_kernel():
    """Within it, decoding takes the float32 kernel at 1-16 rows of x, for both layouts, on any CPU."""
    before = kernels.FEW_ROWS
    kernels.FEW_ROWS = {cpu: {layout: range(1, 17) for layout in rows} for cpu, rows in before.items()}
    try:
        yield
    finally:
        kernels.FEW_ROWS = before


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--rows', default='1,8,16')
    parser.add_argument('--dtypes', default='float32,float32-decoding,int8')
    parser.add_argument('--reps', type=int, default=5)
    parser.add_argument('--threads', type=int, default=0, help="TensorFlow's intra-op threads (0: its default)")
    parser.add_argument('--parts', default='blocks,chained,logits', help='which of blocks, chained, logits to time')
    parser.add_argument('--fastest', action='store_true', help='the fastest of --reps loops instead of their median')
    args = parser.parse_args()
    parts = args.parts.split(',')
    if set(parts) - {'blocks', 'chained', 'logits'}:
        parser.error(f'--parts {args.parts}: name some of blocks, chained, logits')
    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    print(f'CPU: {cpu()}')
    print(f'read bandwidth (reduce_sum over 512 MB): {read_bandwidth() / 1e9:.1f} GB/s')
    for case in args.dtypes.split(','):
        dtype = case.split('-')[0]
        model = gpt2_tf.load_model(checkpoint(), dtype=dtype)
        for name, (fn, nbytes) in products(model).items():
            if name not in parts:
                continue
            for rows in map(int, args.rows.split(',')):
                with forced_kernel() if case.endswith('-kernel') else contextlib.nullcontext():
                    seconds = timed_loop(fn, rows, args.reps, decoding=case != dtype,
                                         summary=min if args.fastest else statistics.median)
                flops = 2 * rows * nbytes / (1 if dtype == 'int8' else 4)
                print(f'{case:<16} {name:<7} {rows:>3} rows: {seconds * 1e3:7.2f} ms a step, '
                      f'{nbytes / seconds / 1e9:5.1f} GB/s of weights, {flops / seconds / 1e9:6.1f} GFLOP/s',
                      flush=True)


if __name__ == '__main__':
    main()
