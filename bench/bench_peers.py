"""gpt2_tf against its peers on one CPU: ours float32 and int8, the TF1 original, HF PyTorch, CTranslate2 float32 and int8.

    python bench/bench_peers.py [--rounds 2] [--reps 1] [--engines ...] [--rows ...] [--isa avx2]

The 124M-shaped random checkpoint (bench/.cache/, bench_generate's), the HF folder
gpt2_tf.save_hf writes from it, and CTranslate2's TransformersConverter on that
folder. Each engine runs in its own process, one process per engine and round, the
engines in turn (reversed every other round), so the load of a shared machine falls
on every side; each row is one first call, then --reps timed calls per round; the
table shows the median of the timed calls of all rounds (ms per call; 16-token
prompt, 64 new tokens). Beside them: the bytes-per-token bound (the weights read once
per step plus the KV cache, at the read bandwidth a plain TensorFlow reduction over
512 MB reaches, best of the run's measurements; the forward rows count the weights
and the logits written) for float32 and int8 weights, and the FLOP bound (the
matrix products alone, at the rate TensorFlow's best kernel, XLA or not, reaches on
the same shapes, each product repeated so that a block's matrices come from the
caches; the tied head's 154 MB cannot, so at few rows its share is the time to
stream it; the prompt's head counts its last position only, as decoding computes it).

Each engine's process imports its library as its users would: ours (and the
bounds) through gpt2_tf, which turns TensorFlow's oneDNN ops on; TF1 with
TensorFlow's own default (off where the CPU lacks AVX-512 VNNI, bfloat16 and AMX,
such as a Zen 3).

--isa avx2 runs every engine as it runs on a CPU with AVX2 and FMA but no AVX-512
(each library's own switch, AVX2 below: the engines' code paths, not that CPU's
caches or memory), on a machine that has AVX-512.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / 'tests'))

ENGINES = ('ours-float32', 'ours-int8', 'tf1', 'hf', 'ct2-float32', 'ct2-int8')
ROWS = {'greedy B1': ('greedy', 1, 16), 'greedy B8': ('greedy', 8, 16), 'greedy B16': ('greedy', 16, 16),
        'top_k=40 B1': ('top_k', 1, 16), 'forward B1 T1024': ('forward', 1, 1024),
        'forward B8 T128': ('forward', 8, 128)}
NEW = 64  # new tokens per sampling call
AVX2 = {  # each engine's switch to its AVX2 code, as on a CPU without AVX-512
    'GPT2_TF_KERNEL_ARCH': 'x86-64-v3',  # our int8 kernel, built for AVX2 and FMA
    'XLA_FLAGS': '--xla_cpu_max_isa=AVX2',  # the XLA decode loop's code
    'ONEDNN_MAX_CPU_ISA': 'AVX2',  # oneDNN: CTranslate2's GEMMs, PyTorch's and TensorFlow's oneDNN ops
    'ATEN_CPU_CAPABILITY': 'avx2',  # PyTorch's own kernels
    'MKL_ENABLE_INSTRUCTIONS': 'AVX2',  # MKL, where PyTorch calls it
    'CT2_FORCE_CPU_ISA': 'AVX2',  # CTranslate2's own kernels
}
NAMES = {'ours-float32': 'gpt2_tf float32', 'ours-int8': 'gpt2_tf int8', 'tf1': 'TF1 original',
         'hf': 'HF PyTorch', 'ct2-float32': 'CT2 float32', 'ct2-int8': 'CT2 int8'}


def prompts(row: str):
    import numpy as np

    kind, batch, length = ROWS[row]
    return kind, np.random.default_rng(batch * 7919 + length).integers(0, 50257, (batch, length), dtype=np.int32)


def ours(dtype: str):
    import numpy as np

    import gpt2_tf
    from bench_generate import checkpoint

    model = gpt2_tf.load_model(checkpoint(), dtype=dtype)
    return {'greedy': lambda p: gpt2_tf.sample_sequence(model, NEW, context=p, top_k=1),
            'top_k': lambda p: gpt2_tf.sample_sequence(model, NEW, context=p, top_k=40, seed=1),
            'forward': lambda t: np.asarray(model(t)['logits'])}  # a view, as the others' arrays are: no copy


def tf1():
    from bench_generate import sides

    _, _, _, reference = sides()
    samplers = {}

    def sample(p, top_k):
        key = (p.shape[0], top_k)
        if key not in samplers:
            samplers[key] = reference.sampler(length=NEW, batch_size=p.shape[0], top_k=top_k, top_p=None)
        return samplers[key](p)
    return {'greedy': lambda p: sample(p, 1), 'top_k': lambda p: sample(p, 40), 'forward': reference}


def hf():
    import torch
    from bench_generate import checkpoint, hf_generate, hf_model

    torch.set_num_threads(os.cpu_count())  # as many threads as the others take (torch counts physical cores)
    print(f'torch {torch.__version__}, {torch.get_num_threads()} threads', file=sys.stderr)
    model = hf_model(checkpoint())

    def forward(t):
        with torch.inference_mode():
            return model(torch.tensor(t, dtype=torch.long)).logits.numpy()
    return {'greedy': lambda p: hf_generate(model, p, NEW, do_sample=False),
            'top_k': lambda p: hf_generate(model, p, NEW, do_sample=True, top_k=40, top_p=1.0),
            'forward': forward}


def ct2_folder() -> pathlib.Path:
    """CTranslate2's conversion of the HF folder save_hf writes (float32; int8 is chosen at load)."""
    import ctranslate2
    from bench_generate import checkpoint, hf_model

    folder = checkpoint()
    target = folder.parent / (folder.name + '-ct2')
    if not (target / 'model.bin').exists():
        hf_model(folder)  # writes the HF folder once
        ctranslate2.converters.TransformersConverter(str(folder.parent / (folder.name + '-hf'))).convert(
            str(target), force=True)
    return target


def ct2(compute_type: str):
    import ctranslate2
    import numpy as np

    folder = ct2_folder()
    generator = ctranslate2.Generator(str(folder), device='cpu', compute_type=compute_type,
                                      intra_threads=os.cpu_count())
    vocabulary = json.loads((folder / 'vocabulary.json').read_text())
    print(f'CTranslate2 {ctranslate2.__version__}, compute_type {compute_type}, {os.cpu_count()} threads',
          file=sys.stderr)

    def tokens(p):
        return [[vocabulary[i] for i in row] for row in p]

    def sample(p, top_k):
        results = generator.generate_batch(tokens(p), max_length=NEW, min_length=NEW, sampling_topk=top_k,
                                           include_prompt_in_result=False)
        assert all(len(r.sequences_ids[0]) == NEW for r in results), [len(r.sequences_ids[0]) for r in results]
        return results
    return {'greedy': lambda p: sample(p, 1), 'top_k': lambda p: sample(p, 40),
            'forward': lambda t: np.asarray(generator.forward_batch(tokens(t)))}


def engine(name: str) -> dict:
    return {'ours-float32': lambda: ours('float32'), 'ours-int8': lambda: ours('int8'), 'tf1': tf1, 'hf': hf,
            'ct2-float32': lambda: ct2('float32'), 'ct2-int8': lambda: ct2('int8')}[name]()


def work(name: str, rows: list, reps: int) -> dict:
    """{row: [seconds of each timed call]} for one engine, in this process."""
    calls = engine(name)
    out = {}
    for row in rows:
        kind, inputs = prompts(row)
        calls[kind](inputs)  # the first call: tracing, compiling, warming
        out[row] = []
        for _ in range(reps):
            start = time.perf_counter()
            calls[kind](inputs)
            out[row].append(time.perf_counter() - start)
    return out


def product_seconds(m: int, shapes: list, reps: int = 3) -> float:
    """Seconds the matrix products of one step over m rows take ([m, k] x [k, n] for each (k, n, count)), at the
    best of TensorFlow's kernels and XLA's, weights in cache: several products per call, so dispatch is small."""
    import numpy as np
    import tensorflow as tf

    total = 0.0
    for k, n, count in shapes:
        x = tf.constant(np.random.default_rng(0).standard_normal((m, k)).astype(np.float32))
        w = tf.constant(np.random.default_rng(1).standard_normal((k, n)).astype(np.float32) * 0.02)
        chain = max(1, min(20, int(2e8 // (2 * m * k * n))))

        def products(x):
            return tf.add_n([tf.reduce_sum(tf.matmul(x + float(i), w)) for i in range(chain)])
        best = float('inf')
        for compiled in (tf.function(products), tf.function(products, jit_compile=True)):
            compiled(x).numpy()
            for _ in range(reps):
                start = time.perf_counter()
                compiled(x).numpy()
                best = min(best, (time.perf_counter() - start) / chain)
        total += best * count
    return total


def bounds(rows: list) -> dict:
    """{'bandwidth': bytes/s, 'weights': {dtype: bytes}, 'products': {m: {'blocks', 'head': seconds over m rows}}}."""
    import numpy as np

    from gpt2_tf import HParams  # before TensorFlow: its oneDNN default, so that oneDNN's products count too
    from gpt2_tf.checkpoint import variable_shapes
    from bench_int8 import read_bandwidth
    import tensorflow as tf

    hp = HParams.named('124M')
    shapes = variable_shapes(hp)
    matrices = {n: s for n, s in shapes.items() if n == 'model/wte' or n.endswith('/w')}
    total = sum(int(np.prod(s)) for n, s in shapes.items() if n != 'model/wpe')  # wpe: a row per position
    in_matrices = sum(int(np.prod(s)) for s in matrices.values())
    scales = sum(s[0] if n == 'model/wte' else s[-1] for n, s in matrices.items())
    weights = {'float32': 4 * total, 'int8': in_matrices + 4 * (total - in_matrices + scales)}
    e = hp.n_embd
    blocks = [(e, 3 * e, hp.n_layer), (e, e, hp.n_layer), (e, 4 * e, hp.n_layer), (4 * e, e, hp.n_layer)]
    head = [(e, hp.n_vocab, 1)]  # c_attn, attn c_proj, c_fc, mlp c_proj per block; the tied head
    ms = set()
    for row in rows:
        kind, batch, length = ROWS[row]
        ms |= {batch * length} if kind == 'forward' else {batch, batch * length}  # a prompt's head: batch rows
    print(f'TensorFlow {tf.__version__}: the products at rows {sorted(ms)}', file=sys.stderr)
    return {'bandwidth': max(read_bandwidth() for _ in range(3)), 'weights': weights,
            'products': {m: {'blocks': product_seconds(m, blocks), 'head': product_seconds(m, head)}
                         for m in sorted(ms)}}


def row_bounds(row: str, measured: dict) -> tuple:
    """(bytes bound float32, bytes bound int8, FLOP bound) in seconds for one call of the row."""
    from gpt2_tf import HParams

    hp = HParams.named('124M')
    kind, batch, length = ROWS[row]
    bandwidth, weights, products = measured['bandwidth'], measured['weights'], measured['products']
    products = {int(m): s for m, s in products.items()}
    if kind == 'forward':
        logits = batch * length * hp.n_vocab * 4  # written once
        whole = products[batch * length]
        return ((weights['float32'] + logits) / bandwidth, (weights['int8'] + logits) / bandwidth,
                whole['blocks'] + whole['head'])
    cache = sum(2 * hp.n_layer * batch * (length + i) * hp.n_embd * 4 for i in range(NEW))  # read back per step
    prompt = products[batch * length]['blocks'] + products[batch]['head']  # the head for its last position only
    flops = prompt + (NEW - 1) * (products[batch]['blocks'] + products[batch]['head'])  # then a row per step
    return ((NEW * weights['float32'] + cache) / bandwidth, (NEW * weights['int8'] + cache) / bandwidth, flops)


def run_worker(args, name: str) -> dict:
    """Runs one engine (or 'bounds') in a fresh process; its result, or {} when it failed (said on stderr)."""
    command = [sys.executable, __file__, '--worker', name, '--rows', ','.join(args.rows), '--reps', str(args.reps)]
    start = time.perf_counter()
    isa = dict(AVX2) if args.isa == 'avx2' else {}
    if isa and name == 'tf1':
        isa['TF_ENABLE_ONEDNN_OPTS'] = '0'  # TensorFlow's own default on such CPUs (gpt2_tf turns it on)
    env = dict(os.environ, PYTHONPATH=str(HERE.parent), **isa)
    out = subprocess.run(command, capture_output=True, text=True, cwd=HERE.parent, env=env)
    lines = [line for line in out.stdout.splitlines() if line.startswith('{')]
    if out.returncode or not lines:
        print(f'{name}: failed ({out.returncode}): {out.stderr.strip().splitlines()[-1:]}', flush=True)
        return {}
    print(f'{name}: {time.perf_counter() - start:.0f} s, load average {os.getloadavg()[0]:.1f}', flush=True)
    return json.loads(lines[-1])


def table(args, times: dict, measured: dict) -> None:
    engines = [e for e in args.engines if times.get(e)]
    print(f'\nread bandwidth (TF reduce_sum, 512 MB): {measured["bandwidth"] / 1e9:.1f} GB/s; weights read per '
          f'step: float32 {measured["weights"]["float32"] / 1e6:.0f} MB, int8 {measured["weights"]["int8"] / 1e6:.0f} MB')
    head = ''.join(f'{NAMES[e]:>17}' for e in engines)
    print(f'{"ms per call (median)":<20}{head}{"bytes f32":>11}{"bytes int8":>11}{"FLOP":>9}')
    for row in args.rows:
        cells = ''
        for e in engines:
            samples = times[e].get(row, [])
            cells += f'{statistics.median(samples) * 1e3:>17.0f}' if samples else f'{"-":>17}'
        f32, int8, flops = row_bounds(row, measured) if measured else (float('nan'),) * 3
        print(f'{row:<20}{cells}{f32 * 1e3:>11.0f}{int8 * 1e3:>11.0f}{flops * 1e3:>9.0f}', flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--rounds', type=int, default=2, help='processes per engine, the engines in turn')
    parser.add_argument('--reps', type=int, default=1, help='timed calls per row and round, after a first')
    parser.add_argument('--engines', default=','.join(ENGINES))
    parser.add_argument('--rows', default=','.join(ROWS))
    parser.add_argument('--isa', choices=('native', 'avx2'), default='native',
                        help="avx2: every engine's AVX2 code, as on a CPU without AVX-512")
    parser.add_argument('--worker', help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.engines, args.rows = args.engines.split(','), args.rows.split(',')
    if args.worker:
        result = bounds(args.rows) if args.worker == 'bounds' else work(args.worker, args.rows, args.reps)
        print(json.dumps(result))
        return
    from bench_generate import cpu

    print(f'CPU: {cpu()}; code paths: {args.isa}; load average at the start {os.getloadavg()[0]:.1f} (a shared machine: every engine '
          f'runs in turn, {args.rounds} rounds)', flush=True)
    times = {e: {} for e in args.engines}
    measured = {}
    for round_ in range(args.rounds):
        for name in (['bounds'] if round_ == 0 else []) + (args.engines[::-1] if round_ % 2 else args.engines):
            result = run_worker(args, name)
            if name == 'bounds':
                measured = result
                continue
            for row, samples in result.items():
                times[name].setdefault(row, []).extend(samples)
    table(args, times, measured)


if __name__ == '__main__':
    main()
