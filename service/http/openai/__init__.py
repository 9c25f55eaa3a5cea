"""The chat and completions API (OpenAI's ``/v1/chat/completions`` and ``/v1/completions``, vLLM's ``/tokenize``):
``input`` parses a body into a ``Call``, ``output`` and ``stream`` encode its choices' events, ``api`` gives both
to the route skeleton (``http/door.py``), ``tokens`` answers /tokenize and /detokenize. It imports the shared door
layer (``service/http/*.py``), never another API's folder."""
