"""The OpenAI-compatible HTTP front door: a FastAPI app on uvicorn, in the same process and asyncio event loop as
the grpc.aio server, over the same AsyncEngine (one engine, one scheduler, one admission limit).

``app`` holds the routes; ``generate`` answers the two generation routes: ``body`` reads and decodes the JSON,
``protocol`` turns it into dgserve objects (the HTTP twin of ``convert``'s request side), and the request's events
(``service.events``, shared with the gRPC door) become OpenAI JSON in ``responses`` or server-sent events in
``sse``. ``errors`` maps exceptions to OpenAI error bodies and HTTP statuses; ``access_log`` names, logs and counts
every request; ``gate`` is what the routes need from the server; ``front_door`` binds the port and runs uvicorn on
the running loop.
"""
