"""The package's layering: each module imports only modules below it, never one above."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).parent.parent / 'gpt2_tf'

# Bottom to top. A module may import modules of lower layers only (lazy imports inside functions too).
LAYERS = [
    {'hparams', 'validate', 'assets', 'quiet', 'precision'},
    {'encoder', 'model'},
    {'decoding', 'compiled', 'tf1_reference', 'hf'},
    {'checkpoint', 'sample', 'scoring'},
    {'text', 'diagnostics', 'download', 'train'},
    {'export', 'serve', 'explorer', 'beam'},
    {'cli'},
    {'__main__'},
]


def imported(path: pathlib.Path) -> set:
    """The gpt2_tf modules a file imports, anywhere in it."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                names.add(node.module.split('.')[0])
            elif node.level == 1:
                names.update(alias.name for alias in node.names)
            elif node.module and node.module.startswith('gpt2_tf.'):
                names.add(node.module.split('.')[1])
        elif isinstance(node, ast.Import):
            names.update(a.name.split('.')[1] for a in node.names if a.name.startswith('gpt2_tf.'))
    return names


def test_every_module_has_a_layer():
    modules = {p.stem for p in PACKAGE.glob('*.py')} - {'__init__'}
    placed = set().union(*LAYERS)
    assert modules - placed == set(), 'place new modules in LAYERS'
    assert placed - modules == set(), 'LAYERS names modules that do not exist'


def test_no_module_imports_one_above_it():
    level = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    wrong = []
    for path in PACKAGE.glob('*.py'):
        if path.stem == '__init__':
            continue
        for name in imported(path):
            if level[name] >= level[path.stem]:
                wrong.append(f'{path.stem} (layer {level[path.stem]}) imports {name} (layer {level[name]})')
    assert not wrong, wrong


def test_no_submodule_shadows_an_exported_name():
    import gpt2_tf

    modules = {p.stem for p in PACKAGE.glob('*.py')}
    assert modules & set(gpt2_tf.__all__) == set()


def test_model_py_stays_close_to_the_originals_length():
    # openai/gpt-2 src/model.py at revision 9b63575 has 174 lines.
    assert len((PACKAGE / 'model.py').read_text().splitlines()) <= 1.5 * 174
