"""The page's SVG, written by hand (no plotting library): the block diagram and the charts across the blocks."""

from __future__ import annotations

import html

import numpy as np

from .panels import LN_1, LN_2, LN_F


def token_color(k: int, tokens: int) -> str:
    """The one color of token k everywhere on the page (charts, legends, tables); the script has the same rule."""
    return f'hsl({int(360 * k / max(tokens, 1))},60%,45%)'


def legend(labels: list) -> str:
    """Which line is which token: a swatch of its color and its text."""
    return ('<div class="legend">' + ''.join(
        f'<span><i style="background:{token_color(k, len(labels))}"></i><span class="tok">{html.escape(label)}'
        f'</span></span>' for k, label in enumerate(labels)) + '</div>')


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
        ys = height - bottom - (height - bottom - 20) * series[:, k] / top
        points = ' '.join(f'{left + i * scale_x:.1f},{ys[i]:.1f}' for i in range(layers))
        parts.append(f'<polyline fill="none" stroke="{token_color(k, tokens)}" stroke-width="1.5" points="{points}">'
                     f'<title>{html.escape(labels[k])}</title></polyline>')
        if layers == 1:  # a line of one point draws nothing: a dot
            parts.append(f'<circle cx="{left}" cy="{ys[0]:.1f}" r="3" fill="{token_color(k, tokens)}">'
                         f'<title>{html.escape(labels[k])}</title></circle>')
    return ''.join(parts) + '</svg>'


# The diagram: (panel, label, y, height, kind) top to bottom, which is also the order Tab and a screen reader take;
# x_n enters at the top, x_{n+1} leaves below. A + node is a circle: y is its top, height its diameter.
ADDS = [282, 514]  # the two + nodes' centres
NODES = [
    ('embeddings', 'Embeddings (wte + wpe)', 8, 30, 'outer'),
    (LN_1, 'LayerNorm 1', 106, 34, 'node'),
    ('attn', 'Attention', 162, 40, 'node'),
    ('residual', 'dropout (inactive at inference)', 224, 26, 'dropout'),
    ('residual', 'residual add', ADDS[0] - 13, 26, 'add'),
    (LN_2, 'LayerNorm 2', 338, 34, 'node'),
    ('mlp', 'MLP', 394, 40, 'node'),
    ('residual', 'dropout (inactive at inference)', 456, 26, 'dropout'),
    ('residual', 'residual add', ADDS[1] - 13, 26, 'add'),
    (LN_F, f'{LN_F} → logits (tied wte)', 608, 30, 'outer'),
]
CX, WIDTH = 120, 190


def _arrow(y1: float, y2: float) -> str:
    return f'<line x1="{CX}" y1="{y1}" x2="{CX}" y2="{y2}" class="flow" marker-end="url(#arrow)"/>'


def _state(name: str, sub: str, y: float) -> str:
    """A state's name beside the stream, left of it (x_n, x'_n, x_{n+1})."""
    return (f'<text x="{CX - 8}" y="{y}" text-anchor="end" class="state">{name}<tspan baseline-shift="sub" '
            f'font-size="9">{sub}</tspan></text>')


def _bypass(y_from: float, y_add: float) -> str:
    """A residual bypass: from the stream above the norm, around the sublayer, into the + node."""
    x = CX + WIDTH // 2 + 30
    mid = (y_from + y_add) / 2
    return (f'<path d="M{CX},{y_from} H{x} V{y_add} H{CX + 13}" class="bypass" marker-end="url(#arrow)"/>'
            f'<text x="{x + 6}" y="{mid}" class="bypass-label" transform="rotate(90 {x + 6} {mid})" '
            f'text-anchor="middle">residual</text>')


def diagram(n_layer: int) -> str:
    """The block as an SVG flow diagram; each component is a link (#panel-NAME) that opens its panel."""
    parts = ['<svg id="diagram" xmlns="http://www.w3.org/2000/svg" width="300" height="648" role="navigation" '
             'aria-label="the block, component by component">',
             '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
             'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker></defs>',
             f'<rect x="6" y="58" width="284" height="520" rx="10" class="blockbox"/>',
             f'<text x="{CX + 8}" y="53" class="blocklabel">block <tspan class="block-number">h0</tspan> '
             f'of {n_layer}, repeated</text>',
             _state('x', 'n', 84), _state('x′', 'n', ADDS[0] + 34), _state('x', 'n+1', ADDS[1] + 34)]
    # The stream, top to bottom: embeddings, x_n, LayerNorm 1, attention, dropout, +, x'_n, LayerNorm 2, MLP, dropout,
    # +, x_{n+1}, the final norm.
    for y1, y2 in [(38, 106), (140, 162), (202, 224), (250, ADDS[0] - 13), (ADDS[0] + 13, 338),
                   (372, 394), (434, 456), (482, ADDS[1] - 13), (ADDS[1] + 13, 608)]:
        parts.append(_arrow(y1, y2))
    parts += [_bypass(80, ADDS[0]), _bypass(ADDS[0] + 30, ADDS[1])]
    for panel, label, y, height, kind in NODES:
        r = height // 2
        shape = (f'<circle cx="{CX}" cy="{y + r}" r="{r}"/><text x="{CX}" y="{y + r + 5}" text-anchor="middle">+</text>'
                 if kind == 'add' else
                 f'<rect x="{CX - WIDTH // 2}" y="{y}" width="{WIDTH}" height="{height}" rx="6"/>'
                 f'<text x="{CX}" y="{y + height / 2 + 4}" text-anchor="middle">{html.escape(label)}</text>')
        parts.append(f'<a href="#panel-{panel}" class="node {kind}" data-panel="{panel}" aria-label="{label}">'
                     f'{shape}</a>')
    return ''.join(parts) + '</svg>'


def inner_flow(steps: list) -> str:
    """A sublayer's inside as a row of boxes: steps [(name, shape)] left to right, each shape under its box."""
    width, gap = 104, 16
    parts = [f'<svg class="inner" xmlns="http://www.w3.org/2000/svg" width="{len(steps) * (width + gap)}" '
             f'height="64" role="img"><title>inside: {html.escape(" → ".join(n for n, _ in steps))}</title>']
    for k, (name, shape) in enumerate(steps):
        x = k * (width + gap)
        parts.append(f'<rect x="{x + 1}" y="4" width="{width}" height="30" rx="5" class="step"/>'
                     f'<text x="{x + width / 2}" y="24" text-anchor="middle" font-size="12">{html.escape(name)}</text>'
                     f'<text x="{x + width / 2}" y="52" text-anchor="middle" font-size="10" '
                     f'class="shape">{html.escape(shape)}</text>')
        if k:
            parts.append(f'<line x1="{x - gap + 2}" y1="19" x2="{x - 1}" y2="19" stroke="#555" '
                         f'marker-end="url(#arrow)"/>')
    return ''.join(parts) + '</svg>'
