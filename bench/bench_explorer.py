"""The explorer page for a 124M-shaped checkpoint: its size, and its load and block-switch time in Chromium.

    python bench/bench_explorer.py [--loads 7]

Uses bench_generate's 124M-shaped random checkpoint and Debian's chromium
through Playwright (no browser download). The load time is the navigation's
loadEventEnd, which includes the page script's drawing of the first block.
"""

import argparse
import pathlib
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from bench_generate import checkpoint, cpu  # noqa: E402

import gpt2_tf  # noqa: E402
from gpt2_tf.encoder import get_encoder  # noqa: E402
from gpt2_tf.explorer import write_report  # noqa: E402

PROMPT = 'The quick brown fox jumps over the lazy dog and keeps on running far away now'
SWITCH = '''() => { const s = document.getElementById('block'); const t = performance.now();
    s.value = '11'; s.dispatchEvent(new Event('change')); document.body.offsetHeight; return performance.now() - t; }'''


def main() -> None:
    from playwright.sync_api import sync_playwright

    parser = argparse.ArgumentParser()
    parser.add_argument('--loads', type=int, default=7)
    args = parser.parse_args()
    folder = checkpoint()
    model = gpt2_tf.load_model(folder)
    path = pathlib.Path(write_report(model, get_encoder(), PROMPT, str(pathlib.Path(tempfile.mkdtemp()) / 'page.html'),
                                     model_dir=str(folder)))
    print(f'CPU: {cpu()}')
    print(f'page: {path.stat().st_size:,} bytes ({len(get_encoder().encode(PROMPT))}-token prompt)')
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which('chromium'), args=['--no-sandbox'])
        loads, switches = [], []
        for _ in range(args.loads):
            page = browser.new_page(viewport={'width': 1320, 'height': 1000})
            page.goto(path.as_uri(), wait_until='load')
            loads.append(page.evaluate('() => performance.getEntriesByType("navigation")[0].loadEventEnd'))
            switches.append(page.evaluate(SWITCH))
            page.close()
        browser.close()
    print(f'load and draw: {min(loads):.0f}-{max(loads):.0f} ms, median {statistics.median(loads):.0f} ms')
    print(f'switching to block h11: median {statistics.median(switches):.0f} ms')


if __name__ == '__main__':
    main()
