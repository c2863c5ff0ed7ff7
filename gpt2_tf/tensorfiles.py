"""PyTorch's tensor files (pytorch_model.bin, adapter_model.bin), read without running their code.

Shared by the HF folders (hf) and the LoRA adapters (lora), each passing its own error type.
"""

from __future__ import annotations

import re
from typing import Type

from .validate import GPT2Error, first_line

SAVE_STATE = "save the model's state_dict() itself (torch.save(model.state_dict(), ...))"


def unreadable(file: str, e: Exception, error: Type[GPT2Error] = GPT2Error) -> GPT2Error:
    """A read failure of a weights file, as one line that names the file."""
    return error(f'{file}: cannot be read ({first_line(e)}); is the file complete? Copy or download it again')


def read_torch(file: str, error: Type[GPT2Error] = GPT2Error) -> dict:
    """{name: numpy array} of a PyTorch state dict file, loaded with weights_only=True (no pickled code runs);
    each tensor in its own dtype (bfloat16 as ml_dtypes' numpy one), as safetensors reads them: the caller
    converts, and says so, the same way for both file kinds."""
    try:
        import torch
    except ImportError:
        raise error(f'{file} is a PyTorch file and reading it needs torch (pip install torch==2.13.0); '
                    f'its safetensors form needs only the safetensors package') from None
    try:
        state = torch.load(file, map_location='cpu', weights_only=True)
    except Exception as e:  # a truncated zip, random bytes, or objects besides tensors (a whole model)
        other = re.search(r'Unsupported global: GLOBAL ([\w.]+)', str(e))
        if other:  # torch refuses them by design: unpickling would run their code
            raise error(f'{file}: holds a pickled {other.group(1)}, not only tensors, and is not read, since '
                        f'unpickling it would run its code; {SAVE_STATE}') from None
        raise unreadable(file, e, error) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        kind = type(state).__name__ if not isinstance(state, dict) else 'a dict holding more than tensors'
        raise error(f'{file}: expected a state dict of tensor names to tensors, found {kind}; {SAVE_STATE}')
    return {name: _numpy(value, torch) for name, value in state.items()}


def _numpy(tensor, torch):
    """A CPU tensor as a numpy array of its dtype; numpy has no bfloat16, so those bits are viewed as ml_dtypes'."""
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()
