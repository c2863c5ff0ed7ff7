"""The explorer: its numbers against the model and trace, and the page as a person sees it, in headless Chromium."""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import gpt2_tf
from gpt2_tf.assets import bundled_checkpoint
from gpt2_tf.diagnostics import trace
from gpt2_tf.encoder import get_encoder
from gpt2_tf.explorer import explore, token_label, write_report

from conftest import FIXTURES, assert_close

PROMPT = "Hello, I'm a language model, not a café"


@pytest.fixture(scope='module')
def model():
    return gpt2_tf.load_model(bundled_checkpoint())


def test_the_logit_lens_at_the_last_layer_is_the_models_own_prediction(model):
    tokens = gpt2_tf.encode(PROMPT)
    found = explore(model, tokens)
    probs = tf.nn.softmax(model(np.array([tokens]))['logits'][0], axis=-1).numpy()  # [T, vocab]
    top = np.argsort(-probs, axis=-1, kind='stable')[:, :5]
    np.testing.assert_array_equal(found['lens_ids'][-1], top)
    assert_close(found['lens_probs'][-1], np.take_along_axis(probs, top, -1), 'last-layer lens')
    np.testing.assert_array_equal(found['next_ids'], np.argsort(-probs[-1], kind='stable')[:10])
    assert_close(found['prompt_log_probs'], gpt2_tf.score(model, [tokens])[0], 'prompt log-probs')


def test_residual_norms_and_attention_are_trace_s(fixture_dir):
    model = gpt2_tf.load_model(fixture_dir)
    tokens = np.load(fixture_dir / 'reference.npz')['tokens'][0, :12]
    found = explore(model, tokens)
    states = trace(model, tokens[None], attention_weights=True)
    for layer, block in enumerate(states):
        for q, name in enumerate(['x', 'attn', 'x_attn', 'mlp', 'out']):
            np.testing.assert_allclose(found['residual_norms'][layer, :, q],
                                       np.linalg.norm(block[name][0], axis=-1), rtol=1e-6)
        np.testing.assert_array_equal(found['attention'][layer], block['attn_weights'][0])
    hp = model.hparams
    assert found['residual_norms'].shape == (hp.n_layer, 12, 5)
    assert found['attention'].shape == (hp.n_layer, hp.n_head, 12, 12)
    assert found['lens_ids'].shape == found['lens_probs'].shape == (hp.n_layer, 12, 5)


def test_token_labels_show_spaces_and_stray_bytes():
    encoder = get_encoder()
    assert token_label(encoder, encoder.encode(' world')[0]) == '·world'
    stray = encoder.encoder[encoder.byte_encoder[0xe3]]  # the first byte of a three-byte character, alone
    assert token_label(encoder, stray) == '\\xe3'
    assert token_label(encoder, encoder.encode('<b>')[0]) == '<'  # HTML-escaped where the page writes it


@pytest.mark.parametrize('argv, message', [
    (['--prompt', ''], '--prompt is empty'),
    (['--prompt', 'word ' * 200], '--prompt has 201 tokens, more than n_ctx = 128'),
    (['--prompt', 'Hi', '-o', '/nonexistent/report.html'], 'cannot write /nonexistent/report.html'),
])
def test_bad_input_is_one_line(argv, message, tmp_path):
    done = subprocess.run([sys.executable, '-m', 'gpt2_tf.cli', 'explore', bundled_checkpoint(), *argv],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and message in done.stderr


# --- the page in a real browser --------------------------------------------------------------------

def chromium():
    path = shutil.which('chromium') or shutil.which('chromium-browser')
    if path is None:
        if os.environ.get('CI') == 'true':
            pytest.fail('chromium is missing, and CI installs it (.ci/run)')
        pytest.skip('no chromium installed (apt install chromium)')
    return path


# Reports each figure's box into the page, for the test's copy only (the report itself has no script).
MEASURE = '''<script>
document.body.insertAdjacentHTML('beforeend', '<pre id="boxes">' + JSON.stringify(
  Array.from(document.querySelectorAll('svg.figure')).map(e => {
    const r = e.getBoundingClientRect(); return [r.left, r.top + window.scrollY, r.width, r.height]; })) + '</pre>');
</script>'''


def page_requests(net_log) -> list:
    """The URLs a page requested, from a Chromium net log (a file that may lack its closing brackets)."""
    text = net_log.read_text()
    try:
        log = json.loads(text)
    except ValueError:
        log = json.loads(text.rstrip().rstrip(',') + ']}')
    names = {number: name for name, number in log['constants']['logEventTypes'].items()}
    return [e['params']['url'] for e in log['events'] if names[e['type']] == 'URL_REQUEST_START_JOB'
            and 'url' in e.get('params', {}) and e['params'].get('initiator') != 'not an origin']


def test_the_network_check_sees_a_page_that_loads_from_a_cdn(tmp_path):
    page = tmp_path / 'cdn.html'
    page.write_text('<html><body><script src="https://cdn.example.com/lib.js"></script>hi</body></html>')
    browse(page, tmp_path, '--dump-dom', f'--log-net-log={tmp_path / "net.json"}')
    assert page_requests(tmp_path / 'net.json') == ['https://cdn.example.com/lib.js']


def browse(page, tmp_path, *flags):
    profile = tmp_path / f'profile-{len(flags)}'
    return subprocess.run([chromium(), '--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
                           '--disable-background-networking', '--disable-component-update', '--disable-sync',
                           f'--user-data-dir={profile}', '--window-size=1280,6000', '--virtual-time-budget=5000',
                           *flags, page.as_uri()], capture_output=True, text=True, timeout=180)


def test_the_report_in_headless_chromium(model, tmp_path):
    from PIL import Image

    report = tmp_path / 'report.html'
    write_report(model, get_encoder(), PROMPT, str(report), model_dir=bundled_checkpoint())
    size = report.stat().st_size
    hp = model.hparams
    # The page as the browser builds it: every section, every figure, the predictions as text.
    dom = browse(report, tmp_path, '--dump-dom', f'--log-net-log={tmp_path / "net.json"}').stdout
    for section in ('architecture', 'residual', 'attention', 'lens', 'prediction'):
        assert f'<section id="{section}">' in dom, section
    assert dom.count('<svg class="figure') == 5 + hp.n_layer * hp.n_head
    next_table = re.search(r'<table id="next">(.*?)</table>', dom, re.S).group(1)
    assert next_table.count('<tr>') == 11  # a header and the top 10, as text
    assert 'Hello' in dom and '·café' in dom and 'ln_1' in dom and '1e-5' in dom
    # No network: the net log holds no request that the page made (the links to GitHub are never
    # followed). Chromium's own background requests (time, updates) carry no initiator origin.
    assert not page_requests(tmp_path / 'net.json')
    # A screenshot: no figure region is blank.
    measured = tmp_path / 'measured.html'
    measured.write_text(report.read_text().replace('</body>', MEASURE + '</body>'))
    boxes = json.loads(re.search(r'<pre id="boxes">(.*?)</pre>', browse(measured, tmp_path, '--dump-dom').stdout).group(1))
    assert len(boxes) == 5 + hp.n_layer * hp.n_head
    browse(measured, tmp_path, f'--screenshot={tmp_path / "shot.png"}')
    image = np.asarray(Image.open(tmp_path / 'shot.png').convert('RGB'), np.int32)
    colorful = (image.max(axis=-1) - image.min(axis=-1)) > 40  # plot marks; text and axes are gray
    for left, top, width, height in boxes:
        region = colorful[int(top):int(top + height), int(left):int(left + width)]
        assert region.size and region.mean() > 0.01, f'blank figure at {left, top}: {region.mean():.4f} colored'
    assert size < 5_000_000


@pytest.mark.slow
def test_a_16_token_prompt_on_a_124m_model_stays_under_5_mb(random_checkpoint, tmp_path):
    model = gpt2_tf.load_model(random_checkpoint(gpt2_tf.HParams.named('124M'), scale=0.02))
    prompt = 'The quick brown fox jumps over the lazy dog and keeps on running far away now'
    tokens = get_encoder().encode(prompt)
    assert len(tokens) == 16
    path = write_report(model, get_encoder(), prompt, str(tmp_path / 'r.html'))
    text = (tmp_path / 'r.html').read_text()
    assert text.count('<svg class="figure heatmap"') == 144
    assert os.path.getsize(path) < 5_000_000, os.path.getsize(path)
