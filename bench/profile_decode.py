"""Where a compiled sampling call's time goes: XLA's own per-thunk timings, read from TensorFlow's profiler.

    python bench/profile_decode.py [--batch 8] [--dtype float32] [--new 64] [--top 20]

Runs greedy sampling on the 124M-shaped random checkpoint (16-token prompts, --new tokens), times
two calls after a first, then profiles one more. XLA on CPU records each thunk it runs (a fusion,
a dot, a custom call such as the float32 or int8 kernel) on the thread that ran it; this prints
the thunks' total time grouped by kind (the name before its first '.'), and the profiled call's
span against the time some thunk was running (the rest is gaps: waits, the loop's own work). A
while loop's thunk, which holds its body's, is left out.
A custom call's time includes its helper threads' work, which the profiler does not see.
"""

import argparse
import collections
import os
import pathlib
import sys
import tempfile
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
sys.path.insert(0, str(pathlib.Path(__file__).parent))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.tsl.profiler.protobuf import xplane_pb2  # noqa: E402

import gpt2_tf  # noqa: E402
from gpt2_tf.sample import sample_sequence  # noqa: E402
from bench_generate import checkpoint, cpu  # noqa: E402

CONTAINERS = ('while',)  # thunks that hold others (a loop's body): left out, their body's thunks count


def thunk_events(folder: str):
    """(kind, start ps, end ps) of every thunk the profile in folder recorded, on whichever thread ran it (XLA
    runs some on the calling thread). A thunk is what XLA also marks with an 'end: <name>' event."""
    path = next(pathlib.Path(folder).rglob('*.xplane.pb'))
    space = xplane_pb2.XSpace.FromString(path.read_bytes())
    for plane in space.planes:
        names = {key: meta.name for key, meta in plane.event_metadata.items()}
        thunks = {name[len('end: '):] for name in names.values() if name.startswith('end: ')}
        for line in plane.lines:
            for event in line.events:
                name = names.get(event.metadata_id, '?')
                if name in thunks and not name.startswith(CONTAINERS):
                    start = line.timestamp_ns * 1000 + event.offset_ps
                    yield name.split('.')[0], start, start + event.duration_ps


def covered(intervals) -> int:
    """The length of the union of (start, end) intervals."""
    total, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total, end = total + stop - start, stop
        elif stop > end:
            total, end = total + stop - end, stop
    return total


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--batch', type=int, default=8)
    parser.add_argument('--dtype', default='float32')
    parser.add_argument('--new', type=int, default=64)
    parser.add_argument('--top', type=int, default=20)
    args = parser.parse_args()
    print(f'CPU: {cpu()}')
    model = gpt2_tf.load_model(checkpoint(), dtype=args.dtype)
    prompt = np.random.default_rng(0).integers(0, model.hparams.n_vocab, (args.batch, 16), dtype=np.int32)

    def run():
        start = time.perf_counter()
        sample_sequence(model, args.new, context=prompt, top_k=1)
        return (time.perf_counter() - start) * 1e3

    run()
    print('unprofiled calls: ' + ', '.join(f'{run():.0f} ms' for _ in range(2)))
    with tempfile.TemporaryDirectory() as folder:
        tf.profiler.experimental.start(folder)
        ms = run()
        tf.profiler.experimental.stop()
        events = list(thunk_events(folder))
    total, count = collections.Counter(), collections.Counter()
    for kind, start, end in events:
        total[kind] += end - start
        count[kind] += 1
    span = max(end for _, _, end in events) - min(start for _, start, _ in events)
    busy = covered([(start, end) for _, start, end in events])
    print(f'profiled call: {ms:.0f} ms; thunks span {span / 1e9:.0f} ms, some thunk running for '
          f'{busy / 1e9:.0f} ms ({busy / span:.0%}); per step of {args.new}:')
    for kind, ps in total.most_common(args.top):
        print(f'  {kind:<32} {count[kind]:>6} runs {ps / 1e9:9.1f} ms  {ps / 1e9 / args.new:7.2f} ms a step')


if __name__ == '__main__':
    main()
