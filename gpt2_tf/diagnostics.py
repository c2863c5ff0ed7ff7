"""Seeing inside the model: parameter accounting, named block states, and a block-by-block diff against TF1.

The named states of each block (STATE_NAMES), and on request attn_weights,
the softmaxed attention [batch, heads, dst, src], are what the model's own
blocks record as they run (model.Block's record). The components and their
variables derive from checkpoint.VARIABLES, the one table of the graph's names.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import numpy as np
import tensorflow as tf

from .checkpoint import VARIABLES, in_block, variable_shapes
from . import loading
from .loading import load_model
from .hparams import HParams
from .model import positions_for
from .runtime import Model

# The states trace records per block, in forward order.
STATE_NAMES = {
    'x': 'x_n, the block input (the embeddings for h0)',
    'z1': 'the first norm of x_n, ln_1(x_n)',
    'attn': 'the attention delta, attn(z1)',
    'x_attn': "x'_n = x_n + attention delta",
    'z2': "the second norm of x'_n, ln_2(x'_n)",
    'mlp': 'the mlp delta, mlp(z2)',
    'out': "x_{n+1} = x'_n + mlp delta, the block output",
}

# The model's parts, from checkpoint.VARIABLES: (component, scope under model/ with {i} for the block,
# whether there is one per block), in the table's order.
COMPONENTS = list({component: (component, name if '/' not in name else name.rsplit('/', 1)[0], in_block(name))
                   for name, _, component in VARIABLES}.values())

def variable_name(scope: str, variable: str, layer: int = 0) -> str:
    """The checkpoint name of a component's variable: ('h{i}/ln_1', 'g', 3) -> model/h3/ln_1/g."""
    scope = scope.format(i=layer)
    return f'model/{scope}' if scope == variable else f'model/{scope}/{variable}'


def components(hp: HParams) -> list:
    """(component, scope, {variable: shape}, instances) per part, with the shapes of checkpoint.variable_shapes."""
    shapes = variable_shapes(hp)
    table = []
    for name, scope, per_block in COMPONENTS:
        prefix = 'model/' + scope.format(i=0)
        own = {key.rsplit('/', 1)[-1]: list(shape) for key, shape in shapes.items()
               if key == prefix or key.rsplit('/', 1)[0] == prefix}
        table.append((name, scope, own, hp.n_layer if per_block else 1))
    return table


# Forward order, in which the first divergence is looked for.
COMPARED_STATES = ['x', 'z1', 'attn_weights', 'attn', 'x_attn', 'z2', 'mlp', 'out']


def parameter_table(model_dir: str | os.PathLike) -> dict:
    """Per component: shapes and counts from the hparams, and the count in the folder's own tensors (either layout)."""
    folder = loading.resolve(model_dir)
    hp, stored = folder.hparams(), loading.stored_shapes(folder)
    rows, claimed = [], set()
    for name, scope, shapes, instances in components(hp):
        per_instance = sum(int(np.prod(s)) for s in shapes.values())
        found, misshapen, missing = 0, [], []
        for i in range(instances):
            for variable, shape in shapes.items():
                key = variable_name(scope, variable, i)
                claimed.add(key)
                found += int(np.prod(stored[key])) if key in stored else 0
                if key not in stored:
                    missing.append(f'{name}: {key} is missing from the checkpoint')
                elif tuple(stored[key]) != tuple(shape):  # as many values, laid out otherwise
                    misshapen.append(f'{name}: {key} is {list(stored[key])}, the hparams give {list(shape)}')
        rows.append({'component': name, 'shape': {k: v for k, v in shapes.items()},
                     'per_instance': per_instance, 'instances': instances,
                     'expected': per_instance * instances, 'checkpoint': found,
                     'match': found == per_instance * instances and not misshapen and not missing,
                     'misshapen': misshapen[:1], 'missing': missing[:1]})
    # The sublayers' sums (attn, mlp: their components 'attn.*', 'mlp.*') and the whole block's.
    in_blocks = [name for name, _, per_block in COMPONENTS if per_block]
    groups = {group: [name for name in in_blocks if name.startswith(group + '.')] for group in ('attn', 'mlp')}
    groups['block'] = in_blocks
    by_name = {row['component']: row for row in rows}
    subtotals = [{'group': group, 'per_instance': sum(by_name[m]['per_instance'] for m in members),
                  'instances': hp.n_layer, 'expected': sum(by_name[m]['expected'] for m in members),
                  'checkpoint': sum(by_name[m]['checkpoint'] for m in members)} for group, members in groups.items()]
    unclaimed = sorted(set(stored) - claimed)
    mismatches = [(row['misshapen'] + row['missing'] + [row['component']])[0] for row in rows if not row['match']]
    if unclaimed:
        mismatches.append(f'{len(unclaimed)} checkpoint variable(s) outside the model: {", ".join(unclaimed[:5])} '
                          f'(training state, or a head GPT-2 does not have? the commands that load it pass over it '
                          f'with --no_strict)')
    shown = folder.checkpoint or folder.path if isinstance(model_dir, loading.ModelFolder) else os.fspath(model_dir)
    return {'model_dir': shown, 'hparams': hp.to_dict(), 'rows': rows, 'groups': subtotals,
            'total_expected': sum(r['expected'] for r in rows),
            'total_checkpoint': sum(int(np.prod(s)) for s in stored.values()),
            'mismatches': mismatches}


def format_table(table: dict) -> str:
    lines = [f'{table["model_dir"]}: ' + ', '.join(f'{k}={v}' for k, v in table['hparams'].items()), '']
    header = f'{"component":<13}{"shape":<32}{"per instance":>14}{"x":>4}{"from hparams":>15}{"in checkpoint":>15}'
    lines += [header, '-' * len(header)]
    for row in table['rows']:
        shape = ', '.join(f'{k}{v}'.replace(' ', '') for k, v in row['shape'].items())
        flag = '' if row['match'] else '  MISMATCH'
        lines.append(f'{row["component"]:<13}{shape:<32}{row["per_instance"]:>14,}{row["instances"]:>4}'
                     f'{row["expected"]:>15,}{row["checkpoint"]:>15,}{flag}')
    lines.append('-' * len(header))
    for group in table['groups']:
        lines.append(f'{group["group"] + " (sum)":<45}{group["per_instance"]:>14,}{group["instances"]:>4}'
                     f'{group["expected"]:>15,}{group["checkpoint"]:>15,}')
    lines.append(f'{"total":<63}{table["total_expected"]:>15,}{table["total_checkpoint"]:>15,}')
    for problem in table['mismatches']:
        lines.append(f'MISMATCH: {problem}')
    return '\n'.join(lines)


def trace(model: Model, tokens, *, attention_weights: bool = False) -> list:
    """Runs tokens [batch, sequence] eagerly; returns per block a dict of its named states as numpy.

    The names are STATE_NAMES; attention_weights adds 'attn_weights'. The states
    are what the model's own blocks record as they run (Block's record), so 'out'
    of the last block is what the model computes before ln_f.
    """
    tokens = tf.constant(model.check_inputs(tokens), tf.int32)
    states = [{} for _ in model.h]

    def record(layer, **named):
        states[layer].update({name: value.numpy() for name, value in named.items()
                              if name in STATE_NAMES or attention_weights})

    model.blocks(model.embed(tokens, positions_for(tokens, 0)), record=record)
    return states


def compare(model_dir: str | os.PathLike, tokens: Sequence, *, model: Optional[Model] = None,
            scale: float = 1e-4, strict: bool = True) -> dict:
    """Runs the TF1 reference graph and this port on the same tokens; max |diff| per block and state.

    model_dir: an original-layout folder or run folder, or a model name. The tolerance
    for each state is scale x max(1, max |reference|). model, when given, stands in for
    the port (say, one changed in memory); the reference always reads the checkpoint in
    model_dir. strict=False loads a checkpoint that also holds variables the model does
    not have (the reference ignores them too). first_divergence names the first state,
    in forward order, past its tolerance.
    """
    from .tf1_reference import Reference

    folder = loading.resolve(model_dir).original()
    model = model or load_model(folder, strict=strict)
    tokens = model.check_inputs(tokens).astype(np.int32)
    reference = Reference(model.hparams, folder.prefix())
    try:
        theirs = reference.trace(tokens)
        their_logits = reference(tokens)['logits']
    finally:
        reference.close()
    ours = trace(model, tokens, attention_weights=True)
    rows = []
    for block, (mine, ref) in enumerate(zip(ours, theirs)):
        for state in COMPARED_STATES:
            rows.append(_diff(f'h{block}', state, mine[state], ref[state], scale))
    rows.append(_diff('ln_f', 'logits', model(tokens)['logits'].numpy(), their_logits, scale))
    first = next((row for row in rows if not row['ok']), None)
    return {'rows': rows, 'first_divergence': first and {'block': first['block'], 'state': first['state']}}


def _diff(block, state, mine, ref, scale) -> dict:
    diff = float(np.abs(mine - ref).max())
    tolerance = scale * max(1.0, float(np.abs(ref).max()))
    return {'block': block, 'state': state, 'max_abs_diff': diff, 'tolerance': tolerance, 'ok': diff <= tolerance}


def format_comparison(report: dict) -> str:
    lines = [f'{"block":<7}{"state":<14}{"max |diff|":>12}{"tolerance":>12}']
    for row in report['rows']:
        mark = '' if row['ok'] else '  <-- past tolerance'
        lines.append(f'{row["block"]:<7}{row["state"]:<14}{row["max_abs_diff"]:>12.3g}{row["tolerance"]:>12.3g}{mark}')
    first = report['first_divergence']
    lines.append('all states within tolerance' if first is None else
                 f'first divergence: block {first["block"]}, state {first["state"]}')
    return '\n'.join(lines)
