"""The gpt2-tf command: a thin layer over the library.

    gpt2-tf generate "PROMPT"     conditional samples, like interactive_conditional_samples.py
    gpt2-tf generate              the interactive mode: prompts from the terminal
    gpt2-tf sample                unconditional samples, like generate_unconditional_samples.py
    gpt2-tf score FILE...         per-token log-probabilities and perplexity of text files
    gpt2-tf finetune DATASET      fine-tuning, with gpt-2-simple's options and run folders
    gpt2-tf encode TEXT... OUT    text to a token file (.bin) or to gpt-2-simple's .npz of chunks
    gpt2-tf export MODEL_DIR OUT  a SavedModel for TensorFlow Serving
    gpt2-tf serve                 an OpenAI-compatible completions server
    gpt2-tf convert SRC DST --to hf|original   Hugging Face folders, both ways
    gpt2-tf inspect MODEL_DIR     parameter accounting, from hparams and from the checkpoint
    gpt2-tf explore MODEL_DIR     an HTML page of the block, with the logit lens
    gpt2-tf compare MODEL_DIR     this port against the TF1 graph, block by block

One module per group of commands: generation (generate, sample, score),
training (finetune, encode), deploy (export, serve, convert), inspection
(inspect, explore, compare), and common, what they share: the model found
through loading.resolve (a folder of any layout, a published name, or `test`
for the bundled checkpoint) and opened by open_model. Every argument is checked
before TensorFlow loads (it takes seconds, the model minutes for 1558M); errors
are one line on stderr and exit 2.
"""

from __future__ import annotations

import re
import sys
import warnings

from ..validate import GPT2Error, first_line
from . import deploy, generation, inspection, training
from .common import BANNER, CommandError, Parser, one_line

__all__ = ['BANNER', 'CommandError', 'main', 'parser']


def parser() -> Parser:
    top = Parser(prog='gpt2-tf', description='GPT-2 on TensorFlow 2, faithful to the original. The bundled test '
                                             'checkpoint is named test: --model_name test, or MODEL_DIR test.')
    commands = top.add_subparsers(dest='command', required=True, metavar='COMMAND')
    generation.add_commands(commands)  # generate, sample, score
    training.add_commands(commands)  # finetune, encode
    deploy.add_commands(commands)  # export, serve
    inspection.add_commands(commands)  # explore
    deploy.add_convert(commands)
    inspection.add_inspect_and_compare(commands)
    for command in commands.choices.values():
        command.set_defaults(command_parser=command)
    return top


def as_typed(message: str, argv: list) -> str:
    """A message's numbers (a numpy repr such as np.float64(3.0), or the 3.0 after 'got') as the command line had
    them (3)."""
    typed = [part for a in argv for part in re.split(r'[=,:]', a)]  # --x=3, and the numbers of 5:500,7:-1

    def number(match):
        inner = match.group(1) or match.group(2)
        for text in typed:
            try:
                if float(text) == float(inner):
                    return text
            except ValueError:
                continue
        return inner

    return re.sub(r'np\.\w+\(([-+.\deE]+)\)|(?<=got )(-?inf|[-+]?\d[\d.]*(?:[eE][-+]?\d+)?)', number, message)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, extras = parser().parse_known_args(argv)
    if extras:
        args.command_parser.unknown(extras)  # exits 2, with the subcommand's usage
    shown = warnings.formatwarning
    warnings.formatwarning = one_line
    try:
        args.run(args)
    except KeyboardInterrupt as e:  # finetune's says which step it saved
        print(f'\ngpt2-tf: {e}' if str(e) else '', file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except (GPT2Error, OSError) as e:  # OSError: a file that cannot be read or written
        print(f'gpt2-tf: error: {as_typed(first_line(e), argv)}', file=sys.stderr)
        return 2
    except Exception as e:  # TensorFlow's own errors: still one line, with --verbose for the details
        if getattr(args, 'verbose', False) or not type(e).__module__.startswith('tensorflow'):
            raise
        print(f'gpt2-tf: error: {first_line(e)} (run with --verbose for details)', file=sys.stderr)
        return 2
    finally:
        warnings.formatwarning = shown
    return 0
