"""The explorer page: its size, write time and memory, and its times in Chromium, 124M-shaped and 48 blocks deep.

    python bench/bench_explorer.py [--tokens 16 341] [--loads 7] [--writes 3]

Uses bench_generate's 124M-shaped random checkpoint (and a 48-block, 25-head
one of width 50, 1558M's depth, for a 16-token page) and Debian's chromium
through Playwright (no browser download). Per prompt length (16 tokens, and
341, the most a 124M page takes): the page's bytes; write_report's time (after
a first write that traces the model); for 124M, the peak RSS of a fresh process
that loads the model and runs explore() once; and in Chromium, per load:

- load and draw: the navigation's loadEventEnd, which includes the script's
  drawing of the first block;
- switching block: picking h11 in the selector, to the layout after it (the
  Attention panel closed, as the page opens);
- opening Attention: clicking its node, until the maps of the block shown are
  drawn and two frames have passed (painted);
- switching block with Attention open: from h11 to h0, until its maps are
  drawn and painted.
"""

import argparse
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from bench_generate import checkpoint, cpu  # noqa: E402

import numpy as np  # noqa: E402

import gpt2_tf  # noqa: E402
from gpt2_tf.encoder import get_encoder  # noqa: E402
from gpt2_tf.explorer import explore, write_report  # noqa: E402

PROMPT = 'The quick brown fox jumps over the lazy dog and keeps on running far away now'  # 16 tokens
SWITCH = '''() => { const s = document.getElementById('block'); const t = performance.now();
    s.value = '11'; s.dispatchEvent(new Event('change')); document.body.offsetHeight; return performance.now() - t; }'''
# Opens the Attention panel (block null) or picks a block; ms until the block's last map is drawn, then two frames.
ATTENTION = '''async ([block, heads]) => {
  const frame = () => new Promise(r => requestAnimationFrame(r)), s = document.getElementById('block');
  const t = performance.now();
  if (block === null) document.querySelector('#diagram a.node[data-panel="attn"]').dispatchEvent(
    new MouseEvent('click', {bubbles: true, cancelable: true}));
  else { s.value = String(block); s.dispatchEvent(new Event('change')); }
  const last = `h${s.value} head ${heads - 1}`;
  while (!document.getElementById('view-attn').textContent.includes(last)) await frame();
  await frame();
  await frame();
  return performance.now() - t;
}'''


def prompt(tokens: int) -> str:
    """PROMPT, repeated and cut to exactly tokens tokens."""
    encoder = get_encoder()
    text = encoder.decode(encoder.encode(' '.join([PROMPT] * (tokens // 16 + 1)))[:tokens])
    assert len(encoder.encode(text)) == tokens, tokens
    return text


def peak_rss() -> int:
    """This process's peak RSS in MB: VmHWM, which starts afresh at exec (ru_maxrss keeps the parent's)."""
    status = pathlib.Path('/proc/self/status').read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith('VmHWM:'))) // 1024


def explore_rss(tokens: int) -> None:
    """In a fresh process: the peak RSS after loading the model, then after one explore()."""
    model = gpt2_tf.load_model(checkpoint())
    loaded = peak_rss()
    explore(model, np.array(get_encoder().encode(prompt(tokens))))
    print(loaded, peak_rss())


def browse(path: pathlib.Path, loads: int, heads: int) -> dict:
    from playwright.sync_api import sync_playwright

    times = {'load and draw': [], 'switching block': [], 'opening Attention': [],
             'switching block with Attention open': []}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which('chromium'), args=['--no-sandbox'])
        for _ in range(loads):
            page = browser.new_page(viewport={'width': 1320, 'height': 1000})
            page.goto(path.as_uri(), wait_until='load', timeout=600_000)
            times['load and draw'].append(page.evaluate('() => performance.getEntriesByType("navigation")[0]'
                                                        '.loadEventEnd'))
            times['switching block'].append(page.evaluate(SWITCH))
            times['opening Attention'].append(page.evaluate(ATTENTION, [None, heads]))
            times['switching block with Attention open'].append(page.evaluate(ATTENTION, [0, heads]))
            page.close()
        browser.close()
    return times


def deep_checkpoint() -> pathlib.Path:
    """1558M's blocks and heads (48, 25) at a narrow width, written once into bench/.cache/."""
    folder = checkpoint().parent / '48x25-random'
    if not (folder / 'checkpoint').exists():
        from support import write_random_checkpoint  # tests/, on the path through bench_generate

        hparams = gpt2_tf.HParams(n_vocab=50257, n_ctx=64, n_embd=50, n_head=25, n_layer=48)
        write_random_checkpoint(folder, hparams, seed=0, scale=0.05, meta_graph=False)
    return folder


def bench(name: str, folder: pathlib.Path, tokens: int, args, out: pathlib.Path) -> None:
    model = gpt2_tf.load_model(folder)
    write_report(model, get_encoder(), PROMPT, str(out / 'first.html'), model_dir=str(folder))  # traces the model
    text, path = prompt(tokens), out / f'{folder.name}-{tokens}.html'
    writes = []
    for _ in range(args.writes):
        start = time.perf_counter()
        write_report(model, get_encoder(), text, str(path), model_dir=str(folder))
        writes.append(time.perf_counter() - start)
    print(f'\n{name}, {tokens} tokens: page {path.stat().st_size:,} bytes; write_report median '
          f'{statistics.median(writes):.2f} s ({", ".join(f"{w:.2f}" for w in writes)})')
    if folder == checkpoint():
        rss = subprocess.run([sys.executable, __file__, '--rss', str(tokens)], capture_output=True, text=True,
                             check=True).stdout.split()
        print(f'  explore(): peak RSS {rss[-1]} MB in a fresh process ({rss[-2]} MB once the model is loaded)')
    for what, values in browse(path, args.loads, model.hparams.n_head).items():
        print(f'  {what}: median {statistics.median(values):.0f} ms ({min(values):.0f}-{max(values):.0f} ms, '
              f'{len(values)} loads)')


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--tokens', type=int, nargs='+', default=[16, 341])
    parser.add_argument('--loads', type=int, default=7)
    parser.add_argument('--writes', type=int, default=3)
    parser.add_argument('--rss', type=int, help=argparse.SUPPRESS)  # the child process of explore_rss
    args = parser.parse_args()
    if args.rss:
        return explore_rss(args.rss)
    print(f'CPU: {cpu()}')
    with tempfile.TemporaryDirectory() as out:
        for tokens in args.tokens:
            bench('124M-shaped', checkpoint(), tokens, args, pathlib.Path(out))
        bench('48 blocks x 25 heads (n_embd 50)', deep_checkpoint(), 16, args, pathlib.Path(out))


if __name__ == '__main__':
    main()
