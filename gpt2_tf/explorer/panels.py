"""What each component's panel says apart from the prompt: its formula (MathML), shapes, accounting and code.

The accounting is counted from the checkpoint's own tensors (their stored shapes), the components and
their variables from checkpoint.VARIABLES (through diagnostics.components); the code is this project's,
read from the module at run time, beside the original's lines at revision 9b63575.
"""

from __future__ import annotations

import html
import inspect
import os
from typing import NamedTuple, Optional

import numpy as np

from .. import loading, model as graph
from ..checkpoint import variable_shapes
from ..diagnostics import COMPONENTS, components, variable_name
from ..hparams import HParams

ORIGINAL = 'https://github.com/openai/gpt-2/blob/9b63575/src/model.py'
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(graph.__file__)))  # the folder above gpt2_tf/

# The checkpoint's components in forward order (checkpoint.VARIABLES's third column), and what readers call them.
WTE, WPE, LN_1, C_ATTN, ATTN_PROJ, LN_2, C_FC, MLP_PROJ, LN_F = (name for name, _, _ in COMPONENTS)
LABELS = {WTE: f'Token embedding ({WTE})', WPE: f'Position embedding ({WPE})', LN_1: f'LayerNorm 1 ({LN_1})',
          C_ATTN: 'Queries, keys, values (c_attn)', ATTN_PROJ: 'Output projection (c_proj)',
          LN_2: f'LayerNorm 2 ({LN_2})', C_FC: 'Feature expansion (c_fc)',
          MLP_PROJ: 'Feature projection (c_proj)', LN_F: f'Final LayerNorm ({LN_F})'}


# The inside of the two sublayers, step by step, with the shapes (filled in as the panels' shapes are).
INSIDE = {
    'attn': [('c_attn', '[1, {T}, 3 × {n_embd}]'), ('split heads', '3 × [1, {n_head}, {T}, {head_size}]'),
             ('Q Kᵀ / √d', '[1, {n_head}, {T}, {T}]'), ('causal mask', 'j ≤ i kept, else −10¹⁰'),
             ('softmax · V', '[1, {n_head}, {T}, {head_size}]'), ('merge heads', '[1, {T}, {n_embd}]'),
             ('c_proj', '[1, {T}, {n_embd}]')],
    'mlp': [('c_fc', '[1, {T}, {n_inner}]'), ('GELU', '[1, {T}, {n_inner}]'), ('c_proj', '[1, {T}, {n_embd}]')],
}


class Panel(NamedTuple):
    title: str
    parts: tuple          # the checkpoint's components it holds (checkpoint.VARIABLES's third column)
    code: tuple           # this project's functions and classes for it
    original: tuple       # (first, last) lines of the original's src/model.py at 9b63575
    text: str             # what it does, with an example
    formulas: tuple       # MathML, one <math> each
    shapes: str           # '{T}' and the hparams' names are filled in


def math(body: str) -> str:
    return f'<math display="block">{body}</math>'


def mi(name: str) -> str:
    return f'<mi>{name}</mi>'


LN_FORMULAS = (
    math('<mi>μ</mi><mo>=</mo><mfrac><mn>1</mn><mi>n</mi></mfrac><munderover><mo>∑</mo><mrow><mi>i</mi><mo>=</mo>'
         '<mn>1</mn></mrow><mi>n</mi></munderover><msub><mi>x</mi><mi>i</mi></msub><mo>,</mo><mspace width="1em"/>'
         '<msup><mi>σ</mi><mn>2</mn></msup><mo>=</mo><mfrac><mn>1</mn><mi>n</mi></mfrac><munderover><mo>∑</mo>'
         '<mrow><mi>i</mi><mo>=</mo><mn>1</mn></mrow><mi>n</mi></munderover><msup><mrow><mo>(</mo><msub><mi>x</mi>'
         '<mi>i</mi></msub><mo>−</mo><mi>μ</mi><mo>)</mo></mrow><mn>2</mn></msup>'),
    math('<mi>y</mi><mo>=</mo><mi>γ</mi><mo>⊙</mo><mfrac><mrow><mi>x</mi><mo>−</mo><mi>μ</mi></mrow><msqrt><msup>'
         '<mi>σ</mi><mn>2</mn></msup><mo>+</mo><mi>ε</mi></msqrt></mfrac><mo>+</mo><mi>β</mi><mo>,</mo>'
         '<mspace width="1em"/><mi>ε</mi><mo>=</mo><msup><mn>10</mn><mrow><mo>−</mo><mn>5</mn></mrow></msup>'),
)
ATTN_FORMULAS = (
    math('<mo>[</mo><mi>Q</mi><mo>,</mo><mi>K</mi><mo>,</mo><mi>V</mi><mo>]</mo><mo>=</mo><mi>z</mi><msub>'
         '<mi>W</mi><mtext>attn</mtext></msub><mo>+</mo><msub><mi>b</mi><mtext>attn</mtext></msub>'),
    math('<msub><mi>A</mi><mi>h</mi></msub><mo>=</mo><mtext>softmax</mtext><mrow><mo>(</mo><mfrac><mrow><msub>'
         '<mi>Q</mi><mi>h</mi></msub><msubsup><mi>K</mi><mi>h</mi><mi>⊤</mi></msubsup></mrow><msqrt><msub>'
         '<mi>d</mi><mtext>head</mtext></msub></msqrt></mfrac><mo>+</mo><mi>M</mi><mo>)</mo></mrow><msub><mi>V</mi>'
         '<mi>h</mi></msub><mo>,</mo><mspace width="1em"/><msub><mi>M</mi><mrow><mi>i</mi><mi>j</mi></mrow></msub>'
         '<mo>=</mo><mrow><mo>{</mo><mtable><mtr><mtd><mn>0</mn></mtd><mtd><mi>j</mi><mo>≤</mo><mi>i</mi></mtd></mtr>'
         '<mtr><mtd><mo>−</mo><msup><mn>10</mn><mn>10</mn></msup></mtd><mtd><mi>j</mi><mo>&gt;</mo><mi>i</mi></mtd>'
         '</mtr></mtable></mrow>'),
    math('<mtext>out</mtext><mo>=</mo><mo>[</mo><msub><mi>A</mi><mn>1</mn></msub><mo>,</mo><mo>…</mo><mo>,</mo>'
         '<msub><mi>A</mi><mi>H</mi></msub><mo>]</mo><msub><mi>W</mi><mtext>proj</mtext></msub><mo>+</mo><msub>'
         '<mi>b</mi><mtext>proj</mtext></msub>'),
)
MLP_FORMULAS = (
    math('<mi>h</mi><mo>=</mo><mtext>GELU</mtext><mo>(</mo><mi>z</mi><msub><mi>W</mi><mtext>fc</mtext></msub>'
         '<mo>+</mo><msub><mi>b</mi><mtext>fc</mtext></msub><mo>)</mo><mo>,</mo><mspace width="1em"/><mtext>out'
         '</mtext><mo>=</mo><mi>h</mi><msub><mi>W</mi><mtext>proj</mtext></msub><mo>+</mo><msub><mi>b</mi>'
         '<mtext>proj</mtext></msub>'),
    math('<mtext>GELU</mtext><mo>(</mo><mi>u</mi><mo>)</mo><mo>=</mo><mfrac><mn>1</mn><mn>2</mn></mfrac><mi>u</mi>'
         '<mrow><mo>(</mo><mn>1</mn><mo>+</mo><mi>tanh</mi><mrow><mo>(</mo><msqrt><mfrac><mn>2</mn><mi>π</mi></mfrac>'
         '</msqrt><mo>(</mo><mi>u</mi><mo>+</mo><mn>0.044715</mn><msup><mi>u</mi><mn>3</mn></msup><mo>)</mo><mo>)'
         '</mo></mrow><mo>)</mo></mrow>'),
)
RESIDUAL_FORMULAS = (
    math("<msubsup><mi>x</mi><mi>n</mi><mo>′</mo></msubsup><mo>=</mo><msub><mi>x</mi><mi>n</mi></msub><mo>+</mo>"
         "<mtext>Attn</mtext><mo>(</mo><msub><mtext>LN</mtext><mn>1</mn></msub><mo>(</mo><msub><mi>x</mi><mi>n</mi>"
         "</msub><mo>)</mo><mo>)</mo>"),
    math("<msub><mi>x</mi><mrow><mi>n</mi><mo>+</mo><mn>1</mn></mrow></msub><mo>=</mo><msubsup><mi>x</mi><mi>n</mi>"
         "<mo>′</mo></msubsup><mo>+</mo><mtext>MLP</mtext><mo>(</mo><msub><mtext>LN</mtext><mn>2</mn></msub><mo>(</mo>"
         "<msubsup><mi>x</mi><mi>n</mi><mo>′</mo></msubsup><mo>)</mo><mo>)</mo>"),
)
EMBEDDING_FORMULAS = (
    math('<msub><mi>x</mi><mn>0</mn></msub><mo>[</mo><mi>t</mi><mo>]</mo><mo>=</mo><msub><mi>W</mi><mtext>te'
         '</mtext></msub><mo>[</mo><msub><mtext>token</mtext><mi>t</mi></msub><mo>]</mo><mo>+</mo><msub><mi>W</mi>'
         '<mtext>pe</mtext></msub><mo>[</mo><mi>t</mi><mo>]</mo>'),
)
HEAD_FORMULAS = (
    math('<mtext>logits</mtext><mo>=</mo><msub><mtext>LN</mtext><mi>f</mi></msub><mo>(</mo><msub><mi>x</mi><mi>L'
         '</mi></msub><mo>)</mo><mspace width="0.2em"/><msubsup><mi>W</mi><mtext>te</mtext><mi>⊤</mi></msubsup>'),
)

LN_TEXT = ('Each token\'s {n_embd} features are moved to mean 0 and variance 1 (over the features, not the '
           'batch), then scaled by γ (g) and shifted by β (b), both learned. ε = 10⁻⁵ keeps the root finite. '
           'Below: each token\'s mean and variance before and after, measured on this prompt; after the norm the '
           'variance is no longer 1, because γ and β have been applied.')
PANELS = {
    LN_1: Panel('LayerNorm 1', (LN_1,), (graph.Norm,), (28, 38), LN_TEXT, LN_FORMULAS,
                  '[B, T, n_embd] = [1, {T}, {n_embd}] → [1, {T}, {n_embd}]'),
    'attn': Panel('Attention', (C_ATTN, ATTN_PROJ),
                  (graph.attention_mask, graph.mask_attn_weights, graph.attention_weights, graph.Attn), (58, 112),
                  'c_attn turns each token into a query, a key and a value for every one of the {n_head} heads '
                  'at once ({n_embd} → 3 × {n_embd}); each head compares its {head_size}-feature queries with '
                  'the keys of the tokens before it (the mask hides the later ones with −10¹⁰, so their weight is '
                  '0 after the softmax), mixes the values with those weights, and c_proj mixes the heads back '
                  'into the residual stream. Below: the weights of every head for this prompt (row: the token '
                  'attending; column: the token attended to; darker is more).',
                  ATTN_FORMULAS,
                  'z [1, {T}, {n_embd}] → c_attn → Q, K, V [1, {n_head}, {T}, {head_size}] each → weights '
                  '[1, {n_head}, {T}, {T}] → heads merged [1, {T}, {n_embd}] → c_proj → [1, {T}, {n_embd}]'),
    LN_2: Panel('LayerNorm 2', (LN_2,), (graph.Norm,), (28, 38), LN_TEXT, LN_FORMULAS,
                  "[B, T, n_embd] = [1, {T}, {n_embd}] → [1, {T}, {n_embd}] (x'_n in, the MLP's input out)"),
    'mlp': Panel('MLP', (C_FC, MLP_PROJ), (graph.gelu, graph.Conv1D, graph.MLP), (115, 120),
                 'Per token, independently: c_fc expands the {n_embd} features to {n_inner}, the tanh GELU (the '
                 'approximation GPT-2 was trained with) passes positive inputs almost unchanged and squashes '
                 'negative ones towards 0, and c_proj projects back to {n_embd}. Below: the range of the GELU\'s '
                 'input on this prompt and the share of activations it leaves near zero.',
                 MLP_FORMULAS,
                 'z [1, {T}, {n_embd}] → c_fc → [1, {T}, {n_inner}] → GELU → [1, {T}, {n_inner}] → c_proj → '
                 '[1, {T}, {n_embd}]'),
    'residual': Panel('Residual adds', (), (graph.Block,), (123, 130),
                      'Each sublayer adds its output (its delta) to the residual stream instead of replacing it: '
                      "x'_n = x_n + attention delta, then x_{{n+1}} = x'_n + MLP delta. The dropout nodes are "
                      'inactive at inference (the original\'s released graph has none). Below: the L2 norm of '
                      'each token\'s vector before, of each delta, and after, for this prompt.',
                      RESIDUAL_FORMULAS, 'x_n, both deltas and x_{{n+1}}: [1, {T}, {n_embd}]'),
    'embeddings': Panel('Embeddings', (WTE, WPE), (graph.Graph.embed,), (152, 157),
                        'Token t\'s row of wte (one of {n_vocab}) plus position t\'s row of wpe (one of {n_ctx}) '
                        'is x_0, the first block\'s input. Below: the norms of both rows and of their sum, per '
                        'token of this prompt.',
                        EMBEDDING_FORMULAS, 'tokens [1, {T}] → x_0 [1, {T}, {n_embd}]'),
    LN_F: Panel(f'{LN_F} and the tied logits', (LN_F,), (graph.Graph.logits,), (167, 173),
                  'After the last block, ln_f normalizes each token\'s vector and the product with wte, the '
                  'token embedding itself (tied: no new parameters), gives a score for each of the {n_vocab} '
                  'tokens. Below: the top 10 next tokens after this prompt.',
                  HEAD_FORMULAS, 'x_L [1, {T}, {n_embd}] → ln_f → [1, {T}, {n_embd}] → × wteᵀ → [1, {T}, {n_vocab}]'),
}


def dims(shape) -> str:
    """A tensor's size as a product: conv1d's w [1, 768, 3072] reads 768 × 3,072 (its first axis is 1)."""
    shape = list(shape)[1:] if len(shape) == 3 and shape[0] == 1 else list(shape)
    return ' × '.join(f'{d:,}' for d in shape)


def stored_shapes(model_dir: Optional[str], model) -> tuple:
    """({variable: shape} of the checkpoint's tensors, where they were read); the model's own hparams' without a
    file (its original-format variables, whatever its dtype)."""
    if model_dir:
        try:
            folder = loading.resolve(model_dir)
            kind = 'Hugging Face weights' if folder.layout == 'hf' else 'checkpoint file'
            return loading.stored_shapes(folder), f'the {kind} in {model_dir}'
        except (OSError, ValueError):
            pass
    return variable_shapes(model.hparams), 'the variables of the model\'s original checkpoint'  # int8 scales not


def accounting(hp: HParams, stored: dict) -> dict:
    """Per component: rows (variable, stored shape, count), the Calculation, per instance, instances, across all."""
    found = {}
    for name, scope, variables, instances in components(hp):
        first = {v: stored.get(variable_name(scope, v, 0), ()) for v in variables}
        per_instance = sum(int(np.prod(s)) for s in first.values())
        across = sum(int(np.prod(stored.get(variable_name(scope, v, i), ()))) for i in range(instances)
                     for v in variables)
        found[name] = {'shapes': first, 'per_instance': per_instance, 'instances': instances, 'across': across,
                       'calculation': ' + '.join(dims(s) for s in first.values()) + f' = {per_instance:,}'}
    return found


def claimed(hp: HParams) -> set:
    """Every tensor name the components count: the model's own (a checkpoint may hold training state too)."""
    return {variable_name(scope, v, i) for _, scope, variables, instances in components(hp)
            for i in range(instances) for v in variables}


def accounting_table(parts: tuple, counted: dict, source: str, n_layer: int) -> str:
    """The panel's table: each component's tensors, its Calculation, per instance and across the blocks."""
    rows = ['<table class="accounting"><tr><th class="l">component</th>'
            '<th class="l">Calculation</th><th>per instance</th><th class="l">across the model</th></tr>']
    for name in parts:
        c = counted[name]
        tensors = ', '.join(f'{v} {list(s)}' for v, s in c['shapes'].items())
        times = c['per_instance'] * c['instances']
        across = (f'{c["per_instance"]:,} × {c["instances"]} blocks = {c["across"]:,}' if c['instances'] > 1
                  else f'{c["across"]:,}')
        if c['across'] != times:
            across += f' (the blocks\' tensors differ: {times:,} expected)'
        rows.append(f'<tr><td class="l">{LABELS[name]}<br><code class="tensors">{tensors}</code></td>'
                    f'<td class="l calc">{c["calculation"]}</td><td>{c["per_instance"]:,}</td>'
                    f'<td class="l calc">{across}</td></tr>')
    if len(parts) > 1:
        per = sum(counted[n]['per_instance'] for n in parts)
        total = sum(counted[n]['across'] for n in parts)
        calc = ' + '.join(f'{counted[n]["per_instance"]:,}' for n in parts) + f' = {per:,}'
        rows.append(f'<tr class="sum"><td class="l">per instance</td><td class="l calc">{calc}</td>'
                    f'<td>{per:,}</td><td class="l calc">{per:,} × {n_layer} blocks = {total:,}</td></tr>'
                    if counted[parts[0]]['instances'] > 1 else
                    f'<tr class="sum"><td class="l">together</td><td></td><td>{per:,}</td>'
                    f'<td class="l calc">{total:,}</td></tr>')
    rows.append('</table>')
    note = f'<p class="note">Counted from the tensors of {html.escape(source)} (their stored shapes).</p>'
    return ''.join(rows) + note


def source_code(objects: tuple) -> str:
    """This project's code for a component, read from its module now, with the file and lines."""
    out = []
    for obj in objects:
        lines, first = inspect.getsourcelines(obj)
        path = os.path.relpath(inspect.getsourcefile(obj), PACKAGE_ROOT)
        out.append(f'<figure class="code"><figcaption><code>{html.escape(path)}</code>, lines {first}–'
                   f'{first + len(lines) - 1}</figcaption><pre><code>{html.escape("".join(lines))}</code></pre>'
                   f'</figure>')
    return ''.join(out)


def original_link(lines: tuple) -> str:
    first, last = lines
    return (f'<p class="original">The original: <a href="{ORIGINAL}#L{first}-L{last}">openai/gpt-2 '
            f'<code>src/model.py</code>, lines {first}–{last}</a> at revision 9b63575.</p>')
