"""An explorer page of the block for any checkpoint and prompt: the architecture, the residual stream,
attention, the logit lens and the final prediction, as one self-contained HTML file.

`explore(model, tokens)` computes every number as plain numpy arrays (a
notebook can plot the same views); `write_report` lays them out. The figures
are SVG written here, with no plotting library and no script: the file opens
offline, and the tokens in it are HTML text that can be read, searched and
tested.
"""

from __future__ import annotations

import html
import os
from typing import Optional

import numpy as np
import tensorflow as tf

from .checkpoint import ORIGINAL_CODE
from .diagnostics import COMPONENTS, parameter_table, trace
from .encoder import Encoder
from .model import Model
from .scoring import score

ORIGINAL = 'https://github.com/openai/gpt-2/blob/9b63575/src/model.py'
BLOCK = ('block', 123, "x'_n = x_n + attn(ln_1(x_n)); x_{n+1} = x'_n + mlp(ln_2(x'_n))")
RESIDUAL = ['x_n', 'attention delta', "x'_n", 'MLP delta', 'x_{n+1}']


def explore(model: Model, tokens) -> dict:
    """Every number of the explorer page for one prompt, tokens int [T] (1 <= T <= n_ctx), as numpy:

    residual_norms [n_layer, T, 5]   L2 norms of x_n, the attention delta, x'_n, the MLP delta, x_{n+1}
    attention      [n_layer, n_head, T, T]   the softmaxed attention weights
    lens_ids, lens_probs [n_layer, T, 5]     the logit lens: the top 5 next tokens that x_{n+1} gives
                                             through ln_f and the tied wte
    next_ids, next_probs [10]        the model's top 10 next tokens after the prompt
    prompt_log_probs [T - 1]         log p of each prompt token after the ones before it (scoring)
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or tokens.size == 0:
        raise ValueError('the prompt is empty: give at least one token')
    states = trace(model, tokens[None], attention_weights=True)
    names = ['x', 'attn', 'x_attn', 'mlp', 'out']
    norms = np.stack([np.stack([np.linalg.norm(block[n][0], axis=-1) for n in names], axis=-1) for block in states])
    outs = tf.constant(np.stack([block['out'][0] for block in states]))  # [n_layer, T, n_embd]
    probs = tf.nn.softmax(model.logits(outs), axis=-1)  # [n_layer, T, n_vocab]: ln_f, then the tied wte
    lens_probs, lens_ids = tf.math.top_k(probs, k=5)
    next_probs, next_ids = tf.math.top_k(probs[-1, -1], k=10)
    log_probs = score(model, tokens[None])[0] if tokens.size >= 2 else np.zeros([0], np.float32)
    return {'tokens': tokens, 'residual_norms': norms.astype(np.float32),
            'attention': np.stack([block['attn_weights'][0] for block in states]),
            'lens_ids': lens_ids.numpy(), 'lens_probs': lens_probs.numpy(),
            'next_ids': next_ids.numpy(), 'next_probs': next_probs.numpy(), 'prompt_log_probs': log_probs}


def token_label(encoder: Encoder, token: int) -> str:
    """A token as readable text: a leading space as ·, bytes that are not UTF-8 on their own as \\xNN."""
    raw = bytes(encoder.byte_decoder[c] for c in encoder.decoder[int(token)])
    try:
        text = raw.decode('utf-8')
    except UnicodeDecodeError:
        text = raw.decode('utf-8', errors='backslashreplace')
    text = text.replace('\n', '\\n').replace('\t', '\\t')
    return '·' + text[1:] if text.startswith(' ') else text


# --- SVG, written by hand ---------------------------------------------------------------------------

def _color(value: float) -> str:
    """0 -> white, 1 -> dark blue."""
    v = min(max(value, 0.0), 1.0)
    return f'rgb({int(255 - 215 * v)},{int(255 - 175 * v)},{int(255 - 75 * v)})'


def heatmap(weights: np.ndarray, labels: list, title: str) -> str:
    """An SVG heatmap of a [T, T] attention matrix: row = the token attending, column = the token attended to."""
    t = len(labels)
    cell, margin = 14, 8 + 7 * min(12, max(len(label) for label in labels))
    size = margin + cell * t
    parts = [f'<svg class="figure heatmap" xmlns="http://www.w3.org/2000/svg" width="{size}" height="{size + 16}" '
             f'role="img"><title>{html.escape(title)}</title>',
             f'<text x="2" y="11" font-size="10">{html.escape(title)}</text>']
    for i in range(t):
        for j in range(t):
            parts.append(f'<rect x="{margin + j * cell}" y="{16 + margin + i * cell}" width="{cell}" height="{cell}" '
                         f'fill="{_color(float(weights[i, j]))}"/>')
    for i, label in enumerate(labels):
        short = html.escape(label[:12])
        parts.append(f'<text x="{margin - 2}" y="{16 + margin + i * cell + 10}" font-size="9" '
                     f'text-anchor="end">{short}</text>')
        parts.append(f'<text transform="translate({margin + i * cell + 10},{16 + margin - 2}) rotate(-90)" '
                     f'font-size="9">{short}</text>')
    return ''.join(parts) + '</svg>'


def line_chart(series: np.ndarray, labels: list, title: str) -> str:
    """An SVG chart of series [layers, tokens]: one line per token across the layers."""
    layers, tokens = series.shape
    width, height, left, bottom = 360, 200, 44, 24
    top = float(series.max()) or 1.0
    scale_x = (width - left - 10) / max(layers - 1, 1)
    parts = [f'<svg class="figure chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'role="img"><title>{html.escape(title)}</title>',
             f'<text x="{left}" y="12" font-size="11">{html.escape(title)}</text>',
             f'<line x1="{left}" y1="{height - bottom}" x2="{width - 10}" y2="{height - bottom}" stroke="#888"/>',
             f'<line x1="{left}" y1="20" x2="{left}" y2="{height - bottom}" stroke="#888"/>',
             f'<text x="2" y="26" font-size="9">{top:.3g}</text>',
             f'<text x="{left}" y="{height - 8}" font-size="9">h0</text>',
             f'<text x="{width - 30}" y="{height - 8}" font-size="9">h{layers - 1}</text>']
    for k in range(tokens):
        points = ' '.join(f'{left + i * scale_x:.1f},{height - bottom - (height - bottom - 20) * series[i, k] / top:.1f}'
                          for i in range(layers))
        hue = int(360 * k / max(tokens, 1))
        parts.append(f'<polyline fill="none" stroke="hsl({hue},60%,45%)" stroke-width="1.5" points="{points}">'
                     f'<title>{html.escape(labels[k])}</title></polyline>')
    return ''.join(parts) + '</svg>'


# --- the page ---------------------------------------------------------------------------------------

STYLE = '''body{font:14px/1.45 system-ui,sans-serif;margin:24px;color:#222;max-width:1200px}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}
th{background:#f3f3f3}td.l,th.l{text-align:left}.tok{font-family:ui-monospace,monospace;white-space:pre}
.grid{display:flex;flex-wrap:wrap;gap:10px}section{margin:28px 0}code{background:#f3f3f3;padding:0 3px}'''


def _architecture(model_dir: Optional[str], model: Model) -> str:
    hp = model.hparams
    out = ['<section id="architecture"><h2>The architecture</h2>',
           '<p>' + ', '.join(f'{k} = {v}' for k, v in hp.to_dict().items()) + '</p>']
    table = parameter_table(model_dir) if model_dir else None
    rows = {row['component']: row for row in table['rows']} if table else {}
    out.append('<table><tr><th class="l">component</th><th class="l">original code</th><th>per instance</th>'
               '<th>instances</th><th>parameters</th><th class="l">what it does</th></tr>')
    for name, _, _ in COMPONENTS:
        function, line, what = ORIGINAL_CODE.get(name, ('', 0, ''))
        row = rows.get(name)
        counts = (f'<td>{row["per_instance"]:,}</td><td>{row["instances"]}</td><td>{row["checkpoint"]:,}</td>'
                  if row else '<td></td><td></td><td></td>')
        out.append(f'<tr><td class="l"><code>{name}</code></td><td class="l"><a href="{ORIGINAL}#L{line}">'
                   f'<code>{function}</code>, line {line}</a></td>{counts}<td class="l">{html.escape(what)}</td></tr>')
    out.append('</table>')
    function, line, what = BLOCK
    out.append(f'<p>Each block (<a href="{ORIGINAL}#L{line}"><code>{function}</code>, line {line}</a>): '
               f'{html.escape(what)}.')
    if table:
        out.append(f' In all: {table["total_checkpoint"]:,} parameters in the checkpoint.')
    return ''.join(out) + '</p></section>'


def render(model: Model, encoder: Encoder, found: dict, *, model_dir: Optional[str] = None, prompt: str = '') -> str:
    """The report as one HTML page."""
    labels = [token_label(encoder, t) for t in found['tokens']]
    esc = html.escape
    n_layer, n_head = found['attention'].shape[:2]
    parts = [f'<!doctype html><html><head><meta charset="utf-8"><title>gpt2_tf explorer</title>'
             f'<style>{STYLE}</style></head><body><h1>Inside GPT-2: {esc(model_dir or "model")}</h1>',
             f'<p>Prompt: <span class="tok">{esc(prompt)}</span> ({len(labels)} tokens: '
             + ' '.join(f'<span class="tok">[{esc(label)}]</span>' for label in labels) + ')</p>',
             _architecture(model_dir, model)]
    parts.append('<section id="residual"><h2>The residual stream</h2><p>L2 norms per token (one line each) '
                 'across the blocks.</p><div class="grid">')
    for q, name in enumerate(RESIDUAL):
        parts.append(line_chart(found['residual_norms'][:, :, q], labels, f'|{name}|'))
    parts.append('</div></section><section id="attention"><h2>Attention</h2><p>Per layer and head: row = the '
                 'token attending, column = the token attended to (darker: more weight).</p>')
    for layer in range(n_layer):
        parts.append(f'<h3>h{layer}</h3><div class="grid">')
        parts.extend(heatmap(found['attention'][layer, head], labels, f'h{layer} head {head}')
                     for head in range(n_head))
        parts.append('</div>')
    parts.append('</section><section id="lens"><h2>The logit lens</h2><p>At each block, the top 5 next tokens '
                 'that its output would give through ln_f and the tied wte, per prompt position.</p>'
                 '<table><tr><th>block</th>' + ''.join(f'<th class="tok">{esc(label)}</th>' for label in labels)
                 + '</tr>')
    for layer in range(n_layer):
        cells = []
        for position in range(len(labels)):
            guesses = '<br>'.join(f'<span class="tok">{esc(token_label(encoder, t))}</span> {p:.1%}' for t, p in
                                  zip(found['lens_ids'][layer, position], found['lens_probs'][layer, position]))
            cells.append(f'<td class="l lens">{guesses}</td>')
        parts.append(f'<tr><th>h{layer}</th>{"".join(cells)}</tr>')
    parts.append('</table></section><section id="prediction"><h2>The final prediction</h2>'
                 '<table id="next"><tr><th class="l">next token</th><th>probability</th></tr>')
    for t, p in zip(found['next_ids'], found['next_probs']):
        parts.append(f'<tr><td class="l tok">{esc(token_label(encoder, t))}</td><td>{p:.2%}</td></tr>')
    parts.append('</table><h3>The prompt, token by token</h3><table id="prompt-log-probs"><tr><th class="l">token'
                 '</th><th>log p</th></tr>')
    for i, label in enumerate(labels):
        value = '' if i == 0 else f'{found["prompt_log_probs"][i - 1]:.3f}'
        parts.append(f'<tr><td class="l tok">{esc(label)}</td><td>{value}</td></tr>')
    parts.append('</table></section></body></html>')
    return ''.join(parts)


def write_report(model: Model, encoder: Encoder, prompt: str, path: str, *, model_dir: Optional[str] = None) -> str:
    """Renders the report for prompt and writes it to path (through a temporary file); returns path."""
    tokens = encoder.encode(prompt)
    if not tokens:
        raise ValueError('the prompt is empty: give some text')
    if len(tokens) > model.hparams.n_ctx:
        raise ValueError(f'the prompt has {len(tokens)} tokens, more than n_ctx = {model.hparams.n_ctx}')
    page = render(model, encoder, explore(model, tokens), model_dir=model_dir, prompt=prompt)
    temporary = f'{path}.tmp-{os.getpid()}'
    try:
        with open(temporary, 'w', encoding='utf-8') as f:
            f.write(page)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    return path

