"""The explorer page: one self-contained HTML file, laid out from explore()'s numbers.

The static parts (the diagram, each component's formula, shapes, accounting and code, the charts
across the blocks, the logit lens) are HTML and SVG written here; the block-by-block views (norm
statistics, attention maps, the GELU, the residual norms) are drawn by a small inline script from
the page's own data, for the block picked in the selector, so the page grows by data, not by copies
of the views. The attention maps (n_head · T² weights a block) are canvases, drawn only once the
Attention panel is open, from weights stored as deflated bytes. Nothing is loaded from a network.
"""

from __future__ import annotations

import base64
import html
import json
import os
import unicodedata
import zlib
from typing import Optional

import numpy as np

from ..checkpoint import ORIGINAL_CODE
from ..encoder import Encoder, well_formed
from ..model import Graph
from ..validate import check_explorer_prompt, check_token_ids, replacing
from .figures import diagram, inner_flow, legend, line_chart, token_color
from .measure import NEAR_ZERO, RESIDUAL, explore
from .panels import (LN_1, LN_2, LN_F, INSIDE, LABELS, ORIGINAL, PANELS, accounting, accounting_table, claimed,
                     original_link, source_code, stored_shapes)

STYLE = '''body{font:14px/1.45 system-ui,sans-serif;margin:24px;color:#222;max-width:1320px}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}
th{background:#f3f3f3}td.l,th.l{text-align:left}.tok{font-family:ui-monospace,monospace;white-space:pre;unicode-bidi:isolate}
.grid{display:flex;flex-wrap:wrap;gap:10px}section{margin:28px 0}code{background:#f3f3f3;padding:0 3px}
.explorer{display:grid;grid-template-columns:310px 1fr;gap:24px;align-items:start}.side{position:sticky;top:8px}
.panel{border:1px solid #d8dce6;border-radius:10px;padding:4px 18px 12px;margin:0}.panel[hidden]{display:none}
.panel h3{margin:10px 0 4px}
#diagram .node rect,#diagram .node circle{fill:#eef3fb;stroke:#4a6fa5;stroke-width:1.5}
#diagram .node text{font-size:13px;fill:#1d3557}#diagram .node.add text{font-size:18px}
#diagram .node.dropout rect{fill:#f7f7f7;stroke:#999;stroke-dasharray:4 3}
#diagram .node.dropout text{fill:#777;font-size:11px}#diagram .node.outer rect{fill:#f3efe6;stroke:#a5844a}
#diagram a.node{cursor:pointer}#diagram .node:hover rect,#diagram .node:hover circle{fill:#dce8fb}
#diagram .node.selected rect,#diagram .node.selected circle{fill:#ffd166;stroke:#b5651d;stroke-width:3}
#diagram a.node:focus{outline:none}
#diagram a.node:focus rect,#diagram a.node:focus circle{stroke:#d62828;stroke-width:3.5}
#diagram .flow,#diagram .bypass{stroke:#555;fill:none;stroke-width:1.4}#diagram .bypass{stroke-dasharray:5 3}
#diagram .bypass-label{font-size:11px;fill:#555;font-style:italic}
#diagram .state{font-size:14px;font-style:italic}
#diagram .blockbox{fill:none;stroke:#8a97ad;stroke-dasharray:6 4}#diagram .blocklabel{font-size:12px;fill:#555}
.calc{font-family:ui-monospace,monospace;white-space:nowrap}.note{color:#555;font-size:12px;margin:2px 0}
figure.code{margin:8px 0}pre code{background:none;padding:0}
figure.code pre{background:#f6f8fa;padding:8px;overflow:auto;max-height:320px;font-size:12px}
figcaption{font-size:12px;color:#555}tr.sum td{font-weight:600}
table.accounting code.tensors{font-size:11px;white-space:nowrap}
.inner .step{fill:#eef3fb;stroke:#4a6fa5}.inner .shape{fill:#555;font-family:ui-monospace,monospace}
.shapes{font-family:ui-monospace,monospace;font-size:13px}
.legend{display:flex;flex-wrap:wrap;gap:4px 12px;margin:4px 0}
.legend i{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:-1px;border-radius:2px}
math{font-size:17px;margin:6px 0}.picker{margin:8px 0 0}
td i{display:inline-block;width:10px;height:10px;margin-right:6px;border-radius:2px}
.picker select{font-size:14px}
.figure.heatmap,.figure.mask{position:relative}.figure.heatmap svg{display:block}
.figure canvas{position:absolute;image-rendering:pixelated}.figure canvas:focus{outline:2px solid #d62828}
.figure .cursor{position:absolute;box-sizing:border-box;border:1px solid #d62828;pointer-events:none}
.readout{position:sticky;top:0;z-index:1;background:#fff;min-height:1.45em;margin:4px 0}
.sr-only{position:absolute;width:1px;height:1px;overflow:hidden;clip-path:inset(50%);white-space:nowrap}'''

SCRIPT = r'''(function () {
  // The block-by-block views, drawn from the page's data for the block picked in #block; the attention maps only
  // while the Attention panel is open, for the block shown.
  const D = JSON.parse(document.getElementById('data').textContent), T = D.tokens.length;
  const esc = s => s.replace(/[&<>"]/g, c => ({'&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;'}[c]));
  const color = k => `hsl(${Math.floor(360 * k / Math.max(T, 1))},60%,45%)`;  // figures.token_color
  const fmt = v => Math.abs(v) >= 1e4 || (Math.abs(v) < 1e-3 && v !== 0) ? v.toExponential(2) : v.toFixed(4);
  const swatch = k => `<i style="background:${color(k)}"></i>`;
  const svg = (kind, width, height, title) => `<svg class="figure ${kind}" xmlns="http://www.w3.org/2000/svg"
    width="${width}" height="${height}" role="img"><title>${title}</title>`;

  let weights;  // [n_layer, n_head, T, T] bytes, 0..255 for 0..1 (page_data): unpacked once, when first drawn
  function unpack() {
    if (!weights) {
      const text = atob(D.attention), packed = new Uint8Array(text.length);
      for (let k = 0; k < text.length; k++) packed[k] = text.charCodeAt(k);
      const stream = new Blob([packed]).stream().pipeThrough(new DecompressionStream('deflate'));
      weights = new Response(stream).arrayBuffer().then(b => new Uint8Array(b));
    }
    return weights;
  }
  // A byte's color, white (0) to dark blue (255), as the four bytes of a canvas pixel (RGBA) in one number.
  const BLUE = new Uint32Array(Uint8Array.from(Array.from({length: 256},
    (_, k) => [...[215, 175, 75].map(d => Math.round(255 - d * k / 255)), 255]).flat()).buffer);
  // The maps' cells are one canvas pixel each, shown cell CSS pixels wide (14 up to 32 tokens, at least 1), with a
  // token's label every few rows and columns (10 px apart at least).
  const cell = Math.max(1, Math.min(14, Math.floor(448 / T))), every = Math.ceil(10 / cell);
  const margin = 8 + 7 * Math.min(12, Math.max(...D.tokens.map(t => t.length)));
  const readout = () => document.getElementById('attn-readout');

  // A [T, T] map of bytes level(i, j): row i the token attending (the query), column j the one attended to (the
  // key). Pointing at a cell, or the arrow keys on a focused map, write its tokens and say(level) in #attn-readout;
  // about is its text for a screen reader.
  function heat(id, level, say, title, kind, about) {
    const m = margin, s = m + cell * T, figure = document.createElement('div');
    figure.className = 'figure ' + kind;
    figure.id = id;
    let p = `<svg xmlns="http://www.w3.org/2000/svg" width="${s}" height="${s + 16}" aria-hidden="true">
      <text x="2" y="11" font-size="10">${title}</text>`;
    for (let i = 0; i < T; i += every) {
      const t = esc(D.tokens[i].slice(0, 12)), c = i * cell + cell / 2 + 3;
      p += `<text x="${m - 2}" y="${16 + m + c}" font-size="9" text-anchor="end">${t}</text>
        <text transform="translate(${m + c},${16 + m - 2}) rotate(-90)" font-size="9">${t}</text>`;
    }
    // No white space between the elements: a space after the SVG would widen the figure and move the grid's rows.
    figure.innerHTML = p + `</svg><canvas width="${T}" height="${T}" tabindex="0" role="img"
      style="left:${m}px;top:${16 + m}px;width:${T * cell}px;height:${T * cell}px"
      aria-label="${title}, ${T} by ${T}: point at a cell or use the arrow keys to read it"
      aria-describedby="${id}-about"></canvas><span class="cursor" hidden></span>`
      + `<p class="sr-only" id="${id}-about">${esc(about)}</p>`;
    const canvas = figure.querySelector('canvas'), cursor = figure.querySelector('.cursor');
    const context = canvas.getContext('2d'), image = context.createImageData(T, T);
    const pixels = new Uint32Array(image.data.buffer);
    for (let i = 0; i < T; i++) for (let j = 0; j < T; j++) pixels[i * T + j] = BLUE[level(i, j)];
    context.putImageData(image, 0, 0);
    let at = [0, 0];
    const show = (i, j) => {
      at = [Math.max(0, Math.min(T - 1, i)), Math.max(0, Math.min(T - 1, j))];
      Object.assign(cursor.style, {left: `${m + at[1] * cell - 1}px`, top: `${16 + m + at[0] * cell - 1}px`,
                                   width: `${cell + 2}px`, height: `${cell + 2}px`});
      cursor.hidden = false;
      readout().textContent = `${title}: query ${D.tokens[at[0]]} (${at[0]}) → key ${D.tokens[at[1]]} (${at[1]}), `
        + say(level(...at));
    };
    canvas.addEventListener('mousemove', e => show(Math.floor(e.offsetY / cell), Math.floor(e.offsetX / cell)));
    canvas.addEventListener('focus', () => show(...at));
    ['mouseleave', 'blur'].forEach(e => canvas.addEventListener(e, () => { cursor.hidden = true; }));
    canvas.addEventListener('keydown', e => {
      const step = {ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1]}[e.key];
      if (step) { e.preventDefault(); show(at[0] + step[0], at[1] + step[1]); }
    });
    return figure;
  }
  const weight = v => `weight ${(v / 255).toFixed(3)}`;
  function strongest(level) {  // each query's strongest key, as words
    return 'Each token\'s strongest key: ' + D.tokens.map((t, i) => {
      let best = 0;
      for (let j = 1; j <= i; j++) if (level(i, j) > level(i, best)) best = j;
      return `${t} → ${D.tokens[best]} ${(level(i, best) / 255).toFixed(3)}`;
    }).join('; ') + '.';
  }
  let drawn = -1;  // the block whose attention maps are drawn or being drawn
  async function attention() {
    const n = +pick.value, maps = document.getElementById('view-attn');
    if (document.getElementById('panel-attn').hidden || drawn === n) return;
    drawn = n;
    if (!window.DecompressionStream) {
      view('attn', '<p>This browser cannot unpack the weights (it lacks DecompressionStream): open the page in a '
        + 'newer one.</p>');
      return;
    }
    if (!document.querySelector('#view-mask canvas'))
      document.getElementById('view-mask').replaceChildren(heat('map-mask', (i, j) => j <= i ? 255 : 0,
        v => v ? 'seen (1)' : 'masked (0)', 'the causal mask', 'mask',
        'Each token sees itself and the tokens before it; the later ones are masked.'));
    const A = await unpack();
    if (drawn !== n) return;  // another block was picked meanwhile: its own call draws it
    const heads = [];
    for (let h = 0; h < D.n_head; h++) {
      const o = (n * D.n_head + h) * T * T, level = (i, j) => A[o + i * T + j];
      heads.push(heat(`map-${h}`, level, weight, `h${n} head ${h}`, 'heatmap', strongest(level)));
    }
    maps.replaceChildren(...heads);
    maps.dataset.block = n;
  }
  function table(head, rows) {  // the first column names the token, with its color
    return '<table><tr>' + head.map(h => `<th>${h}</th>`).join('') + '</tr>' + rows.map((r, k) =>
      `<tr><td class="l tok">${swatch(k)}${esc(D.tokens[k])}</td>` + r.map(c => `<td>${fmt(c)}</td>`).join('')
      + '</tr>').join('') + '</table>';
  }
  function mlp(n) {
    const g = D.gelu[n], hist = g.histogram, top = Math.max(...hist), w = 14, H = 90, [lo, hi] = g.range;
    let p = `<p>The GELU's input (c_fc's output, ${T} × ${D.n_inner.toLocaleString('en-US')} values) ranges from
      <b>${fmt(lo)}</b> to <b>${fmt(hi)}</b>; <b>${(100 * g.near_zero).toFixed(1)}%</b> of the activations
      have |GELU(u)| &lt; ${D.near_zero}.</p>` + svg('histogram', hist.length * w + 60, H + 30,
      `the GELU's input, h${n}`);
    hist.forEach((c, i) => {
      const h = H * c / top;
      p += `<rect x="${30 + i * w}" y="${H - h + 4}" width="${w - 2}" height="${h}" fill="#4a6fa5">
        <title>${c}</title></rect>`;
    });
    const zero = 30 + hist.length * w * (0 - lo) / (hi - lo);
    if (lo < 0 && hi > 0)
      p += `<line x1="${zero}" y1="2" x2="${zero}" y2="${H + 8}" stroke="#d62828" stroke-dasharray="3 2"/>
        <text x="${zero}" y="${H + 20}" font-size="10" text-anchor="middle">0</text>`;
    return p + `<text x="30" y="${H + 20}" font-size="10">${fmt(lo)}</text><text x="${30 + hist.length * w}"
      y="${H + 20}" font-size="10" text-anchor="end">${fmt(hi)}</text></svg><p class="note">Counts of the GELU's
      input u in ${hist.length} equal bins (hover a bar); the dashed line is u = 0, below which the GELU squashes
      towards 0.</p>`;
  }
  const NORMS = ['token', 'mean before', 'variance before', 'mean after', 'variance after'];
  const RESIDUAL = ['token', '|x<sub>n</sub>|', '|Δ attention|', '|x′<sub>n</sub>|', '|Δ MLP|',
    '|x<sub>n+1</sub>|'];
  const view = (name, content) => { document.getElementById('view-' + name).innerHTML = content; };
  function draw(n) {
    document.querySelectorAll('.block-number').forEach(e => { e.textContent = 'h' + n; });
    D.norms.forEach((name, i) => view(name, table(NORMS, D.norm_stats[n][i])));
    view('mlp', mlp(n));
    view('residual', table(RESIDUAL, D.residual[n]));
    attention();
  }
  function select(name, focus) {  // show one panel, mark its nodes in the diagram; on a reader's pick, focus it
    if (!document.getElementById('panel-' + name)) name = D.norms[0];
    document.querySelectorAll('.panel').forEach(p => { p.hidden = p.id !== 'panel-' + name; });
    document.querySelectorAll('#diagram .node').forEach(a => {
      const on = a.dataset.panel === name;
      a.classList.toggle('selected', on);
      if (on) a.setAttribute('aria-current', 'true'); else a.removeAttribute('aria-current');
    });
    if (focus) document.querySelector(`#panel-${name} h2`).focus();
    attention();
  }
  document.querySelectorAll('#diagram a.node').forEach(a => a.addEventListener('click', e => {
    e.preventDefault();
    history.replaceState(null, '', '#panel-' + a.dataset.panel);
    select(a.dataset.panel, true);
  }));
  const pick = document.getElementById('block');
  pick.addEventListener('change', () => draw(+pick.value));
  window.addEventListener('hashchange', () => select(location.hash.replace('#panel-', ''), true));
  select(location.hash.replace('#panel-', ''));
  draw(+pick.value);
})();'''


def token_label(encoder: Encoder, token: int) -> str:
    """A token as readable text (visible()), a leading space as ·; bytes that are not UTF-8 on their own as \\xNN;
    an id the vocabulary does not have (a model's padded rows) as ⟨id N⟩."""
    if int(token) not in encoder.decoder:
        return f'⟨id {int(token)}⟩'
    raw = bytes(encoder.byte_decoder[c] for c in encoder.decoder[int(token)])
    try:
        text = raw.decode('utf-8')
    except UnicodeDecodeError:
        text = raw.decode('utf-8', errors='backslashreplace')
    text = visible(text)
    return '·' + text[1:] if text.startswith(' ') else text


def visible(text: str) -> str:
    """\\n and \\t as written, other control characters as \\xNN, invisible format characters (a right-to-left
    override, say, which would reorder what follows it) and separators other than the space as \\uNNNN."""
    text = text.replace('\n', '\\n').replace('\t', '\\t')
    return ''.join(f'\\x{ord(c):02x}' if unicodedata.category(c) == 'Cc' else
                   f'\\u{ord(c):04x}' if unicodedata.category(c) in ('Cf', 'Zl', 'Zp', 'Zs') and c != ' ' else c
                   for c in text)


def _rounded(array) -> list:
    """Floats to 5 significant digits for the page's data (what a table shows, at a fifth of the bytes)."""
    return json.loads(json.dumps(np.asarray(array, np.float64).tolist()),
                      parse_float=lambda s: float(f'{float(s):.5g}'))


def page_data(model: Graph, found: dict, labels: list) -> str:
    """The block-by-block views' numbers as JSON; attention weights as bytes (0..255 for 0..1), deflated (the masked
    half is zeros, and most of the rest rounds to a few small values), base64."""
    hp = model.hparams
    attention = np.round(np.clip(found['attention'], 0, 1) * 255).astype(np.uint8)
    packed = base64.b64encode(zlib.compress(attention.tobytes())).decode('ascii')  # the script's DecompressionStream
    data = {'tokens': labels, 'norms': [LN_1, LN_2], 'n_head': hp.n_head, 'n_inner': 4 * hp.n_embd, 'near_zero': NEAR_ZERO,
            'attention': packed,
            'norm_stats': _rounded(found['norm_stats']), 'residual': _rounded(found['residual_norms']),
            'gelu': [{'range': _rounded(r), 'histogram': h.tolist(), 'near_zero': round(float(z), 5)}
                     for r, h, z in zip(found['gelu_range'], found['gelu_histogram'], found['near_zero'])]}
    # Every < escaped: neither </script> nor <!-- <script> in a token's text can end or hide the script.
    return json.dumps(data, separators=(',', ':'), allow_nan=False).replace('<', '\\u003c')


def panel_html(name: str, hp, counted: dict, source: str, measured: str, T: int) -> str:
    """One component's panel: what it does, the formula, shapes, accounting, code, and the prompt's values."""
    p = PANELS[name]
    names = dict(hp.to_dict(), T=T, head_size=hp.n_embd // hp.n_head, n_inner=4 * hp.n_embd)
    names = {k: f'{v:,}' if isinstance(v, int) and k != 'T' else v for k, v in names.items()}
    out = [f'<section class="panel" id="panel-{name}"><h2 tabindex="-1">{p.title}</h2>',  # focused when it opens
           f'<p>{html.escape(p.text.format(**names))}</p>',
           '<h3>Formula</h3>', *p.formulas,
           f'<h3>Shapes</h3><p class="shapes">{html.escape(p.shapes.format(**names))}</p>']
    if name in INSIDE:
        out.append('<h3>Inside</h3>' + inner_flow([(step, shape.format(**names)) for step, shape in INSIDE[name]]))
    if p.parts:
        out += ['<h3>Parameters</h3>', accounting_table(p.parts, counted, source, hp.n_layer)]
    out += ['<h3>Measured on this prompt</h3>', measured, '<h3>Code</h3>', original_link(p.original),
            '<p class="note">This project\'s code, read from the module when the page was written:</p>',
            source_code(p.code), '</section>']
    return ''.join(out)


def _global_views(encoder: Encoder, found: dict, labels: list) -> dict:
    """The measured values of the panels that do not depend on the block (embeddings, the head)."""
    rows = ''.join(f'<tr><td class="l tok">{html.escape(label)}</td><td>{k}</td>'
                   + ''.join(f'<td>{v:.4f}</td>' for v in found['embedding_norms'][k]) + '</tr>'
                   for k, label in enumerate(labels))
    embeddings = ('<table><tr><th class="l">token</th><th>position</th><th>|wte[token]|</th><th>|wpe[position]|'
                  f'</th><th>|x<sub>0</sub>|</th></tr>{rows}</table>')
    top = ''.join(f'<tr><td class="l tok">{html.escape(token_label(encoder, t))}</td><td>{p:.2%}</td></tr>'
                  for t, p in zip(found['next_ids'], found['next_probs']))
    head = f'<table><tr><th class="l">next token</th><th>probability</th></tr>{top}</table>'
    return {'embeddings': embeddings, LN_F: head}


def _explorer(model: Graph, encoder: Encoder, found: dict, labels: list, model_dir: Optional[str]) -> str:
    """The diagram beside the panels, the block selector, and the summary table of every component."""
    hp = model.hparams
    stored, source = stored_shapes(model_dir, model)
    counted = accounting(hp, stored)
    views = {name: f'<div class="view" id="view-{name}"></div>' for name in (LN_1, LN_2, 'mlp')}
    views['attn'] = ('<p class="note">The mask (left: 1 where token i may see token j, j ≤ i), then each head\'s '
                     'weights (to steps of 1/255). Point at a cell, or Tab to a map and use the arrow keys, to read '
                     'its tokens and weight here:</p><p class="readout" id="attn-readout" aria-live="polite"></p>'
                     '<div class="grid"><div id="view-mask"></div><div class="grid view" id="view-attn"></div></div>')
    views['residual'] = '<div class="view" id="view-residual"></div>' + legend(labels)
    views.update(_global_views(encoder, found, labels))
    options = ''.join(f'<option value="{n}">h{n}</option>' for n in range(hp.n_layer))
    panels = ''.join(panel_html(name, hp, counted, source, views[name], len(labels)) for name in PANELS)
    out = ['<section id="architecture"><h2>The block</h2><p>' + ', '.join(f'{k} = {v}' for k, v in
           hp.to_dict().items()) + '. Pick a component in the diagram (or Tab to it and press Enter).</p>',
           f'<div class="explorer"><div class="side">{diagram(hp.n_layer)}<p class="picker"><label for="block">'
           f'Block: </label><select id="block">{options}</select> of {hp.n_layer}</p></div>'
           f'<div class="panels">{panels}</div></div>', _summary(hp, counted, source, stored), '</section>']
    return ''.join(out)


def _summary(hp, counted: dict, source: str, stored: dict) -> str:
    out = ['<h3>Every component</h3><table id="accounting"><tr><th class="l">component</th><th class="l">original '
           'code</th><th class="l">Calculation</th><th>per instance</th><th>instances</th><th>parameters</th>'
           '<th class="l">what it does</th></tr>']
    for name, c in counted.items():
        function, line, what = ORIGINAL_CODE.get(name, ('', 0, ''))
        out.append(f'<tr><td class="l"><code>{name}</code> {LABELS[name]}</td><td class="l"><a href="{ORIGINAL}'
                   f'#L{line}"><code>{function}</code>, line {line}</a></td><td class="l calc">{c["calculation"]}'
                   f'</td><td>{c["per_instance"]:,}</td><td>{c["instances"]}</td><td>{c["across"]:,}</td>'
                   f'<td class="l">{html.escape(what)}</td></tr>')
    total = sum(c['across'] for c in counted.values())
    outside = sorted(set(stored) - claimed(hp))
    out.append(f'<tr class="sum"><td class="l">in all</td><td></td><td></td><td></td><td></td><td id="total">'
               f'{total:,}</td><td class="l">the logits reuse wte (tied): no parameters of their own</td></tr>'
               f'</table><p class="note">Counted from the tensors of {html.escape(source)}: {total:,} parameters '
               f'in {len(stored) - len(outside)} tensors'
               + (f'; {len(outside)} other tensor(s) there are not the model\'s and not counted (the first: '
                  f'{html.escape(outside[0])})' if outside else '') + '.</p>')
    return ''.join(out)


def _name(model_dir: Optional[str]) -> str:
    return os.path.basename(os.path.normpath(model_dir)) if model_dir else 'model'


def render(model: Graph, encoder: Encoder, found: dict, *, model_dir: Optional[str] = None, prompt: str = '') -> str:
    """The report as one HTML page."""
    labels = [token_label(encoder, t) for t in found['tokens']]
    esc = html.escape
    n_layer = model.hparams.n_layer
    parts = [f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>gpt2_tf explorer</title>'
             f'<style>{STYLE}</style></head><body><h1>Inside GPT-2: {esc(_name(model_dir))}'
             f'{"" if model.dtype == "float32" else f" ({model.dtype} weights)"}</h1>',
             f'<p>Prompt: <span class="tok">{esc(visible(prompt))}</span> ({len(labels)} tokens: '
             + ' '.join(f'<span class="tok" style="border-bottom:3px solid {token_color(k, len(labels))}">'
                        f'[{esc(label)}]</span>' for k, label in enumerate(labels)) + ')</p>',
             _explorer(model, encoder, found, labels, model_dir)]
    parts.append('<section id="residual"><h2>The residual stream across the blocks</h2><p>L2 norms per token '
                 '(one line each; the legend names them) across the blocks.</p>' + legend(labels)
                 + '<div class="grid">')
    for q, name in enumerate(RESIDUAL):
        parts.append(line_chart(found['residual_norms'][:, :, q], labels, f'|{name}|'))
    parts.append('</div></section>' + _lens(encoder, found, labels, n_layer) + _prediction(encoder, found, labels))
    parts.append(f'<script id="data" type="application/json">{page_data(model, found, labels)}</script>'
                 f'<script>{SCRIPT}</script></body></html>')
    return ''.join(parts)


def _lens(encoder: Encoder, found: dict, labels: list, n_layer: int) -> str:
    esc = html.escape
    parts = ['<section id="lens"><h2>The logit lens</h2><p>At each block, the top 5 next tokens that its output '
             'would give through ln_f and the tied wte, per prompt position.</p><table><tr><th>block</th>'
             + ''.join(f'<th class="tok">{esc(label)}</th>' for label in labels) + '</tr>']
    for layer in range(n_layer):
        cells = []
        for position in range(len(labels)):
            guesses = '<br>'.join(f'<span class="tok">{esc(token_label(encoder, t))}</span> {p:.1%}' for t, p in
                                  zip(found['lens_ids'][layer, position], found['lens_probs'][layer, position]))
            cells.append(f'<td class="l lens">{guesses}</td>')
        parts.append(f'<tr><th>h{layer}</th>{"".join(cells)}</tr>')
    return ''.join(parts) + '</table></section>'


def _prediction(encoder: Encoder, found: dict, labels: list) -> str:
    parts = ['<section id="prediction"><h2>The final prediction</h2><table id="next"><tr><th class="l">next token'
             '</th><th>probability</th></tr>']
    for t, p in zip(found['next_ids'], found['next_probs']):
        parts.append(f'<tr><td class="l tok">{html.escape(token_label(encoder, t))}</td><td>{p:.2%}</td></tr>')
    parts.append('</table><h3>The prompt, token by token</h3><table id="prompt-log-probs"><tr><th class="l">token'
                 '</th><th>log p</th></tr>')
    for i, label in enumerate(labels):
        value = '' if i == 0 else f'{found["prompt_log_probs"][i - 1]:.3f}'
        parts.append(f'<tr><td class="l tok">{html.escape(label)}</td><td>{value}</td></tr>')
    return ''.join(parts) + '</table></section>'


def write_report(model: Graph, encoder: Encoder, prompt: str, path: str, *, model_dir: Optional[str] = None) -> str:
    """Renders the report for prompt and writes it to path (through a temporary file); returns path. Lone
    surrogates in prompt (undecodable bytes) show as U+FFFD, as the encoder takes them."""
    prompt = well_formed(prompt)
    tokens = encoder.encode(prompt)
    hp = model.hparams
    check_explorer_prompt(len(tokens), hp.n_layer, hp.n_head, hp.n_ctx)
    check_token_ids(tokens, hp.n_vocab, name="the prompt's token", encoded=True)
    page = render(model, encoder, explore(model, tokens), model_dir=model_dir, prompt=prompt)
    with replacing(path) as temporary, open(temporary, 'w', encoding='utf-8') as f:
        f.write(page)
    return path
