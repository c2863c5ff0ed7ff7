"""gpt2_tf: OpenAI's GPT-2 on TensorFlow 2, numerically faithful to the original graph.

    model = gpt2_tf.load_model('test')        # the bundled test checkpoint; or 'checkpoints/124M', '124M'
    out = model(tokens)                       # {'logits', 'present'}
    ids = gpt2_tf.sample_sequence(model, 40, context=gpt2_tf.encode('Hello'))
    texts = gpt2_tf.generate(model, 'Hello', length=40)

Names are imported on first use, so `import gpt2_tf` stays quick and the
tokenizer works without loading TensorFlow. When TensorFlow does load, its
start-up lines are captured as the command line captures them (see
gpt2_tf.quiet), unless the program set TF_CPP_MIN_LOG_LEVEL or imported
TensorFlow itself first.
"""

import importlib

from . import quiet as _quiet

_quiet.library()

__version__ = '0.1.0'

_EXPORTS = {
    'HParams': 'hparams',
    'Model': 'runtime',
    'CheckpointError': 'checkpoint',
    'GPT2Error': 'validate',
    'load_model': 'loading',
    'resolve': 'loading',
    'save_checkpoint': 'checkpoint',
    'save_hf': 'hf',
    'export_saved_model': 'export',
    'sample_sequence': 'sample',
    'top_k_logits': 'sample',
    'top_p_logits': 'sample',
    'Encoder': 'encoder',
    'get_encoder': 'encoder',
    'encode': 'encoder',
    'decode': 'encoder',
    'generate': 'text',
    'sample_chunks': 'sample',
    'score': 'scoring',
    'perplexity': 'scoring',
    'score_completion': 'scoring',
    'trace': 'diagnostics',
    'parameter_table': 'diagnostics',
    'compare': 'diagnostics',
    'explore': 'explorer',
    'encode_corpus': 'corpus',
    'read_tokens': 'corpus',
    'finetune': 'train',
    'FinetuneConfig': 'train_config',
    'export_litert': 'litert',
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f'.{_EXPORTS[name]}', __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
