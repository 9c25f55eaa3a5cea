"""The Responses API (docs/responses-api.md): ``input`` (with ``conversation``: the input items as chat messages)
parses a body, ``output`` encodes its events as a response object or its event stream, ``store`` keeps responses
for later turns, ``api`` gives parser and encoder to the route skeleton (``http/door.py``). It imports the shared
door layer (``service/http/*.py``), never another API's folder."""
