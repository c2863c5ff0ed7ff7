"""gpt2_tf: OpenAI's GPT-2 on TensorFlow 2, numerically faithful to the original graph."""

from .hparams import HParams
from .model import Model
from .checkpoint import CheckpointError, load_model, save_checkpoint

__all__ = ['HParams', 'Model', 'CheckpointError', 'load_model', 'save_checkpoint']
__version__ = '0.1.0'
