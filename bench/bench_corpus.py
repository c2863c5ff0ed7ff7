"""Encoding a large corpus into a token file: speed and peak memory against tiktoken, in one run.

    python bench/bench_corpus.py [--megabytes 200] [--processes 1,2] [--rounds 2]

Builds a folder of real text (Python's standard-library sources, repeated to
the size asked, as .txt files) once into bench/.cache/corpus-<MB>/, then times
(1) single-process tiktoken encode_ordinary over the same files, read whole,
and (2) gpt2_tf.corpus.encode_corpus with 1 and 2 processes. Peak RSS is
measured per process (ru_maxrss of the encoding process, and of its workers).
Each run is a fresh subprocess, so one run's memory does not count in another's.
The runs are interleaved, round after round, so that a busy machine slows
every side alike; the table gives each side's best round.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import sysconfig
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).parent))

from bench_generate import cpu  # noqa: E402

CACHE = pathlib.Path(__file__).parent / '.cache'


def build(megabytes: int) -> pathlib.Path:
    folder = CACHE / f'corpus-{megabytes}'
    if (folder / 'done').exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    sources = sorted(pathlib.Path(sysconfig.get_paths()['stdlib']).rglob('*.py'))
    texts = []
    for path in sources:
        try:
            texts.append(path.read_text(encoding='utf-8'))
        except (UnicodeDecodeError, OSError):
            continue
    written, copy = 0, 0
    while written < megabytes * 1e6:
        for i, text in enumerate(texts):
            (folder / f'{copy:03d}-{i:05d}.txt').write_text(text, encoding='utf-8', newline='')
            written += len(text.encode('utf-8'))
            if written >= megabytes * 1e6:
                break
        copy += 1
    (folder / 'done').write_text(str(written))
    return folder


# This process's own peak: ru_maxrss keeps the high-water mark of the process that forked it across exec (here
# the benchmark's own, TensorFlow loaded), VmHWM does not. A pool worker's ru_maxrss is its own or its fork
# parent's (the small encoding process), whichever is larger: an upper bound.
PEAK = '''
def peak_mb():
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM:'):
            return int(line.split()[1]) / 1024
'''

TIKTOKEN = PEAK + '''
import glob, json, resource, sys, time
from gpt2_tf.encoder import get_encoder
encoding = get_encoder()._tiktoken
files = sorted(glob.glob(sys.argv[1] + '/**/*.txt', recursive=True))
start = time.perf_counter(); tokens = 0; chars = 0
for path in files:
    text = open(path, encoding='utf-8', newline='').read()
    chars += len(text)
    tokens += len(encoding.encode_ordinary(text)) + 1
print(json.dumps({'seconds': time.perf_counter() - start, 'tokens': tokens, 'rss_mb': peak_mb()}))
'''

OURS = PEAK + '''
import json, resource, sys, time
from gpt2_tf.corpus import encode_corpus
start = time.perf_counter()
info = encode_corpus([sys.argv[1]], sys.argv[2], processes=int(sys.argv[3]))
print(json.dumps({'seconds': time.perf_counter() - start, 'tokens': info['tokens'], 'rss_mb': peak_mb(),
                  'worker_rss_mb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
'''


def run(script: str, *args) -> dict:
    out = subprocess.run([sys.executable, '-c', script, *map(str, args)], capture_output=True, text=True, check=True,
                         cwd=pathlib.Path(__file__).parent.parent)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--megabytes', type=int, default=200)
    parser.add_argument('--processes', default='1,2')
    parser.add_argument('--rounds', type=int, default=2)
    args = parser.parse_args()
    folder = build(args.megabytes)
    size = int((folder / 'done').read_text())
    print(f'CPU: {cpu()}')
    print(f'corpus: {size / 1e6:.0f} MB of Python standard-library sources in {folder}')
    out = CACHE / 'corpus.bin'
    counts = list(map(int, args.processes.split(',')))
    best, peaks = {}, {}  # each side's fastest round, and its peak RSS over every round
    for _ in range(args.rounds):
        for side in [0] + counts:  # 0: tiktoken
            result = run(TIKTOKEN, folder) if side == 0 else run(OURS, folder, out, side)
            if side not in best or result['seconds'] < best[side]['seconds']:
                best[side] = result
            peaks[side] = max(peaks.get(side, 0), result['rss_mb'], result.get('worker_rss_mb', 0))
    base = best[0]
    print(f'{"encoder":<34}{"seconds":>9}{"MB/s":>8}{"tokens/s":>12}{"x tiktoken":>12}{"peak RSS MB":>13}')
    print(f'{"tiktoken encode_ordinary, 1 proc":<34}{base["seconds"]:>9.1f}{size / 1e6 / base["seconds"]:>8.1f}'
          f'{base["tokens"] / base["seconds"]:>12,.0f}{1.0:>12.2f}{peaks[0]:>13.0f}')
    for processes in counts:
        ours = best[processes]
        assert ours['tokens'] == base['tokens'], (ours['tokens'], base['tokens'])
        peak = peaks[processes]
        print(f'{f"encode_corpus, {processes} process(es)":<34}{ours["seconds"]:>9.1f}'
              f'{size / 1e6 / ours["seconds"]:>8.1f}{ours["tokens"] / ours["seconds"]:>12,.0f}'
              f'{base["seconds"] / ours["seconds"]:>12.2f}{peak:>13.0f}')
    out.unlink(missing_ok=True)
    pathlib.Path(str(out) + '.json').unlink(missing_ok=True)


if __name__ == '__main__':
    main()
