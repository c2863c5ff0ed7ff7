"""Load test of the completions server on 127.0.0.1, bounded request counts, the CPU named.

    python bench/bench_serve.py [--requests 64] [--max-tokens 32] [--parts levels,mixed,behind] [--model-dir DIR]

Starts `gpt2-tf serve` in a subprocess (the 124M-shaped random checkpoint by
default), warms it up, then runs through the official openai client:

- levels: for 1, 8 and 32 concurrent clients, --requests completions of
  --max-tokens tokens each; requests/s, generated tokens/s, p50/p99 latency;
- mixed: 24 concurrent clients, one request each for 16 to 256 tokens (seeded
  lengths), temperature 0.8; generated tokens/s and the wall time (requests
  unfinished after --deadline seconds count no tokens);
- behind: a 16-token request's latency alone (median of 3), then the same
  request sent while one 400-token completion streams; the ratio of the two.

Every response is checked: well-formed, the asked number of tokens (or a stop).
"""

import argparse
import concurrent.futures
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))


def start_server(folder: str, max_batch: int) -> tuple:
    """A `gpt2-tf serve` subprocess on a free port, once it accepts connections: (process, port)."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, '-m', 'gpt2_tf.cli', 'serve', '--model_dir', folder, '--port',
                               str(port), '--max-batch', str(max_batch), '--queue-size', '512'],
                              stderr=subprocess.DEVNULL, env=dict(os.environ))
    deadline = time.monotonic() + 300
    while True:
        try:
            socket.create_connection(('127.0.0.1', port), timeout=1).close()
            return server, port
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise SystemExit('the server did not start')
            time.sleep(0.5)


class Bench:
    """Requests through one openai client; each returns (seconds, completion tokens) and checks its answer."""

    def __init__(self, client, model: str):
        self.client, self.model = client, model

    def one(self, i: int, max_tokens: int, temperature: float = 1.0) -> tuple:
        start = time.perf_counter()
        done = self.client.completions.create(model=self.model, prompt=f'Request number {i}: once upon a time',
                                              max_tokens=max_tokens, seed=i, temperature=temperature)
        choice = done.choices[0]
        assert choice.finish_reason in ('length', 'stop') and isinstance(choice.text, str)
        assert done.usage.completion_tokens == max_tokens or choice.finish_reason == 'stop'
        return time.perf_counter() - start, done.usage.completion_tokens

    def warm_up(self, max_batch: int, max_tokens: int) -> None:
        """Compiles the step for each width the levels will use (1, 2, 4, ... max_batch slots)."""
        size = 1
        while size <= max_batch:
            with concurrent.futures.ThreadPoolExecutor(size) as pool:
                list(pool.map(lambda i: self.one(i, max_tokens), range(size)))
            size *= 2

    def levels(self, concurrency, requests: int, max_tokens: int) -> None:
        print(f'{"clients":>8}{"requests/s":>12}{"tokens/s":>10}{"p50 s":>8}{"p99 s":>8}  check')
        for level in concurrency:
            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(level) as pool:
                results = list(pool.map(lambda i: self.one(i, max_tokens), range(requests)))
            elapsed = time.perf_counter() - start
            latency = sorted(r[0] for r in results)
            tokens = sum(r[1] for r in results)
            p99 = latency[min(len(latency) - 1, int(0.99 * len(latency)))]
            print(f'{level:>8}{len(results) / elapsed:>12.2f}{tokens / elapsed:>10.1f}'
                  f'{statistics.median(latency):>8.2f}{p99:>8.2f}  {len(results)}/{requests} well-formed', flush=True)

    def mixed(self, deadline: float, clients: int = 24, shortest: int = 16, longest: int = 256) -> None:
        """Concurrent clients, one request each, for seeded lengths in [shortest, longest], temperature 0.8.

        Requests unfinished after `deadline` seconds count no tokens (the rate is then a lower bound)."""
        lengths = np.random.default_rng(0).integers(shortest, longest + 1, clients)
        start = time.perf_counter()
        pool = concurrent.futures.ThreadPoolExecutor(clients)
        futures = [pool.submit(self.one, i, int(lengths[i]), 0.8) for i in range(clients)]
        done, _ = concurrent.futures.wait(futures, timeout=deadline)
        elapsed = time.perf_counter() - start
        pool.shutdown(wait=False, cancel_futures=True)
        results = [f.result() for f in done]
        tokens = sum(r[1] for r in results)
        late = f'; {clients - len(done)} unfinished after {deadline:.0f} s' if len(done) < clients else ''
        print(f'mixed: {clients} clients, {shortest}-{longest} tokens (asked {int(lengths.sum()):,}), temperature 0.8: '
              f'{tokens:,} tokens in {elapsed:.1f} s = {tokens / elapsed:.1f} tokens/s; p50 '
              f'{statistics.median(r[0] for r in results) if results else float("nan"):.2f} s, longest '
              f'{max((r[0] for r in results), default=float("nan")):.2f} s{late}', flush=True)

    def behind(self, short: int = 16, long: int = 400) -> None:
        """A short request's latency alone, then behind one long streamed completion that is already running."""
        alone = statistics.median(self.one(1000 + i, short, 0.0)[0] for i in range(3))
        stream = self.client.completions.create(model=self.model, prompt='A long story: once upon a time',
                                                max_tokens=long, seed=1, temperature=1.0, stream=True)
        chunks = iter(stream)
        next(chunks)  # the long completion is decoding now
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(self.one, 2000, short, 0.0)
            rest = sum(1 for _ in chunks)  # drain the long stream meanwhile
            during = waiting.result()[0]
        print(f'behind: a {short}-token request alone {alone:.2f} s; while a {long}-token completion runs '
              f'{during:.2f} s = {during / alone:.1f}x alone ({rest + 1} chunks streamed)', flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--requests', type=int, default=64, help='completions per concurrency level')
    parser.add_argument('--max-tokens', type=int, default=32)
    parser.add_argument('--concurrency', default='1,8,32')
    parser.add_argument('--parts', default='levels,mixed,behind', help='which runs, of levels, mixed and behind')
    parser.add_argument('--model-dir', default=None)
    parser.add_argument('--max-batch', type=int, default=16)
    parser.add_argument('--deadline', type=float, default=600, help='seconds the mixed run may take')
    args = parser.parse_args()
    parts = set(args.parts.split(','))

    import openai

    from bench_generate import checkpoint, cpu
    folder = args.model_dir or str(checkpoint())
    server, port = start_server(folder, args.max_batch)
    try:
        client = openai.OpenAI(base_url=f'http://127.0.0.1:{port}/v1', api_key='none', max_retries=0,
                               timeout=args.deadline + 1200)
        bench = Bench(client, os.path.basename(os.path.normpath(folder)))
        print(f'CPU: {cpu()}')
        print(f'model {folder}, {args.requests} requests per level, max_tokens {args.max_tokens}, '
              f'server --max-batch {args.max_batch}', flush=True)
        bench.warm_up(args.max_batch, args.max_tokens)
        if 'levels' in parts:
            bench.levels(list(map(int, args.concurrency.split(','))), args.requests, args.max_tokens)
        if 'behind' in parts:
            bench.behind()
        if 'mixed' in parts:
            bench.mixed(args.deadline)
    finally:
        server.terminate()  # uvicorn waits for open requests to end; unfinished ones are killed with it
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()  # the mixed run's unfinished requests then fail, and their threads end


if __name__ == '__main__':
    main()
