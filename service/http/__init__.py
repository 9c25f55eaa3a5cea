"""The OpenAI-compatible HTTP front door: a FastAPI app on uvicorn, in the same process and asyncio event loop as
the grpc.aio server, over the same AsyncEngine (one engine, one scheduler, one admission limit).

The shared door layer is this folder's modules: ``app`` holds the routes; ``door`` is the one route skeleton every
generating API shares (authorize, read, parse, images, open, answer, 499), given each API's parser and encoder;
``body`` reads and decodes the JSON; ``fields`` (the field readers and the unknown / no-op field rule), ``knobs``
(the knobs and output constraints as body fields) and ``call`` (a checked request: the engine's ``Submission`` and
the door's options) are what every API's parser shares; ``choices`` opens a request's choices, ``sse`` frames
server-sent events, ``event_encoder`` is the output-item state machine of the agent APIs. The APIs, each in its
folder: ``openai/`` (chat and completions, /tokenize), ``responses/`` and ``messages/``; they import the shared
layer, never each other. ``errors`` maps exceptions to error bodies and HTTP statuses; ``access_log`` names, logs
and counts every request; ``gate`` is what the routes need from the server; ``front_door`` binds the port and runs
uvicorn on the running loop.
"""
