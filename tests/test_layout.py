"""The package's shape: layering without cycles, one block, one rule, one table, short functions."""

import ast
import pathlib
import re

PACKAGE = pathlib.Path(__file__).parent.parent / 'gpt2_tf'

# Bottom to top. A module may import modules of lower layers only (lazy imports inside functions too).
# A subpackage is one entry, its modules named 'package.module'; inside it the same rule holds.
LAYERS = [
    {'validate'},
    {'quiet'},
    {'assets', 'kernels', 'filters', 'thresholds', 'tensorfiles', 'interrupts'},
    {'hparams', 'precision', 'causal', 'encoder', 'noise', 'train_config', 'penalties'},
    {'model', 'corpus', 'litert_run', 'distribute'},
    {'runtime', 'tf1_reference', 'compiled', 'dataset'},
    {'decoding', 'checkpoint', 'scoring', 'lora'},
    {'sample', 'hf', 'download', 'runfolder', 'litert'},
    {'loading', 'slots'},
    {'text', 'diagnostics', 'train', 'export'},
    {'serve', 'explorer', 'beam'},
    {'cli'},
    {'console'},
    {'__main__'},
]


def modules() -> dict:
    """{dotted name under gpt2_tf: path} for every module, subpackages included ('serve.app')."""
    found = {}
    for path in PACKAGE.rglob('*.py'):
        parts = path.relative_to(PACKAGE).with_suffix('').parts
        if parts[-1] == '__init__':
            parts = parts[:-1]
        if parts:
            found['.'.join(parts)] = path
    return found


def top(name: str) -> str:
    return name.split('.')[0]


def imported(name: str, path: pathlib.Path) -> set:
    """The gpt2_tf modules a file imports, anywhere in it, as dotted names under gpt2_tf."""
    package = name.split('.')[:-1] if path.name != '__init__.py' else name.split('.')
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                stem = base + (node.module.split('.') if node.module else [])
                if node.module:
                    names.add('.'.join(stem))
                else:
                    names.update('.'.join(stem + [alias.name]) for alias in node.names)
            elif node.module and node.module.startswith('gpt2_tf.'):
                names.add(node.module[len('gpt2_tf.'):])
        elif isinstance(node, ast.Import):
            names.update(a.name[len('gpt2_tf.'):] for a in node.names if a.name.startswith('gpt2_tf.'))
    return names


def package_sources() -> dict:
    return {name: path.read_text() for name, path in modules().items()}


def test_every_module_has_a_layer():
    tops = {top(name) for name in modules()}
    placed = set().union(*LAYERS)
    assert tops - placed == set(), 'place new modules in LAYERS'
    assert placed - tops == set(), 'LAYERS names modules that do not exist'


def test_no_module_imports_one_above_it():
    level = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    wrong = []
    for name, path in modules().items():
        for other in imported(name, path):
            if top(other) == top(name):
                continue  # within a subpackage: see test_no_import_cycles
            if top(other) not in level:
                wrong.append(f'{name} imports unknown module {other}')
            elif level[top(other)] >= level[top(name)]:
                wrong.append(f'{name} (layer {level[top(name)]}) imports {other} (layer {level[top(other)]})')
    assert not wrong, wrong


def test_no_import_cycles():
    known = modules()
    graph = {name: {o for o in imported(name, path) if o in known and o != name} for name, path in known.items()}
    for name in graph:  # a package's __init__ re-exporting its modules is not a cycle
        if name in {top(n) for n in known if '.' in n}:
            graph[name] = set()
    state = {}

    def visit(node, stack):
        state[node] = 'open'
        for nxt in graph[node]:
            if state.get(nxt) == 'open':
                raise AssertionError('import cycle: ' + ' -> '.join(stack + [node, nxt]))
            if nxt not in state:
                visit(nxt, stack + [node])
        state[node] = 'done'

    for name in graph:
        if name not in state:
            visit(name, [])


def test_no_submodule_shadows_an_exported_name():
    import gpt2_tf

    assert {top(name) for name in modules()} & set(gpt2_tf.__all__) == set()


def test_model_py_reads_beside_the_original():
    # openai/gpt-2 src/model.py at revision 9b63575 has 174 lines; ours adds docstrings, shape comments, the
    # block's two residual halves as methods (training's recompute wraps each), and the key/value source's own
    # way to attend (Past's hands a whole sequence's attention to gpt2_tf.causal).
    assert len((PACKAGE / 'model.py').read_text().splitlines()) <= 253


def test_no_function_over_80_lines():
    long = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 80:
                    long.append(f'{name}.{node.name}: {lines} lines')
    assert not long, long


def calls(attribute: str) -> list:
    """Where `.attribute(` is called in the package, outside the TF1 reference graph."""
    pattern = re.compile(r'\.' + attribute + r'\(')
    return [f'{name}:{i}' for name, text in package_sources().items() if name != 'tf1_reference'
            for i, line in enumerate(text.splitlines(), 1) if pattern.search(line.split('#')[0])]


def test_the_block_and_the_head_are_called_in_one_place():
    # One block: its second half and the final norm each run from exactly one line of the package.
    for sublayer in ('ln_2', 'mlp', 'ln_f'):
        assert len(calls(sublayer)) == 1, (sublayer, calls(sublayer))


def test_one_table_of_the_block_variables():
    # The names live in checkpoint.VARIABLES; other modules derive them instead of spelling them out.
    spelled = [name for name, text in package_sources().items() if re.search(r"""['"]ln_1""", text)]
    assert len(spelled) <= 3, spelled
    tables = [name for name, text in package_sources().items() if "'mlp/c_fc/w'" in text or "mlp/c_fc/w'" in text]
    assert tables == ['checkpoint'], tables


def test_one_bucket_function_one_checkpoint_file_reader_one_end_of_text():
    sources = package_sources()
    buckets = [name for name, text in sources.items() if re.search(r'^\s*def _?bucket\(', text, re.M)]
    assert buckets == ['compiled'], buckets
    readers = [name for name, text in sources.items() if re.search(r'model_checkpoint_path:\\s', text)]
    assert readers == ['checkpoint'], readers
    defined = [name for name, text in sources.items() if re.search(r'^END_OF_TEXT\w* = ', text, re.M)]
    assert len(defined) <= 2 and set(defined) <= {'encoder'}, defined
    hparams_writers = [name for name, text in sources.items() if re.search(r"hparams\.json'.*\n.*json\.dump", text)]
    assert hparams_writers == [], hparams_writers
