"""Generation and forward-pass speed: gpt2_tf against the TF1 reference graph, in one run.

    python bench/bench_generate.py [--reps 5] [--sections sampling,chunks,forward]

Uses a 124M-shaped original-format checkpoint with random values (written once
into bench/.cache/). Prints the CPU, ms per call, tokens/s and ours/TF1 time
ratios; the first call of each (trace and compile) is timed separately.

Both sides share this process, which imports TensorFlow first: both run with
TensorFlow's own oneDNN default (off where the CPU lacks AVX-512 VNNI, bfloat16
and AMX, such as a Zen 3, where gpt2_tf's commands turn it on); bench_peers.py runs each
engine in a process of its own, with its own default.
"""

import argparse
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / 'tests'))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import gpt2_tf  # noqa: E402
from gpt2_tf import HParams  # noqa: E402
from gpt2_tf.compiled import bucket  # noqa: E402
from gpt2_tf.sample import sample_sequence  # noqa: E402
from gpt2_tf.tf1_reference import Reference  # noqa: E402
from support import write_random_checkpoint  # noqa: E402

CACHE = pathlib.Path(__file__).parent / '.cache' / '124M-random'
FLAGS = ('avx2', 'avx512f', 'avx512_bf16', 'avx512_fp16', 'amx_bf16', 'amx_tile')


def checkpoint() -> pathlib.Path:
    if not (CACHE / 'checkpoint').exists():
        print(f'writing a 124M-shaped random checkpoint to {CACHE} ...', flush=True)
        write_random_checkpoint(CACHE, HParams.named('124M'), seed=0, scale=0.02, meta_graph=False)
    return CACHE


def sides():
    """The 124M-shaped random checkpoint's folder and hparams, loaded here and as the TF1 reference graph."""
    folder = checkpoint()
    hparams = HParams.named('124M')
    return folder, hparams, gpt2_tf.load_model(folder), Reference(hparams, str(folder / 'model.ckpt'))


def cpu() -> str:
    """The CPU model and the vector flags that matter here, from /proc/cpuinfo."""
    try:
        text = pathlib.Path('/proc/cpuinfo').read_text()
    except OSError:
        return 'unknown CPU'
    def field(name):  # the first CPU's value
        return next((line.split(':', 1)[1].strip() for line in text.splitlines()
                     if line.split(':', 1)[0].strip() == name), '?')
    flags = set(field('flags').split())
    # A virtual machine's model name may be only the vendor's ('AMD EPYC'): family and model tell the generation.
    return (f'{field("model name")} (family {field("cpu family")} model {field("model")}), {os.cpu_count()} CPUs, '
            f'flags: {" ".join(f for f in FLAGS if f in flags) or "none of " + str(FLAGS)}')


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


def row(case, first, seconds, tokens, ratio=None, note=''):
    ratio_text = f'{ratio:>10.2f}' if ratio is not None else f'{"":>10}'
    print(f'{case:<44}{first:>9.2f}{seconds * 1e3:>10.1f}{tokens / seconds:>10.1f}{ratio_text}  {note}', flush=True)


def hf_model(folder):
    """The same weights in transformers' GPT2LMHeadModel (sdpa attention), or None without torch/transformers."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    hf_dir = folder.parent / (folder.name + '-hf')
    if not (hf_dir / 'model.safetensors').exists():
        gpt2_tf.save_hf(gpt2_tf.load_model(folder), hf_dir)
    model = transformers.GPT2LMHeadModel.from_pretrained(hf_dir, attn_implementation='sdpa').eval()
    print(f'HF PyTorch: torch {torch.__version__}, transformers {transformers.__version__}, '
          f'{torch.get_num_threads()} threads')
    return model


def hf_generate(model, prompt, new, **options):
    import torch

    with torch.inference_mode():
        return model.generate(torch.tensor(prompt, dtype=torch.long), max_new_tokens=new, min_new_tokens=new,
                              pad_token_id=0, **options)


def sampling(model, reference, hparams, args, rng, hf=None):
    settings = [('greedy', dict(top_k=1), dict(top_k=1, top_p=None)),
                ('top_k=40', dict(top_k=40), dict(top_k=40, top_p=None)),
                ('top_p=0.9', dict(top_p=0.9), dict(top_k=0, top_p=0.9))]
    for name, ours_options, tf1_options in settings:
        for batch in (1, 8):
            prompt = rng.integers(0, hparams.n_vocab, size=(batch, args.prompt), dtype=np.int32)
            sampler = reference.sampler(length=args.new, batch_size=batch, **tf1_options)
            tf1_first, tf1 = timed(lambda: sampler(prompt), args.reps)
            new_tokens = batch * args.new
            row(f'{name}, {args.new} new, B={batch}: TF1', tf1_first, tf1, new_tokens)
            for mode in args.modes.split(','):
                run = lambda: sample_sequence(model, args.new, context=prompt, mode=mode, seed=1, **ours_options)  # noqa: E731
                first, ours = timed(run, args.reps)
                note = ''
                if name == 'greedy':
                    note = 'same tokens' if np.array_equal(run(), sampler(prompt)) else 'TOKENS DIFFER'
                row(f'{name}, {args.new} new, B={batch}: ours {mode}', first, ours, new_tokens, ours / tf1, note)
            if hf is not None:
                options = dict(do_sample=False) if name == 'greedy' else dict(
                    do_sample=True, top_k=ours_options.get('top_k', 0), top_p=ours_options.get('top_p', 1.0))
                first, theirs = timed(lambda: hf_generate(hf, prompt, args.new, **options), args.reps)
                row(f'{name}, {args.new} new, B={batch}: HF PyTorch', first, theirs, new_tokens, theirs / tf1)


def chunks(model, hparams, args, rng):
    """The chunked loop against one compiled call for the whole sequence."""
    for name, options in (('greedy', dict(top_k=1)), ('top_k=40', dict(top_k=40))):
        for batch in (1, 8):
            prompt = rng.integers(0, hparams.n_vocab, size=(batch, args.prompt), dtype=np.int32)
            whole = bucket(args.new)
            results = {}
            for chunk in (whole, 64, 32, 16, 8):
                if chunk > whole or (chunk == whole and chunk in results):
                    continue
                run = lambda: sample_sequence(model, args.new, context=prompt, seed=1, chunk=chunk, **options)  # noqa: E731
                first, seconds = timed(run, args.reps)
                results[chunk] = seconds
                overhead = f'overhead {seconds / results[whole] - 1:+.1%}' if chunk != whole else 'one call'
                row(f'{name}, B={batch}, chunk={chunk}', first, seconds, batch * args.new, None, overhead)


def step_choice(hparams, args, rng):
    """One step's choice on 50,257 logits, against the original sort-based filters, both under XLA."""
    from gpt2_tf import sample

    vocab = hparams.n_vocab
    for batch in (1, 8):
        logits = tf.constant(rng.standard_normal((batch, vocab)).astype(np.float32) * 3)
        keys = tf.constant(sample.row_keys(1, batch))
        for name, top_k, top_p in (('no filter', 0, 1.0), ('top_k=40', 40, 1.0), ('top_p=0.9', 0, 0.9)):
            options = [tf.fill([batch], 1.0), tf.fill([batch], top_k), tf.fill([batch], np.float32(top_p)), keys]
            choose = tf.function(sample.choose, jit_compile=True)
            kmax = sample.top_k_size(np.array([top_k]), vocab)
            among_top = sample.truncating(np.array([1.0]), np.array([top_k]), vocab)  # as the loop decides
            _, ours = timed(lambda: choose(logits, *options, tf.constant(0, tf.int64), kmax=kmax,
                                           among_top=among_top).numpy(), 20)
            note = ''
            if top_p < 1:
                original = tf.function(lambda x: sample.top_p_logits(x, top_p), jit_compile=True)
                _, theirs = timed(lambda: original(logits).numpy(), 20)
                note = f'the sort-based top_p_logits alone: {theirs * 1e3:.2f} ms'
            print(f'{f"choose, {name}, B={batch}":<44}{ours * 1e3:>9.2f} ms  {note}', flush=True)


def forward(model, model_xla, reference, hparams, args, rng, hf=None):
    for batch, length in ((1, 1024), (8, 128)):
        tokens = rng.integers(0, hparams.n_vocab, size=(batch, length), dtype=np.int32)
        tf1_first, tf1 = timed(lambda: reference(tokens), args.reps)
        n = batch * length
        row(f'forward B={batch} T={length}: TF1', tf1_first, tf1, n)
        for name, ours_model in (('ours', model), ('ours jit_compile', model_xla)):
            first, ours = timed(lambda: np.asarray(ours_model(tokens)['logits']), args.reps)  # a view: no copy
            row(f'forward B={batch} T={length}: {name}', first, ours, n, ours / tf1)
        if hf is not None:
            import torch

            def run():
                with torch.inference_mode():
                    return hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
            first, theirs = timed(run, args.reps)
            row(f'forward B={batch} T={length}: HF PyTorch', first, theirs, n, theirs / tf1)


def decode_bound(model, hparams, args, rng):
    """Batch-1 decoding against the weight-streaming bound measured in the same run."""
    import tensorflow as tf

    big = tf.ones([2**28], tf.float32)  # 1 GiB: far beyond the caches
    reduce = tf.function(tf.reduce_sum)  # TensorFlow's reduction runs on every core
    context = 16 + (8 + 136) // 2  # the positions a token between the two calls' ends reads back, on average
    weights = sum(v.shape.num_elements() for n, v in model.variables_by_name().items() if n != 'model/wpe') * 4
    cache = hparams.n_layer * 2 * context * hparams.n_embd * 4  # keys and values read back, per token
    prompt = rng.integers(0, hparams.n_vocab, size=(1, 16), dtype=np.int32)
    # The machine is shared: interleave the measurements and keep the best of each, what the machine can do.
    seconds, per_token = [], []
    for _ in range(max(args.reps, 5)):
        seconds.append(timed(lambda: reduce(big).numpy(), 1)[1])
        short = timed(lambda: sample_sequence(model, 8, context=prompt, top_k=1), 1)[1]
        long = timed(lambda: sample_sequence(model, 136, context=prompt, top_k=1), 1)[1]
        per_token.append((long - short) / 128)  # the prefill cancels; the longer call's few more chunks stay in
    bandwidth = big.shape.num_elements() * 4 / min(seconds)
    per_token = min(per_token)
    bound = (weights + cache) / bandwidth
    print(f'read-only bandwidth (TF reduce_sum over 1 GiB): {bandwidth / 1e9:.1f} GB/s; bytes per token: '
          f'{(weights + cache) / 1e6:.0f} MB -> bound {bound * 1e3:.2f} ms/token')
    print(f'batch-1 greedy decoding: {per_token * 1e3:.2f} ms/token = {per_token / bound:.2f}x the bound')


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--reps', type=int, default=5)
    parser.add_argument('--modes', default='xla', help='our decode loop modes to time (xla,function,eager)')
    parser.add_argument('--sections', default='sampling,bound,choose,chunks,forward')
    parser.add_argument('--peers', default='hf', help="'hf': add HF PyTorch rows when torch and transformers are "
                                                       "installed; '' for none")
    parser.add_argument('--prompt', type=int, default=16)
    parser.add_argument('--new', type=int, default=64)
    args = parser.parse_args()

    folder, hparams, model, reference = sides()
    rng = np.random.default_rng(0)
    print(f'CPU: {cpu()}')
    print(f'TensorFlow {tf.__version__}; {args.reps} timed calls after a first one')
    hf = hf_model(folder) if 'hf' in args.peers.split(',') else None
    print(f'{"case":<44}{"first s":>9}{"ms/call":>10}{"tokens/s":>10}{"ours/TF1":>10}')
    sections = args.sections.split(',')
    if 'sampling' in sections:
        sampling(model, reference, hparams, args, rng, hf)
    if 'bound' in sections:
        decode_bound(model, hparams, args, rng)
    if 'choose' in sections:
        step_choice(hparams, args, rng)
    if 'chunks' in sections:
        chunks(model, hparams, args, rng)
    if 'forward' in sections:
        forward(model, gpt2_tf.load_model(folder, jit_compile=True), reference, hparams, args, rng, hf)


if __name__ == '__main__':
    main()
