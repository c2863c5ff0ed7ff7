"""Fine-tuning on a token file read in place: peak memory against the corpus size, in one run.

    python bench/bench_finetune_memory.py [--megabytes 1,400] [--steps 5] [--rounds 2]

Writes token files of each size into bench/.cache/ (random GPT-2 ids, an
<|endoftext|> every 1,000 tokens, with their sidecar), then fine-tunes the
bundled test checkpoint on each for a few steps (batch 2, a validation split
of 1% by document, no samples or periodic saves), each run a fresh process,
and reports the process's peak RSS (VmHWM: ru_maxrss would carry over this
benchmark's own, TensorFlow loaded, across the exec). The runs are interleaved,
round after round; the table gives each size's largest peak.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).parent))

from bench_generate import cpu  # noqa: E402

CACHE = pathlib.Path(__file__).parent / '.cache'

FINETUNE = '''
import json, sys, time
from gpt2_tf.assets import bundled_checkpoint
from gpt2_tf.train import finetune
start = time.perf_counter()
lines = []
finetune(bundled_checkpoint(), sys.argv[1], steps=int(sys.argv[2]), batch_size=2, accumulate_gradients=1,
         sample_every=0, save_every=0, val_fraction=0.01, val_every=int(sys.argv[2]), val_batch_count=4,
         seed=0, checkpoint_dir=sys.argv[3], restore_from='fresh', log=lines.append)
peak = next(int(line.split()[1]) / 1024 for line in open('/proc/self/status') if line.startswith('VmHWM:'))
print(json.dumps({'seconds': time.perf_counter() - start, 'rss_mb': peak, 'last': lines[-2]}))
'''


def token_file(megabytes: int) -> pathlib.Path:
    """bench/.cache/tokens-<MB>.bin: random ids, written a block at a time (this process stays small too)."""
    import numpy as np

    from gpt2_tf import corpus
    from gpt2_tf.encoder import get_encoder

    path = CACHE / f'tokens-{megabytes}.bin'
    if os.path.exists(str(path) + corpus.SIDECAR):
        return path
    CACHE.mkdir(exist_ok=True)
    total, block = megabytes * 500_000, 1 << 22  # 2 bytes a token
    rng = np.random.default_rng(0)
    with open(path, 'wb') as f:
        for at in range(0, total, block):
            ids = rng.integers(0, 50256, min(block, total - at), dtype=np.uint16)
            ids[999::1000] = 50256  # a document every 1,000 tokens
            ids.astype('<u2').tofile(f)
    sidecar = {'dtype': 'uint16', 'n_vocab': 50257, 'vocab_sha256': corpus.vocabulary_sha256(get_encoder()),
               'tokens': total, 'documents': total // 1000, 'end_of_text': 50256}
    pathlib.Path(str(path) + corpus.SIDECAR).write_text(json.dumps(sidecar, indent=2) + '\n')
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--megabytes', default='1,400')
    parser.add_argument('--steps', type=int, default=5)
    parser.add_argument('--rounds', type=int, default=2)
    args = parser.parse_args()
    sizes = list(map(int, args.megabytes.split(',')))
    files = {size: token_file(size) for size in sizes}
    print(f'CPU: {cpu()}')
    peaks, seconds = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for size in sizes:
                done = subprocess.run([sys.executable, '-c', FINETUNE, str(files[size]), str(args.steps), tmp],
                                      capture_output=True, text=True, cwd=pathlib.Path(__file__).parent.parent)
                if done.returncode:
                    raise SystemExit(done.stderr[-3000:])
                result = json.loads(done.stdout.strip().splitlines()[-1])
                peaks[size] = max(peaks.get(size, 0), result['rss_mb'])
                seconds[size] = min(seconds.get(size, float('inf')), result['seconds'])
    base = peaks[sizes[0]]
    print(f'finetune, bundled test checkpoint, {args.steps} steps of batch 2, 1% validation split, '
          f'largest peak of {args.rounds} interleaved rounds')
    print(f'{"token file":>12}{"peak RSS MB":>14}{"vs smallest":>14}{"seconds":>10}')
    for size in sizes:
        print(f'{size:>9} MB{peaks[size]:>14.0f}{peaks[size] - base:>+14.0f}{seconds[size]:>10.1f}')


if __name__ == '__main__':
    main()
