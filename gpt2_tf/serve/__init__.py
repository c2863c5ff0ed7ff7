"""An OpenAI-compatible completions server over the library, one job per module:

- protocol.py: the request and response models, with OpenAI's field names; a
  request turns into checked rows there, through validate.py's checks;
- batcher.py: the Batcher, a queue whose one worker runs its rows in the
  slots of one in-flight batch (gpt2_tf.slots): rows join and leave between chunks;
- completion.py: a request's choices, from the rows' tokens to the response or
  the stream;
- app.py: create_app, whose routes are a few lines each;
- server.py: serve, which checks its port, then runs uvicorn on it.
"""

from .app import MAX_BODY, create_app
from .batcher import STREAM_CHUNK, Batcher, Row
from .completion import Choice, Completion, echo_logprobs
from .protocol import (MAX_LOGPROBS, APIError, CompletionChoice, CompletionRequest, CompletionResponse, ErrorResponse,
                       Logprobs, ModelList, Sampling, Usage)
from .server import PortTaken, bind, check_port, serve

__all__ = ['MAX_BODY', 'MAX_LOGPROBS', 'STREAM_CHUNK', 'APIError', 'Batcher', 'Choice', 'Completion',
           'CompletionChoice', 'CompletionRequest', 'CompletionResponse', 'ErrorResponse', 'Logprobs', 'ModelList',
           'PortTaken', 'Row', 'Sampling', 'Usage', 'bind', 'check_port', 'create_app', 'echo_logprobs', 'serve']
