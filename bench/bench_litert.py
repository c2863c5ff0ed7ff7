"""The LiteRT export on a 124M-shaped checkpoint: file size, conversion time and memory, decode speed.

    python bench/bench_litert.py [--max-len 256] [--tokens 32]

For float32 and int8: the conversion's seconds and the process's peak RSS
(each export in a fresh process), the model.tflite size, and decode ms per
token through the LiteRT interpreter (XNNPACK, 2 threads), beside this
library's own decode of the same model (sample_sequence, greedy). Also the
share of int8's greedy tokens equal to float32's after a 16-token prompt.
"""

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from bench_generate import checkpoint, cpu  # noqa: E402

ROOT = pathlib.Path(__file__).parent.parent
OUT = pathlib.Path(__file__).parent / '.cache' / 'litert'
PROMPT = [464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13, 383, 2068, 7586, 21831, 318, 257]

EXPORT = '''
import json, sys, time
import gpt2_tf
from gpt2_tf.litert import export_litert
model = gpt2_tf.load_model(sys.argv[1], dtype=sys.argv[3])
info = export_litert(model, sys.argv[2], max_len=int(sys.argv[4]))
peak = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM'))
print(json.dumps({'seconds': info['seconds'], 'bytes': info['bytes'], 'peak_mb': peak / 1024}))
'''

DECODE = '''
import json, sys, time
import numpy as np
from gpt2_tf import litert_run
prompt, n = json.loads(sys.argv[2]), int(sys.argv[3])
litert_run.generate(sys.argv[1], prompt, 2)  # load and warm up
start = time.perf_counter(); litert_run.generate(sys.argv[1], prompt, 1); prefill = time.perf_counter() - start
start = time.perf_counter(); ids = litert_run.generate(sys.argv[1], prompt, n); total = time.perf_counter() - start
print(json.dumps({'ms_per_token': 1e3 * (total - prefill) / (n - 1), 'ids': ids}))
'''

OURS = '''
import json, sys, time
import numpy as np
import gpt2_tf
model = gpt2_tf.load_model(sys.argv[1], dtype=sys.argv[2])
prompt, n = json.loads(sys.argv[3]), int(sys.argv[4])
run = lambda k: gpt2_tf.sample_sequence(model, k, context=prompt, top_k=1)
run(n); run(1)
start = time.perf_counter(); run(1); prefill = time.perf_counter() - start
start = time.perf_counter(); ids = run(n); total = time.perf_counter() - start
print(json.dumps({'ms_per_token': 1e3 * (total - prefill) / (n - 1), 'ids': ids[0, len(prompt):].tolist()}))
'''


def run(script: str, *args) -> dict:
    done = subprocess.run([sys.executable, '-c', script, *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--max-len', type=int, default=256)
    parser.add_argument('--tokens', type=int, default=32)
    args = parser.parse_args()
    folder = checkpoint()
    print(f'CPU: {cpu()}')
    print(f'124M-shaped checkpoint, cache of {args.max_len} positions, {len(PROMPT)}-token prompt, '
          f'{args.tokens} greedy tokens')
    rows, tokens = [], {}
    for dtype in ('float32', 'int8'):
        out = OUT / dtype
        shutil.rmtree(out, ignore_errors=True)  # an export writes only a new or empty folder
        exported = run(EXPORT, folder, out, dtype, args.max_len)
        lite = run(DECODE, out, json.dumps(PROMPT), args.tokens)
        ours = run(OURS, folder, dtype, json.dumps(PROMPT), args.tokens)
        tokens[dtype] = lite['ids']
        rows.append((dtype, exported, lite, ours))
    print(f'{"dtype":<9}{"file MB":>9}{"convert s":>11}{"peak RSS MB":>13}{"LiteRT ms/token":>17}'
          f'{"gpt2_tf ms/token":>18}')
    for dtype, exported, lite, ours in rows:
        print(f'{dtype:<9}{exported["bytes"] / 1e6:>9.1f}{exported["seconds"]:>11.1f}{exported["peak_mb"]:>13.0f}'
              f'{lite["ms_per_token"]:>17.1f}{ours["ms_per_token"]:>18.1f}')
    same = sum(a == b for a, b in zip(tokens['float32'], tokens['int8']))
    first = next((i for i, (a, b) in enumerate(zip(tokens['float32'], tokens['int8'])) if a != b), None)
    print(f'int8 file / float32 file: {rows[1][1]["bytes"] / rows[0][1]["bytes"]:.3f}')
    print(f'int8 greedy tokens equal to float32\'s: {same} of {len(tokens["int8"])} '
          f'(first difference at token {first})')


if __name__ == '__main__':
    main()
