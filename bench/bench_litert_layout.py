"""The float32 LiteRT file's layout: the matrices after a LayerNorm stored twice (as exported) or once.

    python bench/bench_litert_layout.py [--max-len 128] [--tokens 32] [--rounds 3]

The converter folds each LayerNorm's gain into the c_attn and c_fc matrices of
the decode signature (its [1, 1] shapes are static), so the file holds those
matrices twice. Two ways to store them once, beside the export as it is: decode
with prefill's dynamic signature ('dynamic'), or the static decode with the
converter's mul-into-fully-connected fusion off ('unfused', a private converter
attribute). For each: the file's MB and decode ms a token through the LiteRT
interpreter (XNNPACK, 2 threads), each timing in a fresh process, rounds
alternating.
"""

import argparse
import json
import pathlib
import shutil
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from bench_generate import checkpoint, cpu  # noqa: E402
from bench_litert import PROMPT, run  # noqa: E402  the prompt, and a script run in a fresh process

OUT = pathlib.Path(__file__).parent / '.cache' / 'litert-layout'

EXPORT = '''
import json, sys
import tensorflow as tf
import gpt2_tf
from gpt2_tf import litert
layout, out, max_len = sys.argv[2], sys.argv[3], int(sys.argv[4])
if layout != 'as exported':
    init = litert.Signatures.__init__
    def replaced(self, model, max_len):
        init(self, model, max_len)
        cache = tf.TensorSpec(litert.cache_shape(model, max_len), tf.float32, name='kv_cache')
        shapes = ([1, None], [None]) if layout == 'dynamic' else ([1, 1], [1])
        specs = [tf.TensorSpec(shapes[0], tf.int32, name='tokens'),
                 tf.TensorSpec(shapes[1], tf.int32, name='input_pos'), cache]
        self.decode = tf.function(type(self).decode.__get__(self), autograph=False, input_signature=specs)
    litert.Signatures.__init__ = replaced
if layout == 'unfused':
    make = tf.lite.TFLiteConverter.from_concrete_functions
    def unfused(*args, **kwargs):
        converter = make(*args, **kwargs)
        converter._experimental_disable_fuse_mul_and_fc = True
        return converter
    tf.lite.TFLiteConverter.from_concrete_functions = unfused
info = litert.export_litert(gpt2_tf.load_model(sys.argv[1]), out, max_len=max_len)
print(json.dumps({'bytes': info['bytes']}))
'''

DECODE = '''
import json, sys, time
from gpt2_tf import litert_run
folder, prompt, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
litert_run.generate(folder, prompt, 2)
start = time.perf_counter(); litert_run.generate(folder, prompt, 1); prefill = time.perf_counter() - start
start = time.perf_counter(); litert_run.generate(folder, prompt, n + 1); total = time.perf_counter() - start
print(json.dumps({'ms_per_token': 1e3 * (total - prefill) / n}))
'''

LAYOUTS = ('as exported', 'dynamic', 'unfused')


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--max-len', type=int, default=128)
    parser.add_argument('--tokens', type=int, default=32)
    parser.add_argument('--rounds', type=int, default=3)
    args = parser.parse_args()
    folder = checkpoint()
    print(f'CPU: {cpu()}')
    print(f'124M-shaped checkpoint, float32, cache of {args.max_len} positions, {len(PROMPT)}-token prompt, '
          f'{args.tokens} greedy tokens, {args.rounds} rounds')
    sizes, times = {}, {layout: [] for layout in LAYOUTS}
    for layout in LAYOUTS:
        out = OUT / layout.replace(' ', '-')
        shutil.rmtree(out, ignore_errors=True)
        sizes[layout] = run(EXPORT, folder, layout, out, args.max_len)['bytes']
    for _ in range(args.rounds):
        for layout in LAYOUTS:
            out = OUT / layout.replace(' ', '-')
            times[layout].append(run(DECODE, out, json.dumps(PROMPT), args.tokens)['ms_per_token'])
    print(f'{"layout":<13}{"file MB":>9}{"decode ms/token (each round)":>32}')
    for layout in LAYOUTS:
        print(f'{layout:<13}{sizes[layout] / 1e6:>9.1f}    {", ".join(f"{t:.1f}" for t in times[layout])}')


if __name__ == '__main__':
    main()
