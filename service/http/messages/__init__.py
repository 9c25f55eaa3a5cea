"""The Messages API (docs/messages-api.md): ``input`` (with ``conversation``: system and messages as chat
messages) parses a body, ``output`` encodes its events as a message object or its event stream, ``api`` gives
parser and encoder to the route skeleton (``http/door.py``) and counts tokens. It imports the shared door layer
(``service/http/*.py``), never another API's folder."""
