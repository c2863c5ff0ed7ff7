"""int8 weights against float32: load time, greedy decoding, bytes read per token, and a 1558M-shaped peak RSS.

    python bench/bench_int8.py [--reps 3] [--sections load,greedy,rss,onednn,rows,perplexity] [--minutes 4]

load: load_model(dir) and load_model(dir, dtype='int8') of the 124M-shaped random
checkpoint (bench/.cache/), alternating. greedy: sample_sequence with its defaults
(16-token prompt, 64 new tokens, top_k=1) at batch 1, 8 and 16, float32 and int8
alternating, with the bytes each token reads (the weights, plus the KV cache at the
mean length) and the time those bytes take at the bandwidth a plain float32 reduction
reaches in the same run. rss: a 1558M-shaped checkpoint written tensor by tensor
(bench/.cache/1558M-random, 6.2 GB), then `gpt2-tf generate --dtype int8` on it in
a fresh process, its peak RSS from /usr/bin/time. onednn: int8 greedy in a plain
tf.function and forward passes, with TensorFlow's oneDNN ops on and off, in fresh
processes (what the command line's choice per command rests on). rows: three of
a block's int8 products by the kernel (its tiles, from kernels.MANY_ROWS[False] rows on
its GEMM), by TensorFlow's float32 product over the dequantized matrix and by the default
(kernels.MANY_ROWS), at 16 to 1024 rows; wte's product by the kernel's tiles and over its
dequantized copy (kernels.DEQUANTIZED_ROWS rows at a time), in a tf.function and under XLA,
at 64 to 384 rows; then the float32 and int8 forward passes at B1 T1024 and B8 T128.
perplexity: a small model (2 blocks of 128, GPT-2's vocabulary, random start) fine-tuned
for --minutes with finetune on Python's own standard library sources (sorted files; every
tenth held out, half of those for the validation loss, half for scoring), then the held-out perplexity
(gpt2_tf.scoring.perplexity) of the run with float32 and with int8 weights.
"""

import argparse
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
sys.path.insert(0, str(pathlib.Path(__file__).parent))
sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / 'tests'))

import numpy as np  # noqa: E402

import gpt2_tf  # noqa: E402  (before TensorFlow: its oneDNN default, as the commands have it)
import tensorflow as tf  # noqa: E402
from gpt2_tf import HParams  # noqa: E402
from gpt2_tf.checkpoint import variable_shapes  # noqa: E402
from bench_generate import checkpoint, cpu  # noqa: E402

ROOT = pathlib.Path(__file__).parent.parent
BIG = pathlib.Path(__file__).parent / '.cache' / '1558M-random'


def alternating(fns: dict, reps: int) -> dict:
    """{name: median seconds}, each fn called once first, then the fns in turn reps times."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def read_bandwidth() -> float:
    """Bytes per second a plain float32 reduction over 512 MB reaches (TensorFlow's threads)."""
    x = tf.ones([128 * 1024 * 1024])
    reduce = tf.function(lambda: tf.reduce_sum(x))
    seconds = alternating({'sum': lambda: reduce().numpy()}, 5)['sum']
    return 4 * 128 * 1024 * 1024 / seconds


def weight_bytes(model) -> int:
    """The bytes of the weights a decode step reads: all but wpe, of which it reads one row."""
    return sum(int(np.prod(v.shape)) * v.dtype.size for v in model.variables if 'wpe' not in v.name)


def load(folder, reps):
    seconds = alternating({d: lambda d=d: gpt2_tf.load_model(folder, dtype=d) for d in ('float32', 'int8')}, reps)
    print(f'load 124M-shaped: float32 {seconds["float32"]:.2f} s, int8 {seconds["int8"]:.2f} s '
          f'(quantizing adds {seconds["int8"] - seconds["float32"]:+.2f} s)', flush=True)


def greedy(folder, reps):
    hp = HParams.named('124M')
    models = {d: gpt2_tf.load_model(folder, dtype=d) for d in ('float32', 'int8')}
    bandwidth = read_bandwidth()
    print(f'read bandwidth (reduce_sum over 512 MB): {bandwidth / 1e9:.1f} GB/s')
    print(f'{"greedy 16 + 64":<16}{"dtype":<9}{"ms":>8}{"ms/token":>10}{"MB/token":>10}{"bound ms/token":>16}'
          f'{"x bound":>9}{"int8/f32":>10}')
    rng = np.random.default_rng(0)
    for batch in (1, 8, 16):
        prompt = rng.integers(0, hp.n_vocab, (batch, 16)).astype(np.int32)
        seconds = alternating({d: lambda m=m: gpt2_tf.sample_sequence(m, 64, context=prompt, top_k=1)
                               for d, m in models.items()}, reps)
        cache = 2 * hp.n_layer * batch * (16 + 32) * hp.n_embd * 4  # keys and values at the mean length
        for dtype, model in models.items():
            per_token = seconds[dtype] / 64
            read = weight_bytes(model) + cache
            bound = read / bandwidth
            ratio = f'{seconds[dtype] / seconds["float32"]:.2f}' if dtype == 'int8' else ''
            print(f'{"batch " + str(batch):<16}{dtype:<9}{seconds[dtype] * 1e3:>8.0f}{per_token * 1e3:>10.1f}'
                  f'{read / 1e6:>10.0f}{bound * 1e3:>16.1f}{per_token / bound:>9.2f}{ratio:>10}', flush=True)


def rows(folder, reps):
    """The kernel's tiles against TensorFlow's float32 product over the dequantized matrix, by rows."""
    from gpt2_tf import kernels, precision

    model = gpt2_tf.load_model(folder, dtype='int8')
    variables = model.variables_by_name()
    blocks = [(variables[f'model/h0/{m}/w'][0], variables[f'model/h0/{m}/w' + precision.SCALE])
              for m in ('attn/c_attn', 'mlp/c_fc', 'mlp/c_proj')]

    def products(kernel):
        return tf.function(lambda xs: tf.add_n([tf.reduce_sum(kernels.int8_matmul(
            x, w, s, panel=precision.panel(w.shape[-1]), kernel=kernel)) for x, (w, s) in zip(xs, blocks)]))

    paths = {'tiles': products(True), 'tensorflow': products(False), 'default': products(None)}
    print(f'int8 c_attn + c_fc + mlp c_proj (124M), ms; the default switches at {kernels.MANY_ROWS[False]} rows')
    for m in (16, 32, 64, 128, 256, 1024):
        xs = [tf.random.normal([m, w.shape[0]]) for w, _ in blocks]
        seconds = alternating({name: lambda f=f: f(xs).numpy() for name, f in paths.items()}, max(reps, 5))
        print(f'{m:>5} rows: ' + ', '.join(f'{name} {t * 1e3:.2f}' for name, t in seconds.items()), flush=True)
    wte, wte_scale = variables['model/wte'], variables['model/wte' + precision.SCALE]
    logits = {f'{path}{" under XLA" if xla else ""}': tf.function(lambda x, kernel=kernel: tf.reduce_sum(
        kernels.int8_matmul(x, wte, wte_scale, transpose_w=True, kernel=kernel) if kernel else
        kernels._dequantized_product(x, wte, wte_scale, True, 0, kernels.DEQUANTIZED_ROWS)), jit_compile=xla)
        for path, kernel in (('tiles', True), ('dequantized', False)) for xla in (False, True)}
    print(f'int8 wte (124M), ms; the default switches at {kernels.MANY_ROWS[True]} rows')
    for m in (64, 128, 256, 384):
        x = tf.random.normal([m, wte.shape[1]])
        seconds = alternating({name: lambda f=f: f(x).numpy() for name, f in logits.items()}, max(reps, 5))
        print(f'{m:>5} rows: ' + ', '.join(f'{name} {t * 1e3:.2f}' for name, t in seconds.items()), flush=True)
    models = {'float32': gpt2_tf.load_model(folder), 'int8': model}
    for batch, length in ((1, 1024), (8, 128)):
        tokens = np.random.default_rng(0).integers(0, 50257, (batch, length))
        seconds = alternating({d: lambda m=m: np.asarray(m(tokens)['logits']) for d, m in models.items()}, reps)
        print(f'forward B{batch} T{length}: float32 {seconds["float32"] * 1e3:.0f} ms, int8 '
              f'{seconds["int8"] * 1e3:.0f} ms ({seconds["int8"] / seconds["float32"]:.2f}x)', flush=True)


def write_big_checkpoint(folder: pathlib.Path, hparams: HParams):
    """An original-format checkpoint of random values, one tensor in memory at a time: each saved to its own
    bundle, then the bundles merged into one."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(dir=folder) as parts:
        prefixes = []
        for i, (name, shape) in enumerate(variable_shapes(hparams).items()):
            value = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
            if name.endswith('/g'):
                value += 1
            prefixes.append(os.path.join(parts, f'part{i}'))
            tf.raw_ops.SaveV2(prefix=prefixes[-1], tensor_names=[name], shape_and_slices=[''], tensors=[value])
        tf.raw_ops.MergeV2Checkpoints(checkpoint_prefixes=prefixes, destination_prefix=str(folder / 'model.ckpt'))
    (folder / 'checkpoint').write_text('model_checkpoint_path: "model.ckpt"\n'
                                       'all_model_checkpoint_paths: "model.ckpt"\n')
    hparams.to_json(str(folder / 'hparams.json'))


def rss(_folder, _reps):
    hparams = HParams.named('1558M')
    if not (BIG / 'checkpoint').exists():
        start = time.perf_counter()
        print(f'writing a 1558M-shaped random checkpoint to {BIG} ...', flush=True)
        write_big_checkpoint(BIG, hparams)
        print(f'written in {time.perf_counter() - start:.0f} s', flush=True)
    for dtype in ('int8',):
        command = ['/usr/bin/time', '-v', sys.executable, '-m', 'gpt2_tf', 'generate', '--model_dir', str(BIG),
                   '--dtype', dtype, '--length', '4', '--seed', '0', '--quiet', 'Hello']
        start = time.perf_counter()
        out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ))
        peak = re.search(r'Maximum resident set size \(kbytes\): (\d+)', out.stderr)
        if out.returncode or not peak:
            print(out.stderr[-2000:])
            continue
        print(f'1558M-shaped generate --dtype {dtype} --length 4: peak RSS {int(peak.group(1)) / 1024 ** 2:.2f} GiB, '
              f'{time.perf_counter() - start:.0f} s', flush=True)


def onednn_child(folder, reps):
    """One process's int8 times (TF_ENABLE_ONEDNN_OPTS as the parent set it): greedy in a plain tf.function
    (the command line's mode) at batch 1 and 8, and forward passes."""
    model = gpt2_tf.load_model(folder, dtype='int8')
    rng = np.random.default_rng(0)
    cases = {}
    for batch in (1, 8):
        prompt = rng.integers(0, model.hparams.n_vocab, (batch, 16)).astype(np.int32)
        cases[f'greedy B{batch}'] = lambda p=prompt: gpt2_tf.sample_sequence(model, 64, context=p, top_k=1,
                                                                               mode='function')
    for batch, length in ((1, 1024), (8, 128)):
        tokens = rng.integers(0, model.hparams.n_vocab, (batch, length)).astype(np.int32)
        cases[f'forward B{batch} T{length}'] = lambda t=tokens: np.asarray(model(t)['logits'])  # a view, no copy
    seconds = alternating(cases, reps)
    print('  '.join(f'{name} {s * 1e3:.0f}' for name, s in seconds.items()), flush=True)


def onednn(folder, reps):
    """int8 with TensorFlow's oneDNN ops on, on with the system allocator, and off, each in fresh processes,
    in turn twice."""
    settings = ({'TF_ENABLE_ONEDNN_OPTS': '1'}, {'TF_ENABLE_ONEDNN_OPTS': '1', 'TF_ONEDNN_USE_SYSTEM_ALLOCATOR': '1'},
                {'TF_ENABLE_ONEDNN_OPTS': '0'})
    for _ in range(2):
        for setting in settings:
            print(' '.join(f'{k}={v}' for k, v in setting.items()) + ': ', end='', flush=True)
            subprocess.run([sys.executable, __file__, '--sections', 'onednn_child', '--reps', str(reps)], cwd=ROOT,
                           env=dict(os.environ, **setting), check=True, stderr=subprocess.DEVNULL)


PPL = pathlib.Path(__file__).parent / '.cache' / 'perplexity'


def stdlib_texts() -> tuple:
    """(training, validation, scoring) text files made from the standard library's .py files, every tenth
    held out: the sources of the Python running this."""
    import sysconfig

    files = sorted(pathlib.Path(sysconfig.get_paths()['stdlib']).glob('*.py'))
    PPL.mkdir(parents=True, exist_ok=True)
    parts = {'train': [f for i, f in enumerate(files) if i % 10], 'val': files[0::20], 'score': files[10::20]}
    paths = []
    for name, chosen in parts.items():
        path = PPL / f'{name}.txt'
        path.write_text('\n<|endoftext|>\n'.join(f.read_text(encoding='utf-8', errors='replace') for f in chosen))
        paths.append(path)
    return tuple(paths)


def perplexity(_folder, _reps, minutes: float = 4.0):
    from gpt2_tf.encoder import encode
    from gpt2_tf.scoring import perplexity as score
    from support import write_random_checkpoint

    train, val, held_out = stdlib_texts()
    base = PPL / 'base'
    hparams = HParams(n_vocab=50257, n_ctx=128, n_embd=128, n_head=4, n_layer=2)
    write_random_checkpoint(base, hparams, seed=0, scale=0.02, meta_graph=False)
    deadline = time.perf_counter() + 60 * minutes
    losses = []
    trainer = gpt2_tf.finetune(
        str(base), str(train), checkpoint_dir=str(PPL / 'runs'), run_name='stdlib', restore_from='fresh',
        steps=-1, batch_size=8, accumulate_gradients=1, learning_rate=1e-3, seed=0, print_every=50,
        sample_every=0, save_every=0, val_dataset=str(val), val_every=25, val_batch_size=4, val_batch_count=8,
        log=lambda line: (print(line, flush=True), 'validation' in line and losses.append(line)),
        stop=lambda step: time.perf_counter() > deadline)
    run = PPL / 'runs' / 'stdlib'
    ids = encode(held_out.read_text(encoding='utf-8'))
    print(f'fine-tuned {minutes:g} min ({trainer.steps} steps); validation: '
          f'{losses[0] if losses else "?"} ... {losses[-1] if losses else "?"}; held out: {len(ids)} tokens')
    result = {}
    for dtype in ('float32', 'int8'):
        model = gpt2_tf.load_model(run, dtype=dtype)
        result[dtype] = score(model, ids, stride=64)['perplexity']
    base_ppl = score(gpt2_tf.load_model(base), ids, stride=64)['perplexity']
    print(f'held-out perplexity: before fine-tuning {base_ppl:.1f}; float32 {result["float32"]:.3f}, '
          f'int8 {result["int8"]:.3f} ({result["int8"] / result["float32"] - 1:+.2%})', flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--reps', type=int, default=3)
    parser.add_argument('--sections', default='load,greedy,rss')
    parser.add_argument('--minutes', type=float, default=4.0, help='perplexity: minutes of fine-tuning')
    args = parser.parse_args()
    if args.sections != 'onednn_child':
        print(f'CPU: {cpu()}')
    folder = checkpoint()
    for section in args.sections.split(','):
        if section == 'perplexity':
            perplexity(folder, args.reps, args.minutes)
        else:
            {'load': load, 'greedy': greedy, 'rss': rss, 'onednn': onednn, 'onednn_child': onednn_child,
             'rows': rows}[section](folder, args.reps)


if __name__ == '__main__':
    main()
