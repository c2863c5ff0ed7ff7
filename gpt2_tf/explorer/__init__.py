"""An explorer page of the block for any checkpoint and prompt, as one self-contained HTML file.

A diagram of the block whose components open their own panels (formula, shapes with this
checkpoint's numbers, the accounting counted from its tensors, this project's code beside the
original's lines, and the prompt's measured values, block by block through a selector), the residual
stream across the blocks, the logit lens and the final prediction. explore(model, tokens) computes
every number as numpy arrays (measure.py); write_report lays them out (page.py).
"""

from .measure import explore
from .page import render, token_label, write_report

__all__ = ['explore', 'render', 'token_label', 'write_report']
