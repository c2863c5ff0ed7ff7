#!/usr/bin/env python3
"""Download a published GPT-2 model, as the original script does: python download_model.py 124M

Files go to checkpoints/<model>/; see `python download_model.py --help`.
"""

import sys

from gpt2_tf.download import main

if __name__ == '__main__':
    sys.exit(main())
