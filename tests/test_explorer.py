"""The explorer: its numbers against the model and trace, and the page as a person sees it, in headless Chromium."""

import json
import pathlib
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

from conftest import FIXTURES, assert_close, require

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


@pytest.mark.parametrize('rows', [None, 5])  # 2 blocks x 11 tokens: one batch of rows, or 5 at a time and 2 left
def test_the_logit_lens_of_every_block_is_its_output_through_ln_f_and_wte(model, rows, monkeypatch):
    # Worked out here in float64 from the trace and the checkpoint's ln_f and wte, block by block.
    from gpt2_tf.explorer import measure

    if rows:
        monkeypatch.setattr(measure, 'LENS_ROWS', rows)
    tokens = gpt2_tf.encode(PROMPT)
    assert len(tokens) == 11 and model.hparams.n_layer == 2
    found = explore(model, tokens)
    variables = {name: v.numpy().astype(np.float64) for name, v in model.variables_by_name().items()
                 if name in ('model/ln_f/g', 'model/ln_f/b', 'model/wte')}
    for layer, block in enumerate(trace(model, np.array([tokens]))):
        x = block['out'][0].astype(np.float64)  # [T, n_embd]
        z = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
        logits = (z * variables['model/ln_f/g'] + variables['model/ln_f/b']) @ variables['model/wte'].T
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)  # [T, n_vocab]
        top = np.argsort(-probs, axis=-1, kind='stable')[:, :5]
        np.testing.assert_array_equal(found['lens_ids'][layer], top, f'h{layer}')
        # float32 against float64: the page shows them to 0.1%.
        np.testing.assert_allclose(found['lens_probs'][layer], np.take_along_axis(probs, top, -1), rtol=1e-4,
                                   err_msg=f'h{layer}')
    np.testing.assert_array_equal(found['next_ids'], np.argsort(-probs[-1], kind='stable')[:10])
    np.testing.assert_allclose(found['next_probs'], np.sort(probs[-1])[::-1][:10], rtol=1e-4)


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


def test_an_int8_model_shows_its_dequantized_embeddings_and_the_checkpoints_parameters(model, tmp_path):
    tokens = gpt2_tf.encode(PROMPT)
    int8 = gpt2_tf.load_model(bundled_checkpoint(), dtype='int8')
    norms = [explore(m, tokens)['embedding_norms'][:, 0] for m in (model, int8)]  # |wte[token]|
    np.testing.assert_allclose(norms[1], norms[0], rtol=0.02)  # one scale per row: within rounding
    pages = [pathlib.Path(write_report(m, get_encoder(), PROMPT, str(tmp_path / f'{i}.html'))).read_text()
             for i, m in enumerate((model, int8))]
    assert '<h1>Inside GPT-2: model</h1>' in pages[0] and '<h1>Inside GPT-2: model (int8 weights)</h1>' in pages[1]
    totals = [re.search(r'id="total">([^<]*)<', page).group(1) for page in pages]
    assert totals[0] == totals[1] == f'{sum(int(np.prod(v.shape)) for v in model.variables):,}'


def test_a_prompt_from_undecodable_bytes_shows_the_replacement_character(model, tmp_path):
    page = pathlib.Path(write_report(model, get_encoder(), 'caf\udce9 au lait', str(tmp_path / 'p.html')))
    assert 'caf\ufffd au lait' in page.read_text(encoding='utf-8')


def test_token_labels_show_spaces_and_stray_bytes():
    encoder = get_encoder()
    assert token_label(encoder, encoder.encode(' world')[0]) == '·world'
    stray = encoder.encoder[encoder.byte_encoder[0xe3]]  # the first byte of a three-byte character, alone
    assert token_label(encoder, stray) == '\\xe3'
    assert token_label(encoder, encoder.encode('<b>')[0]) == '<'  # HTML-escaped where the page writes it
    assert [token_label(encoder, encoder.encode(c)[0]) for c in '\x00\r\n\t'] == ['\\x00', '\\x0d', '\\n', '\\t']
    assert [token_label(encoder, encoder.encode(c)[0]) for c in '\u200b\u00ad'] == ['\\u200b', '\\u00ad']  # invisible
    assert token_label(encoder, 50300) == '⟨id 50300⟩'  # a padded vocabulary's row: no text of its own
    assert token_label(encoder, encoder.encode('\u00a0')[0]) == '\\u00a0'  # a separator that is not the space


def test_a_right_to_left_override_in_the_prompt_reorders_nothing_on_the_page(model, tmp_path):
    page = pathlib.Path(write_report(model, get_encoder(), 'abc \u202edef', str(tmp_path / 'p.html')))
    text = page.read_text(encoding='utf-8')
    assert '\u202e' not in text and 'Prompt: <span class="tok">abc \\u202edef</span>' in text
    assert 'unicode-bidi:isolate' in text  # a token of right-to-left text keeps to its own box


def test_the_pages_data_holds_no_angle_bracket_that_could_end_or_hide_its_script(model):
    from gpt2_tf.explorer.page import page_data

    found = explore(model, gpt2_tf.encode('Hi there'))
    data = page_data(model, found, ['<!--<script>', '</script>'])
    assert '<' not in data and json.loads(data)['tokens'] == ['<!--<script>', '</script>']


def test_one_block_draws_a_dot_per_token_across_the_blocks():
    from gpt2_tf.explorer.figures import line_chart

    assert line_chart(np.ones([1, 2]), ['a', 'b'], 'norms').count('<circle') == 2
    assert line_chart(np.ones([3, 2]), ['a', 'b'], 'norms').count('<circle') == 0


def test_explore_names_a_batch_or_text_and_activations_that_are_not_finite(model):
    with pytest.raises(gpt2_tf.GPT2Error, match=r"explore takes one prompt's token ids, int \[T\]; got int64 of shape"):
        explore(model, [[464, 2068]])
    with pytest.raises(gpt2_tf.GPT2Error, match="explore takes one prompt's token ids"):
        explore(model, 'hello')
    broken = gpt2_tf.load_model(bundled_checkpoint())
    bias = broken.variables_by_name()['model/h1/mlp/c_proj/b']
    bias.assign(tf.tensor_scatter_nd_update(bias, [[0]], [np.inf]))
    with pytest.raises(gpt2_tf.GPT2Error, match='not finite from block h1 on .*--dtype float32'):
        explore(broken, gpt2_tf.encode('Hi there'))
    bias.assign(tf.tensor_scatter_nd_update(bias, [[0]], [1e25]))  # finite, but its norms overflow float32
    with pytest.raises(gpt2_tf.GPT2Error, match='residual_norms is not finite from block h1 on .*--dtype float32'):
        explore(broken, gpt2_tf.encode('Hi there'))
    bias.assign(tf.tensor_scatter_nd_update(bias, [[0]], [0.0]))
    gain = broken.variables_by_name()['model/ln_f/g']
    gain.assign(tf.tensor_scatter_nd_update(gain, [[0]], [np.inf]))  # the blocks are fine; the logits are not
    with pytest.raises(gpt2_tf.GPT2Error, match='lens_probs is not finite from block h0 on .*--dtype float32'):
        explore(broken, gpt2_tf.encode('Hi there'))


def test_a_vocabulary_of_fewer_than_five_tokens_is_explored(random_checkpoint, tmp_path):
    small = gpt2_tf.load_model(random_checkpoint(gpt2_tf.HParams(n_vocab=3, n_ctx=16, n_embd=16, n_head=2,
                                                                 n_layer=2), seed=1))
    found = explore(small, [1, 2, 0])
    assert found['next_ids'].shape == (3,) and found['lens_ids'].shape == (2, 3, 3)
    with pytest.raises(gpt2_tf.GPT2Error, match=r"the prompt's token id \d+ is outside the vocabulary \[0, 3\): the "
                                                'vocabulary files hold more tokens than the model'):
        write_report(small, get_encoder(), 'Hello', str(tmp_path / 'p.html'))  # text: not "give other ids"


def test_a_checkpoints_training_state_is_not_counted_as_parameters(model, tmp_path):
    folder = tmp_path / 'with-adam'
    shutil.copytree(bundled_checkpoint(), folder)
    reader = tf.train.load_checkpoint(str(folder / 'model.ckpt'))
    tensors = {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}
    tensors['model/wte/Adam'] = np.zeros_like(tensors['model/wte'])
    gpt2_tf.checkpoint.write_tensors(str(folder / 'model.ckpt'), tensors)
    page = pathlib.Path(write_report(model, get_encoder(), PROMPT, str(tmp_path / 'p.html'), model_dir=str(folder)))
    text = page.read_text(encoding='utf-8')
    total = sum(int(np.prod(v.shape)) for v in model.variables)
    assert re.search(r'id="total">([^<]*)<', text).group(1) == f'{total:,}'
    assert f'{total:,} parameters in {len(model.variables)} tensors; 1 other tensor(s)' in text


def test_a_page_holds_at_most_2_to_the_24_attention_weights():
    from gpt2_tf.validate import check_explorer_prompt

    check_explorer_prompt(118, 48, 25, 1024)  # 1558M's blocks and heads: 118² · 1200 < 2^24
    check_explorer_prompt(341, 12, 12, 1024)  # 124M's
    with pytest.raises(gpt2_tf.GPT2Error, match='at most 341 tokens'):
        check_explorer_prompt(342, 12, 12, 1024)
    with pytest.raises(gpt2_tf.GPT2Error, match='the prompt has 119 tokens, more than an explorer page draws for '
                                                '48 blocks of 25 heads .*: shorten it to at most 118 tokens'):
        check_explorer_prompt(119, 48, 25, 1024)


@pytest.mark.parametrize('argv, message', [
    (['--prompt', ''], '--prompt is empty'),
    (['--prompt', 'word ' * 200], '--prompt has 201 tokens, more than n_ctx = 128: shorten it to at most 128'),
    (['--prompt', 'Hi', '-o', '/nonexistent/report.html'], 'cannot write /nonexistent/report.html'),
    (['--prompt', 'Hi', '-o', '.'], "-o '.' is not a file name: give the page's path, e.g. ./report.html"),
    (['--prompt', 'Hi', '-o', ''], "-o '' is not a file name: give the page's path, e.g. report.html"),
    (['--prompt', 'Hi', '-o', 'new/'], "-o 'new/' is not a file name: give the page's path, e.g. new/report.html"),
    (['--prompt', 'Hi', '-o', 'new/.'], "-o 'new/.' is not a file name: give the page's path, e.g. new/./report.html"),
])
def test_bad_input_is_one_line(argv, message, tmp_path):
    done = subprocess.run([sys.executable, '-m', 'gpt2_tf.cli', 'explore', bundled_checkpoint(), *argv],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and message in done.stderr
    assert not list(tmp_path.iterdir())  # nothing written


# --- the page in a real browser --------------------------------------------------------------------

def chromium():
    path = shutil.which('chromium') or shutil.which('chromium-browser')
    if path is None:
        if os.environ.get('CI') == 'true':
            pytest.fail('chromium is missing, and CI installs it (.ci/run)')
        pytest.skip('no chromium installed (apt install chromium)')
    return path


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
    report = tmp_path / 'report.html'
    write_report(model, get_encoder(), PROMPT, str(report), model_dir=bundled_checkpoint())
    size = report.stat().st_size
    # The page as the browser builds it (its script has drawn block h0): every section, every figure,
    # the predictions as text.
    dom = browse(report, tmp_path, '--dump-dom', f'--log-net-log={tmp_path / "net.json"}').stdout
    dom = re.sub(r'<script.*?</script>', '', dom, flags=re.S)  # what it shows, not what draws it
    for section in ('architecture', 'residual', 'lens', 'prediction', 'panel-attn', 'panel-mlp'):
        assert re.search(f'<section[^>]* id="{section}"', dom), section
    # 5 charts across the blocks and block h0's GELU histogram; the mask and the heads' maps wait for the
    # Attention panel to open (test_the_panels_show_this_prompts_values_block_by_block opens it).
    assert dom.count('<svg class="figure') == 5 + 1
    assert 'class="figure heatmap"' not in dom and '<canvas' not in dom
    next_table = re.search(r'<table id="next">(.*?)</table>', dom, re.S).group(1)
    assert next_table.count('<tr>') == 11  # a header and the top 10, as text
    assert 'Hello' in dom and '·café' in dom and 'ln_1' in dom and '1e-5' in dom
    # No network: the net log holds no request that the page made (the links to GitHub are never
    # followed). Chromium's own background requests (time, updates) carry no initiator origin.
    assert not page_requests(tmp_path / 'net.json')
    assert size < 5_000_000


# --- the page driven in a real browser (Playwright over Debian's chromium; no browser download) --------

NODES = ['Embeddings (wte + wpe)', 'LayerNorm 1', 'Attention', 'dropout (inactive at inference)', 'residual add',
         'LayerNorm 2', 'MLP', 'dropout (inactive at inference)', 'residual add', 'ln_f → logits (tied wte)']
PANELS = {'embeddings', 'ln_1', 'attn', 'ln_2', 'mlp', 'residual', 'ln_f'}
# <math> elements per panel, counted from the formulas a reader expects: LayerNorm's mean and variance, then
# its affine map (x2); attention's projection, masked softmax and output; the MLP and its GELU; the two
# residual adds; the embedding sum; the tied logits.
FORMULAS = 2 + 3 + 2 + 2 + 2 + 1 + 1


@pytest.fixture(scope='module')
def browser():
    sync_api = require('playwright.sync_api')
    with sync_api.sync_playwright() as p:
        launched = p.chromium.launch(executable_path=chromium(), args=['--no-sandbox', '--disable-gpu'])
        yield launched
        launched.close()


def open_page(browser, path, width=1320, height=1000):
    """The page, with every request the page makes beyond its own file recorded (and refused)."""
    page = browser.new_page(viewport={'width': width, 'height': height})
    page.requests, page.errors = [], []
    page.on('pageerror', lambda e: page.errors.append(str(e)))

    def route(r):
        if r.request.url.startswith('file://'):
            return r.continue_()
        page.requests.append(r.request.url)
        return r.abort()

    page.route('**/*', route)
    page.goto(path.as_uri(), wait_until='load')
    return page


def visible_panels(page) -> list:
    return page.eval_on_selector_all('.panel', 'ps => ps.filter(p => p.offsetParent !== null).map(p => p.id)')


def colorful(png: bytes) -> float:
    """The share of an element's pixels that are colored (plot marks; text and axes are gray)."""
    import io

    from PIL import Image

    image = np.asarray(Image.open(io.BytesIO(png)).convert('RGB'), np.int32)
    return float(((image.max(axis=-1) - image.min(axis=-1)) > 40).mean())


# The heatmaps' color of a weight's byte k (k / 255 in [0, 1]) as a canvas pixel's RGBA, written here from the page's
# legend: white to dark blue.
BLUE = [[round(255 - 215 * k / 255), round(255 - 175 * k / 255), round(255 - 75 * k / 255), 255] for k in range(256)]


def pixels(page, selector) -> list:
    """Each canvas's pixels as [[r, g, b, a] per pixel, row by row] per canvas."""
    return page.eval_on_selector_all(selector, 'cs => cs.map(c => { const d = c.getContext("2d").getImageData('
                                     '0, 0, c.width, c.height).data; return Array.from({length: d.length / 4}, '
                                     '(_, k) => Array.from(d.slice(4 * k, 4 * k + 4))); })')


def focused(page) -> str:
    """What has the keyboard focus: a diagram node's label, or the tag and id of the element or its panel."""
    return page.evaluate('() => { const e = document.activeElement; return e.getAttribute("aria-label") || '
                         '`${e.tagName} ${(e.closest("[id]") || {}).id}`; }')


def test_the_diagram_opens_each_panel_and_only_it(model, browser, tmp_path):
    report = pathlib.Path(write_report(model, get_encoder(), PROMPT, str(tmp_path / 'r.html'),
                                       model_dir=bundled_checkpoint()))
    page = open_page(browser, report)
    assert page.evaluate('() => document.activeElement === document.body')  # opening the page moves no focus
    nodes = page.eval_on_selector_all('#diagram a.node', 'ns => ns.map(n => [n.getAttribute("aria-label"), '
                                      'n.dataset.panel, n.getBoundingClientRect().top])')
    by_height = [label for label, _, _ in sorted(nodes, key=lambda n: n[2])]
    assert by_height == NODES  # the block's order, top to bottom
    # Tab and a screen reader take the nodes in that order too: the + nodes between the dropouts and the norms.
    assert [label for label, _, _ in nodes] == NODES
    page.locator('#diagram a.node').first.focus()
    tabbed = [focused(page)]
    for _ in NODES[1:]:
        page.keyboard.press('Tab')
        tabbed.append(focused(page))
    assert tabbed == NODES
    assert page.eval_on_selector_all('#diagram .bypass-label', 'ls => ls.map(l => l.textContent)') == ['residual'] * 2
    assert {panel for _, panel, _ in nodes} == PANELS
    assert page.locator('math').count() == FORMULAS
    for index, (label, panel, _) in enumerate(nodes):
        page.locator('#diagram a.node').nth(index).click()
        assert visible_panels(page) == [f'panel-{panel}'], label
        selected = page.eval_on_selector_all('#diagram .node.selected', 'ns => ns.map(n => n.dataset.panel)')
        assert set(selected) == {panel}, label
        # Not by color alone: the selected nodes (both + nodes for the residual adds) say so, and the panel's
        # heading takes the focus.
        current = page.eval_on_selector_all('#diagram a.node', 'ns => ns.map(n => n.getAttribute("aria-current"))')
        assert current == ['true' if p == panel else None for _, p, _ in nodes], label
        assert focused(page) == f'H2 panel-{panel}', label
        if panel == 'attn':  # its maps are drawn when it first opens
            page.wait_for_selector('#view-attn[data-block="0"]', timeout=10_000)
        for box in page.locator(f'#panel-{panel} math').all():  # MathML laid out natively, not left as text
            assert box.evaluate('m => getComputedStyle(m).display') == 'block math'
            assert box.bounding_box()['width'] > 40 and box.bounding_box()['height'] > 12
        for figure in page.locator(f'#panel-{panel} .figure').all():
            assert colorful(figure.screenshot()) > 0.01, (label, 'a blank figure')
    # By keyboard: focus a node, press Enter; and by the address's fragment.
    page.locator('#diagram a.node[data-panel="ln_2"]').focus()
    page.keyboard.press('Enter')
    assert visible_panels(page) == ['panel-ln_2'] and focused(page) == 'H2 panel-ln_2'
    page.evaluate('() => { location.hash = "#panel-mlp"; }')
    page.wait_for_function('() => document.activeElement.closest("#panel-mlp")', timeout=10_000)
    assert visible_panels(page) == ['panel-mlp'] and focused(page) == 'H2 panel-mlp'
    assert not page.requests and not page.errors, (page.requests, page.errors)


def test_the_panels_show_this_prompts_values_block_by_block(model, browser, tmp_path):
    encoder = get_encoder()
    report = pathlib.Path(write_report(model, encoder, PROMPT, str(tmp_path / 'r.html'),
                                       model_dir=bundled_checkpoint()))
    tokens = encoder.encode(PROMPT)
    states = trace(model, np.array([tokens]), attention_weights=True)
    page = open_page(browser, report)
    hp = model.hparams
    labels = [token_label(encoder, t) for t in tokens]
    T = len(tokens)
    # The attention maps are drawn only once their panel is open, for the block shown: none before.
    page.select_option('#block', '1')
    assert page.locator('canvas').count() == 0
    page.select_option('#block', '0')
    page.locator('#diagram a.node[data-panel="attn"]').click()
    for n in range(hp.n_layer):
        page.select_option('#block', str(n))
        page.wait_for_selector(f'#view-attn[data-block="{n}"]', timeout=10_000)
        s = states[n]
        # The tables show 5 significant digits, at most 4 decimals: rtol and atol 6e-5 (a half step and a little).
        # LayerNorm 2 of block n: each token's mean and variance of x'_n and of ln_2(x'_n).
        rows = page.eval_on_selector_all('#view-ln_2 tr', 'rs => rs.slice(1).map(r => Array.from(r.cells, c => '
                                         'c.textContent))')
        assert [row[0] for row in rows] == labels
        before, after = s['x_attn'][0], s['z2'][0]
        expected = np.stack([before.mean(-1), before.var(-1), after.mean(-1), after.var(-1)], -1)
        shown = np.array([[float(c) for c in row[1:]] for row in rows])
        np.testing.assert_allclose(shown, expected, rtol=6e-5, atol=6e-5)
        # The residual adds: |x_n|, |attention delta|, |x'_n|, |MLP delta|, |x_{n+1}| per token.
        rows = page.eval_on_selector_all('#view-residual tr', 'rs => rs.slice(1).map(r => Array.from(r.cells, c => '
                                         'c.textContent))')
        norms = np.stack([np.linalg.norm(s[k][0], axis=-1) for k in ('x', 'attn', 'x_attn', 'mlp', 'out')], -1)
        shown = np.array([[float(c) for c in row[1:]] for row in rows])
        np.testing.assert_allclose(shown, norms, rtol=6e-5, atol=6e-5)
        # Attention: one map per head, each canvas pixel a cell, colored by the weight (to the page's 1/255 steps).
        titles = page.eval_on_selector_all('#view-attn .heatmap text:first-child', 'ts => ts.map(t => t.textContent)')
        assert titles == [f'h{n} head {h}' for h in range(hp.n_head)]
        levels = np.round(s['attn_weights'][0] * 255).astype(int)  # [heads, T, T]
        assert pixels(page, '#view-attn canvas') == [[BLUE[k] for k in head.reshape(-1)] for head in levels]
        # In words, for a screen reader: each token's strongest key (the first of equals) and its weight.
        best = levels.argmax(-1)  # [heads, T]
        assert page.eval_on_selector_all('#view-attn .sr-only', 'ps => ps.map(p => p.textContent)') == [
            "Each token's strongest key: " + '; '.join(f'{labels[i]} → {labels[best[h, i]]} '
                                                     f'{levels[h, i, best[h, i]] / 255:.3f}' for i in range(T)) + '.'
            for h in range(hp.n_head)]
        # The MLP: the GELU's input is c_fc's output, z2 @ w + b, from the checkpoint's own values.
        w, b = (model.variables_by_name()[f'model/h{n}/mlp/c_fc/{v}'].numpy() for v in 'wb')
        u = s['z2'][0] @ w[0] + b
        a = 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u ** 3)))
        text = ' '.join(page.text_content('#view-mlp').split())
        low, high, share = re.search(r'ranges from (\S+) to (\S+); (\S+)% of the activations have \|GELU\(u\)\| '
                                     r'< 0.01', text).groups()
        np.testing.assert_allclose([float(low), float(high)], [u.min(), u.max()], atol=1e-3)
        assert abs(float(share) - 100 * np.mean(np.abs(a) < 0.01)) < 0.051
    legend = page.eval_on_selector_all('#panel-residual .legend .tok', 'ts => ts.map(t => t.textContent)')
    assert legend == labels
    # The mask: 1 where token i may see token j (j <= i).
    assert pixels(page, '#view-mask canvas') == [[BLUE[255 if j <= i else 0] for i in range(T) for j in range(T)]]
    # A cell's numbers: pointing at it, or the arrow keys on a focused map (block h{n_layer - 1} is shown).
    cell = page.locator('#view-attn canvas').first.bounding_box()['width'] / T
    page.locator('#view-attn canvas').nth(1).hover(position={'x': 2.5 * cell, 'y': 3.5 * cell})
    assert page.text_content('#attn-readout') == (f'h{n} head 1: query {labels[3]} (3) → key {labels[2]} (2), '
                                                  f'weight {levels[1, 3, 2] / 255:.3f}')
    page.locator('#view-attn canvas').first.focus()  # the first cell: the first token sees only itself
    first = f'h{n} head 0: query {labels[0]} (0) → key {labels[0]} (0), weight 1.000'
    assert page.text_content('#attn-readout') == first
    for key in ['ArrowDown'] * 6 + ['ArrowRight'] * 4 + ['ArrowUp']:
        page.keyboard.press(key)
    assert page.text_content('#attn-readout') == (f'h{n} head 0: query {labels[5]} (5) → key {labels[4]} (4), '
                                                  f'weight {levels[0, 5, 4] / 255:.3f}')
    page.keyboard.press('ArrowRight')
    page.keyboard.press('ArrowRight')  # a later token: masked
    assert page.text_content('#attn-readout').endswith(f'key {labels[6]} (6), weight 0.000')
    page.locator('#view-mask canvas').hover(position={'x': 0.5 * cell, 'y': 1.5 * cell})
    assert page.text_content('#attn-readout') == f'the causal mask: query {labels[1]} (1) → key {labels[0]} (0), ' \
                                                 'seen (1)'
    assert not page.requests and not page.errors, (page.requests, page.errors)


def test_the_code_is_this_projects_with_its_lines_beside_the_originals(model, tmp_path):
    import inspect

    from gpt2_tf import model as graph

    text = pathlib.Path(write_report(model, get_encoder(), 'Hi', str(tmp_path / 'r.html'))).read_text()
    lines, first = inspect.getsourcelines(graph.MLP)
    caption = f'<code>gpt2_tf/model.py</code>, lines {first}–{first + len(lines) - 1}'
    mlp = re.search(r'<section class="panel" id="panel-mlp">(.*?)</section>', text, re.S).group(1)
    assert caption in mlp and 'return self.c_proj(self.c_fc(x, activation=gelu))' in mlp
    # The original's lines at 9b63575, looked up by hand in openai/gpt-2's src/model.py.
    assert 'https://github.com/openai/gpt-2/blob/9b63575/src/model.py#L115-L120' in mlp
    for panel, lines in [('ln_1', 'L28-L38'), ('attn', 'L58-L112'), ('residual', 'L123-L130'),
                         ('embeddings', 'L152-L157'), ('ln_f', 'L167-L173')]:
        body = re.search(f'<section class="panel" id="panel-{panel}">(.*?)</section>', text, re.S).group(1)
        assert f'src/model.py#{lines}"' in body, panel


@pytest.mark.slow  # minutes: the 48 blocks' random checkpoint and eager trace
def test_48_blocks_of_25_heads_take_a_selector_not_copies(random_checkpoint, browser, tmp_path):
    # 1558M's blocks and heads (48, 25) at a narrow width: the page grows with blocks, heads and tokens, not width.
    hp = gpt2_tf.HParams(n_vocab=50257, n_ctx=64, n_embd=50, n_head=25, n_layer=48)
    model = gpt2_tf.load_model(random_checkpoint(hp, scale=0.05))
    prompt = 'The quick brown fox jumps over the lazy dog and keeps on running far away now'
    report = pathlib.Path(write_report(model, get_encoder(), prompt, str(tmp_path / 'r.html')))
    assert report.stat().st_size < 5_000_000, report.stat().st_size
    page = open_page(browser, report)
    timing = page.evaluate('() => performance.getEntriesByType("navigation")[0].loadEventEnd')
    print(f'\n48 blocks x 25 heads: {report.stat().st_size:,} bytes, loaded and drawn in {timing:.0f} ms')
    assert page.locator('#block option').count() == 48
    page.select_option('#block', '47')
    page.locator('#diagram a.node[data-panel="attn"]').click()
    page.wait_for_selector('#view-attn[data-block="47"]', timeout=30_000)
    titles = page.eval_on_selector_all('#view-attn .heatmap text:first-child', 'ts => ts.map(t => t.textContent)')
    assert titles == [f'h47 head {h}' for h in range(25)]
    assert page.text_content('#diagram .block-number') == 'h47'
    assert not page.requests and not page.errors, (page.requests, page.errors)


# The per-instance accounting, worked by hand for 124M (n_embd 768, n_layer 12, n_vocab 50,257,
# n_ctx 1,024): each line as a reader of the model-explorer pages writes it.
ACCOUNTING_124M = {
    'ln_1': ['768 + 768 = 1,536', '1,536 × 12 blocks = 18,432'],
    'attn': ['768 × 2,304 + 2,304 = 1,771,776', '768 × 768 + 768 = 590,592', '1,771,776 + 590,592 = 2,362,368',
             '2,362,368 × 12 blocks = 28,348,416'],
    'mlp': ['768 × 3,072 + 3,072 = 2,362,368', '3,072 × 768 + 768 = 2,360,064', '2,362,368 + 2,360,064 = 4,722,432',
            '4,722,432 × 12 blocks = 56,669,184'],
    'embeddings': ['50,257 × 768 = 38,597,376', '1,024 × 768 = 786,432'],
    'ln_f': ['768 + 768 = 1,536'],
}


@pytest.mark.slow
def test_a_124m_shaped_page_counts_its_tensors_and_stays_small(random_checkpoint, browser, tmp_path):
    folder = random_checkpoint(gpt2_tf.HParams.named('124M'), scale=0.02)
    model = gpt2_tf.load_model(folder)
    prompt = 'The quick brown fox jumps over the lazy dog and keeps on running far away now'
    assert len(get_encoder().encode(prompt)) == 16
    named = tmp_path / '124M-shaped'  # the folder's name heads the page (and its screenshots)
    named.symlink_to(folder)
    report = pathlib.Path(write_report(model, get_encoder(), prompt, str(tmp_path / 'r.html'), model_dir=str(named)))
    assert report.stat().st_size < 5_000_000, report.stat().st_size
    shown = re.sub(r'<script.*?</script>', '', report.read_text(), flags=re.S)
    assert 'figure heatmap' not in shown  # drawn per block, not 144 copies
    page = open_page(browser, report)
    timing = page.evaluate('() => performance.getEntriesByType("navigation")[0].loadEventEnd')
    print(f'\n124M-shaped page: {report.stat().st_size:,} bytes, loaded and drawn in {timing:.0f} ms')
    for panel, lines in ACCOUNTING_124M.items():
        text = page.locator(f'#panel-{panel}').text_content()
        for line in lines:
            assert line in text, (panel, line)
        assert 'Counted from the tensors of the checkpoint file' in text
    assert page.text_content('#total') == '124,439,808'
    docs = pathlib.Path(os.environ.get('GPT2_TF_SCREENSHOTS', tmp_path))  # =docs retakes the README's pictures
    page.set_viewport_size({'width': 1320, 'height': 1400})
    page.screenshot(path=str(docs / 'explorer-overview.png'))
    page.locator('#diagram a.node[data-panel="mlp"]').click()
    page.screenshot(path=str(docs / 'explorer-mlp.png'))
    page.select_option('#block', '11')
    page.locator('#diagram a.node[data-panel="attn"]').click()
    page.wait_for_selector('#view-attn[data-block="11"]', timeout=30_000)
    assert page.locator('#view-attn .heatmap').count() == 12
    assert page.text_content('#view-attn .heatmap text') == 'h11 head 0'
    assert not page.requests and not page.errors, (page.requests, page.errors)
